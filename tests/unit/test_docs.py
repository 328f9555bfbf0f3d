"""The README stays short, every docs/ file is linked from it, and no link in README.md or docs/*.md is dangling."""

import glob
import os
import re

from conftest import TESTS

ROOT = os.path.dirname(TESTS)
README = os.path.join(ROOT, "README.md")
DOCS = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
DOCS_PATH = re.compile(r"`(docs/[^`\s]+\.md)`")  # `docs/....md`, read from the repository root


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def dangling_links(text: str, where: str, root: str = ROOT) -> list:
    """Relative link targets in `text` (a file in folder `where`) and backticked docs/ paths that name no file."""
    missing = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):  # http(s), mailto; an anchor on this page
            continue
        path = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(where, path))):
            missing.append(target)
    missing += [path for path in DOCS_PATH.findall(text) if not os.path.exists(os.path.join(root, path))]
    return missing


def test_readme_is_at_most_250_lines():
    lines = _read(README).count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move detail into docs/"


def test_no_dangling_links():
    dangling = {os.path.relpath(path, ROOT): dangling_links(_read(path), os.path.dirname(path))
                for path in [README] + DOCS}
    assert {k: v for k, v in dangling.items() if v} == {}


def test_control_a_missing_file_is_flagged():
    text = ("[ok](docs/versions.md#tested-releases) [web](https://example.org/x.md) [here](#anchor) "
            "[gone](docs/no_such_topic.md) `docs/no_such_file.md` `docs/overrides.md`")
    assert dangling_links(text, ROOT) == ["docs/no_such_topic.md", "docs/no_such_file.md"]
    # relative to the linking file's folder: from docs/, "versions.md" exists and "docs/versions.md" does not
    assert dangling_links("[a](versions.md) [b](docs/versions.md)", os.path.join(ROOT, "docs")) == ["docs/versions.md"]


def test_every_docs_file_is_linked_from_the_readme():
    targets = {os.path.normpath(os.path.join(ROOT, t.split("#", 1)[0])) for t in LINK.findall(_read(README))}
    unlinked = [os.path.relpath(path, ROOT) for path in DOCS
                if os.path.basename(path) != "README.md" and os.path.normpath(path) not in targets]
    assert unlinked == [], "docs/ files the README does not link"

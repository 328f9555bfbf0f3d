"""Rewrites the table of DeepSpeed overrides in docs/overrides.md from the register (deepspeed_bnb/overrides.py).

Between its two markers docs/overrides.md holds exactly `section(overrides.table())`, nothing else (no log line):
tests/unit/test_overrides.py compares the whole text between the markers with it. Run this to update it:
    python tools/render_overrides.py
"""

import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "overrides.md")
BEGIN, END = "<!-- overrides: begin (tools/render_overrides.py) -->", "<!-- overrides: end -->"


def section(table: str) -> str:
    """The exact text between the markers: the table on lines of its own."""
    return f"\n{table}\n"


def load_register():
    """deepspeed_bnb/overrides.py alone, by file path: importing the package would install the overrides and check
    versions, and importing DeepSpeed prints log lines; the register module imports neither."""
    spec = importlib.util.spec_from_file_location(
        "overrides", os.path.join(REPO, "deepspeed_bnb", "overrides.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main():
    module = load_register()
    path = os.path.join(REPO, DOC)
    with open(path) as f:
        text = f.read()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{DOC} needs exactly one {BEGIN} and one {END} marker")
    block = BEGIN + section(module.table()) + END
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)
    print(f"{DOC}: {len(module.OVERRIDES)} overrides")


if __name__ == "__main__":
    main()

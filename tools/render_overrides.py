"""Rewrites the README's table of DeepSpeed overrides from the register (deepspeed_bnb/overrides.py).

tests/test_overrides.py fails while the README's table differs from the register; run this to update it:
    python tools/render_overrides.py
"""

import importlib.util
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- overrides: begin (tools/render_overrides.py) -->", "<!-- overrides: end -->"


def main():
    # the register module alone: importing the package would install the overrides (and check versions)
    spec = importlib.util.spec_from_file_location(
        "overrides", os.path.join(REPO, "deepspeed_bnb", "overrides.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = os.path.join(REPO, "README.md")
    with open(path) as f:
        text = f.read()
    block = f"{BEGIN}\n{module.table()}\n{END}"
    if BEGIN not in text:
        raise SystemExit(f"README.md has no {BEGIN} marker: add the section first")
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    with open(path, "w") as f:
        f.write(text)
    print(f"README.md: {len(module.OVERRIDES)} overrides")


if __name__ == "__main__":
    main()

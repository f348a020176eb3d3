"""The lines of code of each technique section, its core and its parts (the README's table).

    python tests/section_lines.py              # every script whose section has `### more:` parts
    python tests/section_lines.py zero.py      # these scripts

A line of code is neither blank, nor a comment, nor in a docstring, as tests/test_skeleton.py's
core_lines counts it (its CORE_LINES guard). The core runs from a `### begin:` line to the first
`### more:` line of its section (or its `### end:`), the parts from there to the `### end:` line;
a script with two sections counts both. It prints a Markdown table.
"""

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def docstring_lines(text):
    """The numbers (from 1) of the lines inside a docstring."""
    lines = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def section_lines(text):
    """(core, parts): the lines of code of `text`'s technique sections before their first
    `### more:` line, and from it to their `### end:` line."""
    docstrings = docstring_lines(text)
    core = 0
    parts = 0
    in_section = False
    in_part = False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("### begin:"):
            in_section = True
            in_part = False
            continue
        if line.startswith("### end:"):
            in_section = False
            continue
        if line.startswith("### more:"):
            in_part = True
            continue
        is_code = line.strip() and not line.lstrip().startswith("#") and number not in docstrings
        if in_section and is_code:
            if in_part:
                parts += 1
            else:
                core += 1
    return core, parts


def main():
    if len(sys.argv) > 1:
        scripts = [Path(name).name for name in sys.argv[1:]]
    else:
        scripts = sorted(p.name for p in ROOT.glob("*.py") if "\n### more:" in p.read_text())
    print("| script | core | parts |")
    print("|---|---|---|")
    for script in scripts:
        core, parts = section_lines((ROOT / script).read_text())
        print(f"| `{script}` | {core} | {parts} |")


if __name__ == "__main__":
    main()

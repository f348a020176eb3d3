"""A technique script with every `### more:` part deleted: its core alone.

    python tests/strip_parts.py zero.py OUT.py

Each part runs from its `### more:` line to the next `### more:` or `### end:` line; the deletion
keeps the `### end:` line and everything outside the section. The copy imports `common` like its
original, so run it with the repository root on PYTHONPATH (tests/test_core_alone.py does).
"""

import sys
from pathlib import Path


def strip_parts(text):
    """`text` without its `### more:` parts, and the number of parts deleted."""
    kept = []
    in_part = False
    parts = 0
    for line in text.splitlines(keepends=True):
        if line.startswith("### more:"):
            in_part = True
            parts += 1
            continue
        if line.startswith("### end:"):
            in_part = False
        if not in_part:
            kept.append(line)
    return "".join(kept), parts


def main():
    source = Path(sys.argv[1])
    target = Path(sys.argv[2])
    text, parts = strip_parts(source.read_text())
    target.write_text(text)
    print(f"{source}: {parts} parts deleted, {len(text.splitlines())} lines left in {target}")


if __name__ == "__main__":
    main()

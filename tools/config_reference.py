"""Print the config reference (every key, its default and its comment) as a Markdown table.

The comments in distribuuuu/config/defaults.py are the single source: ``python tools/config_reference.py``
prints the table; ``python tools/config_reference.py --write`` regenerates it in docs/config-reference.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from distribuuuu.config import defaults  # noqa: E402

_KEY_LINE = re.compile(r"^_C\.([A-Z0-9_.]+) = (?!CN\(\))")


def key_comments(source: str) -> dict[str, str]:
    """Map each config key to the comment lines right above its definition."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in source.splitlines():
        stripped = line.strip()
        match = _KEY_LINE.match(stripped)
        if stripped.startswith("# ") and not stripped.startswith("# ---"):
            pending.append(stripped[2:])
        elif match:
            comments[match.group(1)] = " ".join(pending)
            pending = []
        else:
            pending = []
    return comments


def reference_table() -> str:
    """The Markdown table of every key in the defaults."""
    with open(defaults.__file__) as f:
        comments = key_comments(f.read())
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key in sorted(comments, key=lambda k: (k.count(".") == 0, k)):
        value = defaults.get_cfg_defaults()
        for part in key.split("."):
            value = value[part]
        rows.append(f"| `{key}` | `{value!r}` | {comments[key]} |")
    return "\n".join(rows)


def write_reference(path: str) -> None:
    """Replace the table in ``path`` (docs/config-reference.md) with a freshly generated one."""
    with open(path) as f:
        lines = f.read().split("\n")
    start = lines.index("| key | default | meaning |")
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    with open(path, "w") as f:
        f.write("\n".join(lines[:start] + reference_table().split("\n") + lines[end:]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--write", action="store_true", help="regenerate the table in docs/config-reference.md")
    if parser.parse_args(argv).write:
        write_reference(
            os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config-reference.md")
        )
    else:
        print(reference_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`train.py --help`: every config key with its default and the comment beside it in configs/base.py."""

from __future__ import annotations

import os
import re

_LINE = re.compile(r"^config\.(\w+)\s*=\s*(.*?)\s*(?:#\s?(.*))?$")


def describe_keys(base_path: str | None = None) -> str:
    """One line per key (`key = default  comment`), continuation comments indented below it."""
    base_path = base_path or os.path.join(os.path.dirname(os.path.abspath(__file__)), "base.py")
    out: list[str] = []
    with open(base_path) as f:
        for line in f:
            match = _LINE.match(line.rstrip())
            if match:
                key, value, comment = match.groups()
                out.append(f"  --{key} {value}" + (f"    {comment}" if comment else ""))
            elif line.lstrip().startswith("#") and line.startswith(" ") and out:
                out.append(" " * 8 + line.strip().lstrip("#").strip())
            elif line.startswith("# ") and not line.startswith("# fmt:"):  # the formatter's pragmas
                out.append(f"\n{line[2:].strip()}:")
    return "\n".join(out)

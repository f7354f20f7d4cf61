"""Shared by the benchmarks: per-process memory readings and result tables."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def exact_rss_allocator() -> None:
    """Large blocks straight from mmap, so freed memory leaves the RSS and peaks are honest
    (for memory measurements only: it makes every large allocation fault its pages in).
    Call before spawning the measured processes, which inherit it."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")


MB = 1e6


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status("VmRSS")


def reset_peak() -> None:
    """Start a new high-water mark of this process's resident memory (Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    return _status("VmHWM")


def table(rows: list[dict], columns: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    line = lambda vals: "  ".join(str(v).rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join(
        [line(columns), line(["-" * w for w in widths])]
        + [line([r.get(c, "") for c in columns]) for r in rows]
    )

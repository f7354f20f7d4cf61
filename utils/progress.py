"""A dependency-free progress line with rate and ETA for long jobs."""
from __future__ import annotations

import sys
import time


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


class Progress:
    """`update(n)` prints `label  done/total  pct  rate/s  ETA` at most every `interval` s."""

    def __init__(self, total: int, label: str = "", stream=None, interval: float = 1.0):
        self.total, self.label, self.interval = total, label, interval
        self.stream = stream or sys.stderr
        self.done, self.start, self._last = 0, time.time(), 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.time()
        if now - self._last >= self.interval or self.done >= self.total:
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else 0
            pct = 100.0 * self.done / max(self.total, 1)
            end = "\n" if self.done >= self.total else "\r"
            self.stream.write(f"{self.label} {self.done}/{self.total} {pct:5.1f}% "
                              f"{rate:8.1f}/s ETA {format_seconds(eta)}   {end}")
            self.stream.flush()

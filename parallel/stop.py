"""Stop requests (SIGTERM / SIGINT) that every rank honours at the same step."""
from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from parallel.dist import cpu_group, get_world_size


class StopSignal:
    """SIGTERM / SIGINT set a flag; `requested()` agrees on it across ranks (one tiny
    all-reduce over a CPU group), so every rank saves and exits at the same step.

    Create it first thing, before any thread exists: it blocks the signals in the calling
    thread, so every thread started later (gloo's, the data loader's) inherits the block and
    no blocking call in them is interrupted mid-collective; one waiter thread receives them.
    """

    SIGNALS = {signal.SIGTERM, signal.SIGINT}

    def __init__(self):
        self.flag = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        self.previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        self.closed = False
        self.waiter = threading.Thread(target=self._wait, name="stop-signal", daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        while True:
            signal.sigwait(self.SIGNALS)
            if self.closed:
                return
            self.flag = True

    def _handle(self, signum, frame) -> None:  # a thread started before us took the signal
        self.flag = True

    def requested(self) -> bool:
        if get_world_size() == 1:
            return self.flag
        t = torch.tensor([float(self.flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
        return bool(t.item())

    def restore(self) -> None:
        """Give the signals back to their previous handlers (in-process callers, tests)."""
        self.closed = True
        signal.pthread_kill(self.waiter.ident, signal.SIGTERM)  # wakes the waiter, which exits
        self.waiter.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

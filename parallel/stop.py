"""Stop requests (SIGTERM / SIGINT): honoured at a step end on every rank alike inside the
training loop, at once anywhere else."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

from shardface.parallel.dist import cpu_group, get_world_size

logger = logging.getLogger("shardface")

_ACTIVE: StopSignal | None = None


def _after_fork_in_child() -> None:
    if _ACTIVE is not None:
        _ACTIVE._release_in_child()


# A forked child is a DataLoader worker: see StopSignal._release_in_child.
os.register_at_fork(after_in_child=_after_fork_in_child)


def _worker_signal_waiter(parent: int, signals: set[int]) -> None:
    """A loader worker's stop signals: the ones its own rank sends (torch's and Python's exit
    handlers terminate leftover workers) end it at once; the ones sent to the whole process
    group or job (torchrun's `killpg`, SLURM, coreutils `timeout`, Ctrl-C) are left to the
    rank, which finishes its step, saves and then shuts its workers down. A worker whose rank
    died exits through the DataLoader's own watchdog within seconds."""
    while True:
        info = signal.sigwaitinfo(signals)
        if info.si_pid == parent:
            os._exit(128 + info.si_signo)


class StopSignal:
    """SIGTERM / SIGINT handling for a training process.

    Create it first thing, before any thread exists: it blocks the signals in the calling
    thread, so every thread started later (gloo's, the data loader's) inherits the block and
    no blocking call in them is interrupted mid-collective; one waiter thread receives them.
    Forked children (loader workers) ignore a stop signal sent to the whole job and die of
    one their rank sends them (see `_worker_signal_waiter`).

    Inside `with stop.deferred():` (the training loop) a signal sets a flag, and
    `requested()`, called at every step end, agrees on it across ranks (one tiny all-reduce
    over a CPU group), so every rank saves and exits at the same step. If no step end comes
    within `grace_s` (a hung collective, a long evaluation), or the signal arrives outside
    the loop (process-group set-up, loading), the process exits at once with 128 + signal:
    the checkpoints on disk are intact, since every write is atomic. `grace_s` stays under
    torchrun's 30 s between SIGTERM and SIGKILL.
    """

    SIGNALS = {signal.SIGTERM, signal.SIGINT}

    def __init__(self, grace_s: float = 20.0):
        global _ACTIVE
        self.flag = False
        self.grace_s = grace_s
        self.deferring = False
        self.closed = False
        self.acknowledged = threading.Event()
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        self.previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.SIGNALS)
        _ACTIVE = self
        self.waiter = threading.Thread(target=self._wait, name="stop-signal", daemon=True)
        self.waiter.start()

    def _wait(self) -> None:
        while True:
            signum = signal.sigwait(self.SIGNALS)
            if self.closed:
                return
            self.flag = True
            if not self.deferring:
                self._exit_now(signum, "outside the training loop")
            elif not self.acknowledged.wait(self.grace_s) and not self.closed:
                self._exit_now(signum, f"no training step ended within {self.grace_s:.0f} s")

    def _exit_now(self, signum: int, why: str) -> None:
        logger.error(
            "%s received, %s: exiting now; the checkpoints on disk are intact",
            signal.Signals(signum).name,
            why,
        )
        for handler in logger.handlers:
            handler.flush()
        os._exit(128 + signum)

    def _handle(self, signum, frame) -> None:  # a thread started before us took the signal
        self.flag = True

    def _release_in_child(self) -> None:
        """In a forked loader worker: the signals stay blocked (the worker keeps serving the
        batches its rank needs to reach the step end and save), and a thread of its own
        decides by sender (see `_worker_signal_waiter`)."""
        global _ACTIVE
        _ACTIVE = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        threading.Thread(
            target=_worker_signal_waiter,
            args=(os.getppid(), self.SIGNALS),
            name="worker-stop-signal",
            daemon=True,
        ).start()

    @contextlib.contextmanager
    def deferred(self):
        """The training loop: a stop request waits for the next `requested()` (see class doc)."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False

    def requested(self) -> bool:
        """Collective: whether any rank received a stop signal."""
        if get_world_size() == 1:
            stop = self.flag
        else:
            t = torch.tensor([float(self.flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group())
            stop = bool(t.item())
        if stop:
            self.acknowledged.set()
        return stop

    def restore(self) -> None:
        """Give the signals back to their previous handlers (in-process callers, tests)."""
        global _ACTIVE
        self.closed = True
        self.acknowledged.set()  # a waiter in its grace period moves on to sigwait
        signal.pthread_kill(self.waiter.ident, signal.SIGTERM)  # wakes the waiter, which exits
        self.waiter.join(timeout=5)
        signal.pthread_sigmask(signal.SIG_SETMASK, self.previous_mask)
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if _ACTIVE is self:
            _ACTIVE = None

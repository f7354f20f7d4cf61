"""Progress with rate and time left: `progress_bar` (tqdm's) for the tools, `ProgressLogger`'s log line for training."""

from __future__ import annotations

import contextlib
import logging
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardface.parallel.dist import cpu_group, get_world_size

logger = logging.getLogger("shardface")


def format_seconds(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


def progress_bar(total: int, label: str, *, shown: bool = True) -> tqdm:
    """A tool's progress bar on stderr, tqdm's: `update(n)` after each n items done; count, rate and
    time left, redrawn at most once a second; nothing at all where not `shown`. Use it as a context
    manager: closed, it ends its line, so an error's one line comes after it."""
    return tqdm(
        total=total,
        desc=label,
        file=sys.stderr,
        mininterval=1.0,
        unit="",
        dynamic_ncols=True,
        disable=not shown,
    )


class ProgressLogger:
    """Rank 0's progress line every `frequent` steps: loss, lr, global samples/s, ETA.

    Losses are collected as device tensors (`add`) and read by the host only when the loop
    asks (`mean_loss`), so the training loop waits on the device once per `frequent` steps.
    Time spent inside `paused()` (evaluation, checkpoints) counts in neither samples/s nor the
    ETA, so both stay steady across an evaluation."""

    def __init__(
        self,
        total_steps: int,
        frequent: int,
        samples_per_step: int,
        writer=None,
        first_step: int = 0,
        poll_limit_s: float | None = None,
        clock=time.monotonic,
    ):
        self.total, self.frequent, self.samples_per_step = total_steps, frequent, samples_per_step
        self.writer = writer
        # the loop polls for stop requests once per `frequent` steps: warn (once) when that
        # takes longer than a stop request waits for a step end
        self.poll_limit_s = poll_limit_s
        self.pending: list = []
        self.window: list[float] = []
        self.clock = clock
        self.mark_time, self.mark_step = clock(), first_step
        self.paused_s = 0.0  # time inside `paused()` since the mark

    @contextlib.contextmanager
    def paused(self):
        """Leave what runs inside out of samples/s and the ETA."""
        start = self.clock()
        try:
            yield
        finally:
            self.paused_s += self.clock() - start

    def add(self, loss) -> None:
        self.pending.append(loss)

    def due(self, step: int) -> bool:
        return step % self.frequent == 0 or step == self.total

    def mean_loss(self) -> float:
        """The mean of the losses added since the last read (one read from the device); a
        non-finite loss anywhere in the window makes it non-finite."""
        losses = torch.stack(self.pending).float().cpu()
        self.window += losses.tolist()
        self.pending.clear()
        return float(losses.mean())

    def __call__(self, step: int, epoch: int, loss: float, lr: float, scale: float | None) -> None:
        if self.writer is not None:
            for i, value in enumerate(self.window):
                self.writer.add_scalar("train/loss", value, step - len(self.window) + 1 + i)
            self.writer.add_scalar("train/lr", lr, step)
        self.window = []
        now = self.clock()
        training_s = now - self.mark_time - self.paused_s
        rate = (step - self.mark_step) * self.samples_per_step / max(training_s, 1e-9)
        eta = (self.total - step) * self.samples_per_step / max(rate, 1e-9)
        scale_txt = f"  scale {scale:.0f}" if scale is not None else ""
        logger.info(
            "step %d/%d  epoch %d  loss %.4f  lr %.5f  %.1f samples/s  ETA %s%s",
            step,
            self.total,
            epoch,
            loss,
            lr,
            rate,
            format_seconds(eta),
            scale_txt,
        )
        if self.writer is not None:
            self.writer.add_scalar("train/samples_per_second", rate, step)
        window_s = self.frequent * training_s / max(step - self.mark_step, 1)
        if (
            self.poll_limit_s is not None
            and window_s > self.poll_limit_s
            and step - self.mark_step == self.frequent
        ):
            logger.warning(
                "%d steps take %.0f s here, but a stop request (SIGTERM) waits %.0f s for the step end "
                "that polls it: lower --frequent (to %d or less) so a pre-emption still saves",
                self.frequent,
                window_s,
                self.poll_limit_s,
                max(1, int(self.frequent * self.poll_limit_s / window_s / 2)),
            )
            self.poll_limit_s = None
        self.mark_time, self.mark_step, self.paused_s = now, step, 0.0


class SkipReport:
    """Images the data sets of all ranks skipped (`skip_bad_images`): summed over ranks every
    `frequent` steps (one tiny all-reduce, only when skipping is on), logged by rank 0 when
    the count grew, written to tensorboard, and reported at the end."""

    def __init__(self, dataset, frequent: int, writer=None, enabled: bool = True):
        self.counter = dataset.skipped if enabled else None
        self.frequent, self.writer, self.reported = frequent, writer, 0

    def __call__(self, step: int, final: bool = False) -> int:
        if self.counter is None or (step % self.frequent and not final):
            return self.reported
        total = self.counter.total()
        if get_world_size() > 1:
            t = torch.tensor([float(total)])
            dist.all_reduce(t, group=cpu_group())
            total = int(t.item())
        if total > self.reported:
            logger.warning(
                "skipped %d undecodable images so far (all ranks), %d since the last report",
                total,
                total - self.reported,
            )
        if final:
            logger.info("skipped %d undecodable images in this job (all ranks)", total)
        if self.writer is not None:
            self.writer.add_scalar("data/skipped_images", total, step)
        self.reported = total
        return total

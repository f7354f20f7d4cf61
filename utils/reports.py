"""A training run's reports: rank 0's tensorboard events and the wandb run (one writer for both),
the progress line, the skipped-image report and the embedding-norm watch."""

from __future__ import annotations

import os

from shardface.utils.divergence import EmbeddingNormWatch
from shardface.utils.progress import ProgressLogger, SkipReport
from shardface.utils.wandb_logging import finish_wandb, start_wandb, tee_writer


class Reports:
    """Opened once the run is accepted (its output is then its own); `close` ends them on every
    way out of the loop.

    `writer` takes the scalars: tensorboard's on rank 0, tee'd into the wandb run where one is
    logged (rank 0, or every rank with `wandb_log_all`); None on a rank that logs neither.
    Tensorboard's events past `first_step` (a resume's re-done steps) are dropped. `progress`
    prints the progress line every `frequent` steps, `skips` reports the images the loader left
    out, and `norms` (rank 0 only, else None) watches the embeddings' norm.
    """

    def __init__(
        self,
        cfg,
        dataset,
        *,
        rank: int,
        world_size: int,
        first_step: int,
        total_steps: int,
        poll_limit_s: float | None = None,
    ):
        self.cfg, self.is_main = cfg, rank == 0
        events = None
        if self.is_main:
            from torch.utils.tensorboard import SummaryWriter

            events = SummaryWriter(os.path.join(cfg.output, "tensorboard"), purge_step=first_step + 1)
        self.wandb_run = start_wandb(cfg, rank)
        self.writer = writer = tee_writer(events, self.wandb_run)
        world_batch = cfg.batch_size * world_size * cfg.gradient_acc
        self.progress = ProgressLogger(
            total_steps, cfg.frequent, world_batch, writer, first_step=first_step, poll_limit_s=poll_limit_s
        )
        self.skips = SkipReport(dataset, cfg.frequent, writer, enabled=cfg.skip_bad_images)
        self.norms = EmbeddingNormWatch(writer) if self.is_main else None

    def close(self) -> None:
        """Flush tensorboard's events and finish the wandb run, with model.pt as an artifact
        where `save_artifacts` asks and it exists."""
        if self.writer is not None:
            self.writer.close()
        model_path = os.path.join(self.cfg.output, "model.pt")
        finish_wandb(
            self.wandb_run,
            model_path if os.path.isfile(model_path) else None,
            self.cfg.save_artifacts and self.is_main,
        )

"""Verification during training: rank 0 evaluates the configured .bin sets."""
from __future__ import annotations

import logging
import os

from eval.verification import bin_path, load_bin, test

logger = logging.getLogger("shardface")


class VerificationCallback:
    """Evaluates `val_targets` (names of `<name>.bin` in `val_dir`) when called, logs accuracy
    (with flip), std and XNorm, writes tensorboard scalars and tracks the best. Construct and
    call it on rank 0 only (train.py decides when, on every rank, since gathering the EMA
    model is collective); pass the EMA model as well to evaluate both."""

    def __init__(self, val_targets, val_dir: str, summary_writer=None, batch_size: int = 128):
        self.writer, self.batch_size = summary_writer, batch_size
        self.sets = {}
        for name in val_targets:
            path = bin_path(val_dir, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"val_targets names '{name}' but {path} does not exist")
            self.sets[name] = load_bin(path)
        self.best: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def __call__(self, step: int, backbone, ema_backbone=None) -> dict[str, float]:
        models = {"": backbone}
        if ema_backbone is not None:
            models["ema/"] = ema_backbone
        for prefix, model in models.items():
            for name, data in self.sets.items():
                acc, _, acc_flip, std_flip, xnorm, _ = test(data, model, self.batch_size)
                key = f"{prefix}{name}"
                self.last[key] = acc_flip
                self.best[key] = max(self.best.get(key, 0.0), acc_flip)
                logger.info("[%s][%d] XNorm %.3f  Accuracy %.4f  Accuracy-Flip %.4f +- %.4f  Best %.4f",
                            key, step, xnorm, acc, acc_flip, std_flip, self.best[key])
                if self.writer is not None:
                    self.writer.add_scalar(f"val/{key}", acc_flip, step)
                    self.writer.add_scalar(f"val/{key}_xnorm", xnorm, step)
        return dict(self.last)

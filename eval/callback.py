"""Verification during training: every `verbose` steps and at the end, on the `val_targets`."""
from __future__ import annotations

import logging
import os

from eval.verification import NFOLDS, VerificationDataError, bin_path, load_bin, test
from parallel.dist import barrier

logger = logging.getLogger("shardface")


class VerificationCallback:
    """Evaluates `val_targets` (names of `<name>.bin` in `val_dir`) when called: accuracy
    (with flip), std and XNorm to the log and tensorboard, and the best so far; the EMA model
    as well when there is one. Every rank constructs and calls it at the same steps
    (gathering the EMA model is collective); every rank checks that the sets exist, only rank 0
    (`is_main`) loads them and evaluates, the others wait for it."""

    def __init__(self, val_targets, val_dir: str, every: int, backbone, ema=None, summary_writer=None,
                 is_main: bool = True, batch_size: int = 128):
        self.enabled, self.every = bool(val_targets), every
        self.backbone, self.ema, self.writer, self.batch_size = backbone, ema, summary_writer, batch_size
        self.sets = {}
        for name in val_targets:  # every rank checks, so every rank stops alike on a missing set
            path = bin_path(val_dir, name)
            if not os.path.isfile(path):
                raise VerificationDataError(f"val_targets names '{name}' but {path} does not exist: put it there, "
                                            f"pass --val_dir DIR where the .bin files are, or --val_targets '[]' "
                                            f"to train without verification")
            if is_main:
                self.sets[name] = load_bin(path, min_pairs=NFOLDS)
        self.best: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.last_step: int | None = None

    def due(self, step: int) -> bool:
        return self.enabled and self.every > 0 and step % self.every == 0

    def __call__(self, step: int) -> dict[str, float]:
        if not self.enabled or self.last_step == step:
            return dict(self.last)
        self.last_step = step
        models = {"": self.backbone}
        if self.ema is not None:
            models["ema/"] = self.ema.ema_module()  # collective
        for prefix, model in models.items():
            for name, data in self.sets.items():
                result = test(data, model, self.batch_size)
                key = f"{prefix}{name}"
                self.last[key] = result.accuracy_flip
                self.best[key] = max(self.best.get(key, 0.0), result.accuracy_flip)
                logger.info("[%s][%d] XNorm %.3f  Accuracy %.4f  Accuracy-Flip %.4f +- %.4f  Best %.4f",
                            key, step, result.xnorm, result.accuracy, result.accuracy_flip,
                            result.std_flip, self.best[key])
                if self.writer is not None:
                    self.writer.add_scalar(f"val/{key}", result.accuracy_flip, step)
                    self.writer.add_scalar(f"val/{key}_xnorm", result.xnorm, step)
        barrier()
        return dict(self.last)

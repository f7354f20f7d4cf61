"""Verification during training: every `verbose` steps and at the end, on the `val_targets`."""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from shardface.checkpoint.files import atomic_write_text
from shardface.checkpoint.state import exported, weights_fingerprint
from shardface.eval.verification import NFOLDS, VerificationDataError, bin_path, l2_normalize, load_bin, test
from shardface.infer.thresholds import THRESHOLD_FILE, threshold_at_far
from shardface.parallel.dist import barrier

logger = logging.getLogger("shardface")


class VerificationCallback:
    """Evaluates `val_targets` (names of `<name>.bin` in `val_dir`) when called: accuracy
    (with flip), std and XNorm to the log and tensorboard, and the best so far; the EMA model
    as well when there is one. Every rank constructs and calls it at the same steps
    (gathering the EMA model is collective); every rank checks that the sets exist, only rank 0
    (`is_main`) loads them and evaluates, the others wait for it. With `output`, the cosine
    threshold at a stated FAR on the first set (infer.thresholds.threshold_at_far, flip-fused
    embeddings as the tools make them) is saved there as threshold.json, for the raw weights and
    the EMA's, with the step and the weights' fingerprint: the run's own threshold, which the tools
    and export_onnx take for those weights only."""

    def __init__(
        self,
        val_targets,
        val_dir: str,
        every: int,
        backbone,
        ema=None,
        summary_writer=None,
        is_main: bool = True,
        batch_size: int = 128,
        output: str | None = None,
    ):
        self.enabled, self.every, self.output = bool(val_targets), every, output
        self.backbone = backbone
        self.ema = ema
        self.writer = summary_writer
        self.batch_size = batch_size
        self.sets = {}
        for name in val_targets:  # every rank checks, so every rank stops alike on a missing set
            path = bin_path(val_dir, name)
            if not os.path.isfile(path):
                raise VerificationDataError(
                    f"val_targets names '{name}' but {path} does not exist: put it there, "
                    f"pass --val_dir DIR where the .bin files are, or --val_targets '[]' "
                    f"to train without verification"
                )
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
        thresholds = {}
        for prefix, model in models.items():
            for name, data in self.sets.items():
                result = test(data, model, self.batch_size)
                if name == next(iter(self.sets)):  # the first set gives the run's threshold
                    thresholds["ema" if prefix else "raw"] = self._threshold(
                        result, data[1], name, step, model
                    )
                key = f"{prefix}{name}"
                self.last[key] = result.accuracy_flip
                self.best[key] = max(self.best.get(key, 0.0), result.accuracy_flip)
                logger.info(
                    "[%s][%d] XNorm %.3f  Accuracy %.4f  Accuracy-Flip %.4f +- %.4f  Best %.4f",
                    key,
                    step,
                    result.xnorm,
                    result.accuracy,
                    result.accuracy_flip,
                    result.std_flip,
                    self.best[key],
                )
                if self.writer is not None:
                    self.writer.add_scalar(f"val/{key}", result.accuracy_flip, step)
                    self.writer.add_scalar(f"val/{key}_xnorm", result.xnorm, step)
        thresholds = {kind: record for kind, record in thresholds.items() if record}
        if self.output and thresholds:
            atomic_write_text(
                os.path.join(self.output, THRESHOLD_FILE), json.dumps(thresholds, indent=1) + "\n"
            )
        barrier()
        return dict(self.last)

    @staticmethod
    def _threshold(result, issame, name: str, step: int, model) -> dict | None:
        emb = l2_normalize(result.embeddings + result.embeddings_flip).astype(np.float64)
        record = threshold_at_far(np.sum(emb[0::2] * emb[1::2], axis=1), issame)
        if record is None:
            logger.warning(
                "[%s] too few different-person pairs to measure a threshold at FAR 0.1 or below: the run "
                "saves none, and the tools need --threshold or --threshold_from",
                name,
            )
            return None
        logger.info(
            "[%s][%d] threshold %.4f at FAR %g (TAR %.4f), saved as the run's own",
            name,
            step,
            record["threshold"],
            record["far"],
            record["tar"],
        )
        # the weights it was measured on: a reader takes it only for these (infer.thresholds.run_threshold)
        return {
            **record,
            "val_target": name,
            "step": step,
            "fingerprint": weights_fingerprint(exported(model.state_dict())),
        }

"""Stopping a run that has diverged, so no checkpoint after the last good one is written."""
from __future__ import annotations

import math


class TrainingStopped(RuntimeError):
    """The run cannot continue (diverged); the last checkpoint on disk is the last good one."""


def check_loss(loss_value: float, step: int, scaler, max_skipped: int = 20) -> None:
    """Stop on a non-finite loss (fp32/bf16) or a loss scaler that keeps skipping (fp16).
    The loss is the global mean, identical on every rank, so all ranks stop together."""
    if scaler is None:
        if not math.isfinite(loss_value):
            raise TrainingStopped(f"loss is {loss_value} at step {step}: training diverged (or a label "
                                  f"was out of range: see any error above); resume from the last "
                                  f"checkpoint with a lower lr")
    elif scaler.skipped_in_a_row >= max_skipped:
        raise TrainingStopped(f"fp16 loss scaler skipped {scaler.skipped_in_a_row} steps in a row "
                              f"(scale {scaler.scale_value}) at step {step}: gradients stay non-finite")


def check_labels(labels, num_classes: int) -> str | None:
    """Describe the first label of a CPU batch outside [0, num_classes), or None. The head
    stops every rank (an error with CPU labels, a NaN loss on a device); this names the
    batch position on the rank that has it."""
    bad = (labels < 0) | (labels >= num_classes)
    if not bool(bad.any()):
        return None
    at = int(bad.int().argmax())
    return f"label {int(labels[at])} outside [0, {num_classes}) at batch position {at}"

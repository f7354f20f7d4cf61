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
            raise TrainingStopped(f"loss is {loss_value} at step {step}: training diverged; "
                                  f"resume from the last checkpoint with a lower lr")
    elif scaler.skipped_in_a_row >= max_skipped:
        raise TrainingStopped(f"fp16 loss scaler skipped {scaler.skipped_in_a_row} steps in a row "
                              f"(scale {scaler.scale_value}) at step {step}: gradients stay non-finite")

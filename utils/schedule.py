"""Per-iteration learning-rate schedules."""
from __future__ import annotations

import math


def lr_factor(step: int, total_steps: int, warmup_steps: int = 0, kind: str = "poly", power: float = 2.0) -> float:
    """Multiplier of the base LR at `step`: linear warmup, then polynomial or cosine decay to 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "poly":
        return (1.0 - progress) ** power
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler '{kind}' (poly, cosine)")


def set_lr(optimizers, lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr

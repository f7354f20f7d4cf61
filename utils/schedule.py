"""Per-iteration learning-rate schedules, and a run's step counts (`StepPlan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardface.errors import DataError

KINDS = ("poly", "cosine", "poly_warmup")


def lr_factor(
    step: int, total_steps: int, warmup_steps: int = 0, kind: str = "poly", power: float = 2.0
) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based: the steps taken before it).

    `poly_warmup` is arcface_torch's PolynomialLRWarmup as its train_v2 drives it: step 0
    runs at the base LR, steps 1..warmup at step/warmup, then (1 - (step-warmup)/(total-warmup))
    ** power, and 0 past `total_steps`. `poly` and `cosine` warm up linearly to the base LR at
    step warmup-1, then decay to 0 polynomially or as a half cosine."""
    if kind == "poly_warmup":
        # a negative warmup (arcface_torch's 3millions: warmup_epoch -1) never warms up, and its
        # per-step decay factors then multiply out to exactly those of warmup 0
        warmup_steps = max(0, warmup_steps)
        if step == 0:
            return 1.0
        if step <= warmup_steps:
            return step / warmup_steps
        return max(0.0, 1.0 - (step - warmup_steps) / max(1, total_steps - warmup_steps)) ** power
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    if kind == "poly":
        return (1.0 - progress) ** power
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr_scheduler '{kind}' ({', '.join(KINDS)})")


def schedule_steps(
    kind: str, num_images: int, global_batch: int, warmup_epoch: int, num_epoch: int, steps_per_epoch: int
) -> tuple[int, int]:
    """(warmup steps, schedule length in steps). `poly_warmup` counts as arcface_torch does,
    `num_images // global_batch` per epoch; the others count the loader's optimizer steps."""
    if kind == "poly_warmup":
        per_epoch = num_images // global_batch
        return per_epoch * warmup_epoch, per_epoch * num_epoch
    return steps_per_epoch * warmup_epoch, steps_per_epoch * num_epoch


def set_lr(optimizers, lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


@dataclass(frozen=True)
class StepPlan:
    """A run's optimizer-step counts and its learning rate at each step.

    `steps_per_epoch`: whole steps of `gradient_acc` batches each rank's sampler fills per epoch;
    `total_steps`: `num_epoch` epochs of them, capped by `max_steps`; `warmup_steps` and
    `schedule_total`: the lr schedule's warmup and length (see `schedule_steps`), the latter at
    most `total_steps`.
    """

    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    schedule_total: int

    @classmethod
    def of(cls, cfg, num_images: int, batches_per_epoch: int, world_size: int) -> "StepPlan":
        """The plan of `cfg` over `num_images` images that fill `batches_per_epoch` batches on each
        of `world_size` ranks. Raises DataError where an epoch fills not one whole step."""
        steps_per_epoch = batches_per_epoch // cfg.gradient_acc
        if steps_per_epoch == 0:  # else the run would end at once, "done" after 0 steps
            raise DataError(
                f"gradient_acc {cfg.gradient_acc} is more than the {batches_per_epoch} batches of "
                f"{cfg.batch_size} x {world_size} ranks that {cfg.rec} fills per epoch: not one "
                f"optimizer step; use --gradient_acc {batches_per_epoch} or less"
            )
        total_steps = cfg.num_epoch * steps_per_epoch
        if cfg.max_steps:
            total_steps = min(total_steps, cfg.max_steps)
        warmup_steps, schedule_total = schedule_steps(
            cfg.lr_scheduler,
            num_images,
            cfg.batch_size * world_size * cfg.gradient_acc,
            cfg.warmup_epoch,
            cfg.num_epoch,
            steps_per_epoch,
        )
        return cls(steps_per_epoch, total_steps, warmup_steps, min(schedule_total, total_steps))

    def lr(self, cfg, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based)."""
        return cfg.lr * lr_factor(
            step, self.schedule_total, self.warmup_steps, cfg.lr_scheduler, cfg.lr_power
        )

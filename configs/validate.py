"""Every config key checked at start-up, so a bad value fails before training, naming key and value:
each key against its kind (configs/schema.py), then the keys that constrain each other."""

from __future__ import annotations

import importlib.util

from shardface.configs.schema import keys
from shardface.errors import ConfigError


def _fail(key: str, value, why: str) -> ConfigError:
    return ConfigError(f"config {key} = {value!r}: {why}")


def validate_config(cfg: dict) -> None:
    """Raise ConfigError for the first key whose value is of the wrong type or out of range."""
    for key, spec in keys().items():  # each key's type and range (configs/schema.py)
        why = spec.kind.refuses(cfg[key])
        if why:
            raise _fail(key, cfg[key], why)
    if cfg["fp16"] and cfg["bf16"]:
        raise ConfigError("config fp16 = True and bf16 = True: choose one")
    if cfg["overwrite"] and cfg["resume"] in (True, "auto"):
        raise ConfigError(
            f"--resume {str(cfg['resume']).lower()} and --overwrite true: the first continues the run in "
            f"{cfg['output']}, the second deletes it; pass one"
        )
    if cfg["batch_size"] == 1:
        raise _fail(
            "batch_size", 1, "BatchNorm needs more than one sample per rank in training: use 2 or more"
        )
    if cfg["num_classes"] == 0:  # label-free (docs/distillation.md): the teacher's loss is the only one
        if not cfg["teacher"]:
            raise _fail(
                "num_classes",
                0,
                "label-free training needs a teacher (--teacher MODEL or teacher file): "
                "without one there is no loss to train",
            )
        if not cfg["distill_weight"] > 0:
            raise _fail(
                "distill_weight",
                cfg["distill_weight"],
                "with num_classes 0 the distillation loss is the only loss: expected a number > 0",
            )
    if cfg["using_wandb"] and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            "config using_wandb = True but wandb is not installed: pip install wandb "
            "(or set using_wandb False)"
        )


def warmup_problem(total_steps: int, warmup_steps: int) -> str | None:
    """Why this schedule's warmup is a mistake, or None: a run that ends inside its warmup never
    reaches the configured lr (train.py warns; the schedule is left as configured)."""
    if 0 < total_steps < warmup_steps:
        return (
            f"the run ends at step {total_steps}, inside its {warmup_steps}-step warmup: the LR never reaches "
            f"lr; lower warmup_epoch (or raise max_steps / num_epoch)"
        )
    return None

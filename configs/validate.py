"""Every config key checked at start-up, so a bad value fails before training, naming key and value."""

from __future__ import annotations

import importlib.util
import math
import numbers

from shardface.errors import ConfigError

CHOICES = {
    "optimizer": ("sgd", "adamw"),
    "lr_scheduler": ("poly", "cosine", "poly_warmup"),
    "resume": (False, True, "auto"),
    "head_precision": ("fp32", "tf32", "bf16"),
    "distill_loss": ("cosine", "relational"),
    "align_detector": ("hog", "mmod"),
    "margin": ("combined", "arcface", "cosface", "adaface", "magface", "curricularface", "subcenter_arcface"),
}
POSITIVE_INT = (
    "embedding_size",
    "num_epoch",
    "batch_size",
    "gradient_acc",
    "frequent",
    "checkpoint_interval",
    "row_block",
    "subcenter_k",
)
NON_NEGATIVE_INT = (
    "num_classes",
    "num_image",
    "num_workers",
    "verbose",
    "max_steps",
    "stop_after_steps",
    "chunk_size",
    "keep_checkpoints",
    "seed",
)
INT = ("warmup_epoch",)  # arcface_torch's 3millions sets -1 (its PolynomialLRWarmup takes it)
POSITIVE_FLOAT = ("scale", "lr", "ema_tau", "dist_timeout_min", "magface_l_a", "magface_u_a")
NON_NEGATIVE_FLOAT = (
    "weight_decay",
    "max_grad_norm",
    "lr_power",
    "arcface_m",
    "cosface_m",
    "adaface_m",
    "adaface_h",
    "magface_l_m",
    "magface_u_m",
    "magface_lambda_g",
    "curricularface_m",
    "distill_weight",
)
BOOL = (
    "grad_checkpoint",
    "fp16",
    "bf16",
    "channels_last",
    "zero",
    "ema",
    "skip_bad_images",
    "resize",
    "align",
    "align_strict",
    "overwrite",
    "reset_ema",
    "distill_center",
    "reset_margin",
    "head_fused_optimizer",
    "head_graph",
    "clip_head",
    "straight_through",
    "magface_easy_margin",
    "dali",
    "dali_aug",
    "save_all_states",
    "using_wandb",
    "wandb_log_all",
    "save_artifacts",
)
OPTIONAL_STR = (
    "wandb_key",
    "wandb_entity",
    "wandb_project",
    "suffix_run_name",
    "teacher_network",
)  # None or a string
# (low, high, low inclusive, high inclusive); sample_rate 0 keeps only the batch's classes
# (min(B, shard)), arcface_torch's wf42m_pfc0008_32gpu_r100 sets it
INTERVALS = {
    "dropout": (0.0, 1.0, True, False),
    "sample_rate": (0.0, 1.0, True, True),
    "momentum": (0.0, 1.0, True, False),
    "ema_decay": (0.0, 1.0, False, False),
    "interclass_filtering_threshold": (0.0, 1.0, True, False),
    "adaface_t_alpha": (0.0, 1.0, False, True),
}


def _fail(key: str, value, why: str) -> ConfigError:
    return ConfigError(f"config {key} = {value!r}: {why}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A finite number: inf or nan would pass `> 0` (inf) or poison the first step (nan) unnoticed."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def validate_config(cfg: dict) -> None:
    """Raise ConfigError for the first key whose value is of the wrong type or out of range."""
    for key, allowed in CHOICES.items():
        if not any(type(cfg[key]) is type(a) and cfg[key] == a for a in allowed):
            raise _fail(key, cfg[key], f"expected one of {', '.join(map(repr, allowed))}")
    for key in POSITIVE_INT:
        if not _is_int(cfg[key]) or cfg[key] <= 0:
            raise _fail(key, cfg[key], "expected a positive integer")
    for key in NON_NEGATIVE_INT:
        if not _is_int(cfg[key]) or cfg[key] < 0:
            raise _fail(key, cfg[key], "expected an integer >= 0")
    for key in INT:
        if not _is_int(cfg[key]):
            raise _fail(key, cfg[key], "expected an integer")
    for key in POSITIVE_FLOAT:
        if not _is_real(cfg[key]) or not cfg[key] > 0:
            raise _fail(key, cfg[key], "expected a finite number > 0")
    for key in NON_NEGATIVE_FLOAT:
        if not _is_real(cfg[key]) or not cfg[key] >= 0:
            raise _fail(key, cfg[key], "expected a finite number >= 0")
    for key in BOOL:
        if not isinstance(cfg[key], bool):
            raise _fail(key, cfg[key], "expected true or false")
    for key, (lo, hi, lo_in, hi_in) in INTERVALS.items():
        v = cfg[key]
        inside = _is_real(v) and (lo <= v if lo_in else lo < v) and (v <= hi if hi_in else v < hi)
        if not inside:
            raise _fail(
                key, v, f"expected a number in {'[' if lo_in else '('}{lo}, {hi}{']' if hi_in else ')'}"
            )
    margins = cfg["margin_list"]
    if not isinstance(margins, (list, tuple)) or len(margins) != 3 or not all(_is_real(m) for m in margins):
        raise _fail(
            "margin_list", margins, "expected three finite numbers (m1, m2, m3) of s*(cos(m1*theta+m2)-m3)"
        )
    if not margins[0] > 0:
        raise _fail("margin_list", margins, "m1 must be > 0")
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
    for key in ("network", "rec", "output"):
        if not isinstance(cfg[key], str) or not cfg[key]:
            raise _fail(key, cfg[key], "expected a non-empty string")
    if not isinstance(cfg["val_targets"], (list, tuple)) or not all(
        isinstance(t, str) for t in cfg["val_targets"]
    ):
        raise _fail("val_targets", cfg["val_targets"], "expected a list of .bin names")
    if not isinstance(cfg["teacher"], str):
        raise _fail("teacher", cfg["teacher"], "expected a MODEL or teacher file path, or '' for none")
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
    samples = cfg["distill_center_samples"]
    if not _is_int(samples) or samples < 2:  # a mean over one record is that record: cosine 1.000 to it
        raise _fail(
            "distill_center_samples",
            samples,
            "expected an integer >= 2 (the records the teacher's mean "
            "target is measured on; one record is its own mean)",
        )
    for key in OPTIONAL_STR:
        if cfg[key] is not None and not isinstance(cfg[key], str):
            raise _fail(key, cfg[key], "expected a string or None")
    if not isinstance(cfg["wandb_resume"], (bool, str)):
        raise _fail("wandb_resume", cfg["wandb_resume"], "expected true, false or a wandb resume mode")
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

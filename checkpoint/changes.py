"""What a resume changes against its checkpoint, said key by key.

A resume trains with this run's resolved config (configs/schema.py's defaults, the job config, the command
line), never silently with the checkpoint's: every key whose value differs from the one the
checkpoint recorded is named with both values. The schedule follows this run's config: a
changed `num_epoch` or `max_steps` re-spreads the learning rate over the new total (said only
when the total does change), where arcface_torch keeps the total saved with its scheduler; pass
the checkpoint's value to keep it. `num_image` is not used (the data set's images are counted),
and a change of it is named as such. Keys with a rule of their own (checkpoint.load.resume_changes,
the data position, the batch line below) and those that only say where and how long this job
runs are left to those.
"""

from __future__ import annotations

import logging

from shardface.checkpoint.state import plain

logger = logging.getLogger("shardface")

# where and how this job runs, logs and stops (not what it trains), or named by a rule of their own
NOT_COMPARED = frozenset(
    {
        "output",
        "resume",
        "overwrite",
        "stop_after_steps",
        "init_backbone",
        "rec",
        "num_workers",
        "val_targets",
        "val_dir",
        "verbose",
        "frequent",
        "checkpoint_interval",
        "keep_checkpoints",
        "reset_ema",
        "reset_margin",
        "dist_timeout_min",
        "skip_bad_images",
        "dali",
        "dali_aug",
        "save_all_states",
        "using_wandb",
        "wandb_key",
        "wandb_entity",
        "wandb_project",
        "wandb_log_all",
        "wandb_resume",
        "suffix_run_name",
        "save_artifacts",
        "margin",
        "gradient_acc",
        "ema",
        "optimizer",
        "batch_size",
    }
)
SPAN_KEYS = ("num_epoch", "max_steps")  # how many steps the LR schedule spans
SHAPE_KEYS = frozenset({"warmup_epoch", "lr", "lr_scheduler", "lr_power"})  # the LR along those steps
UNUSED = {"num_image": "not used: ShardFace counts the data set's images, so the LR schedule is unchanged"}


def schedule_span(config, steps_per_epoch: int) -> int:
    """The steps a run of `config` (num_epoch, max_steps) trains and its LR schedule spans,
    at `steps_per_epoch` (train.py's total_steps)."""
    total = int(config["num_epoch"]) * steps_per_epoch
    return min(total, int(config["max_steps"])) if config.get("max_steps") else total


def config_changes(saved: dict, config: dict) -> list[tuple[str, object, object]]:
    """(key, checkpoint's value, this run's value) of every compared key whose values differ;
    keys the checkpoint did not record are not compared."""
    return [
        (key, saved[key], config[key])
        for key in sorted(config)
        if key not in NOT_COMPARED and key in saved and plain(saved[key]) != plain(config[key])
    ]


def log_resume_changes(meta: dict, config, world_size: int, steps_per_epoch: int, total_steps: int) -> None:
    """One warning per changed config key, and one for another world size or batch size."""
    saved = meta.get("config") or {}
    # the span the checkpoint's values give on this run's data and batch (a new global batch is said below)
    span_before = schedule_span({key: saved.get(key, config[key]) for key in SPAN_KEYS}, steps_per_epoch)
    for key, before, now in config_changes(saved, config):
        why = ""
        if key in SPAN_KEYS and span_before != total_steps:  # a cap above the total changes nothing
            why = f": the LR schedule now spans {total_steps} steps"
        elif key in SPAN_KEYS:
            why = f": the run and its LR schedule still span {total_steps} steps"
        elif key in SHAPE_KEYS:
            why = ": the LR schedule follows this run's value"
        elif key in UNUSED:
            why = f" ({UNUSED[key]})"
        if key == "num_epoch" and span_before != total_steps:
            why += f" (arcface_torch keeps its saved total: pass --num_epoch {before} to keep it)"
        logger.warning("config %s %r (checkpoint) -> %r (this run)%s", key, before, now, why)
    w0, b0 = int(meta.get("world_size", world_size)), int(meta.get("batch_size") or config.batch_size)
    if (w0, b0) == (world_size, config.batch_size):
        return
    ranks = f"{w0} ranks x {b0} (checkpoint) -> {world_size} x {config.batch_size} (this run)"
    if w0 * b0 == world_size * config.batch_size:
        logger.warning(
            "%s: the same global batch of %d, so steps per epoch (%d) and the LR schedule are unchanged",
            ranks,
            w0 * b0,
            steps_per_epoch,
        )
    else:
        logger.warning(
            "global batch %d (checkpoint) -> %d (this run): %d steps per epoch now, so the LR schedule "
            "is re-spread over %d steps; lr %g is not rescaled (%s)",
            w0 * b0,
            world_size * config.batch_size,
            steps_per_epoch,
            total_steps,
            config.lr,
            ranks,
        )

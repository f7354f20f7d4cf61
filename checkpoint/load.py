"""Reading a checkpoint back: into a run at any world size (resharding the head by class
index), or backbone weights alone (of a checkpoint or a weights file), checked against a network."""

from __future__ import annotations

import json
import logging
import os

import torch

from shardface.checkpoint.files import CheckpointError, load_dict, safe_load
from shardface.checkpoint.folders import HEAD_FILE, resolve_checkpoint
from shardface.checkpoint.state import TrainState, exported, new_run_id, set_rng_state

logger = logging.getLogger("shardface")


def read_backbone_weights(path: str, ema: bool = True) -> tuple[dict, dict]:
    """(backbone state dict, training config or {}) of the checkpoint at `path` (a checkpoint
    directory or a run output: the EMA weights when the checkpoint has them and `ema`), or of a
    weights file (a `model.pt`, a plain (insightface) state dict, an arcface_torch
    `checkpoint_gpu_<rank>.pt`) with the config.json beside it."""
    if not os.path.isdir(path):
        state = safe_load(path)
        for key in ("state_dict", "state_dict_backbone"):  # wrapped; arcface_torch's checkpoint_gpu_<r>.pt
            if isinstance(state, dict) and isinstance(state.get(key), dict):
                state = state[key]
        if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
            raise CheckpointError(f"{path}: not a backbone state dict")
        return {k.removeprefix("module."): v for k, v in state.items()}, _sibling_config(path)
    ckpt = resolve_checkpoint(path)
    config = load_dict(os.path.join(ckpt, "meta.pt")).get("config") or {}
    ema_path = os.path.join(ckpt, "ema.pt")
    if ema and os.path.isfile(ema_path):
        weights = load_dict(ema_path, "state")["state"]
        if not isinstance(weights, dict):
            raise CheckpointError(
                f"{ema_path}: its 'state' is a {type(weights).__name__}, not a state dict "
                f"(damaged, or not written by ShardFace)"
            )
        return exported(weights), config
    return exported(load_dict(os.path.join(ckpt, "backbone.pt"))), config


def _sibling_config(path: str) -> dict:
    """The training config saved beside a weights file, or {} when it is missing or unreadable
    (with a warning naming it: `--network` does without it)."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    if not os.path.isfile(cfg):
        return {}
    try:
        with open(cfg) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning(
            "%s is unreadable (%s: %s), so it is ignored: pass --network to name the backbone",
            cfg,
            type(exc).__name__,
            exc,
        )
        return {}
    return config if isinstance(config, dict) else {}


def refuse_non_finite(state: dict, path: str) -> None:
    """A CheckpointError naming the first tensor of `state` with a NaN or infinite value: such
    weights give NaN embeddings, which compare as nothing and verify as chance."""
    for key, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(
                f"{path}: weight '{key}' has {bad} non-finite (NaN or inf) values of "
                f"{value.numel()}; the model is unusable (was training diverging?)"
            )


def state_mismatch(state: dict, expected: dict) -> str | None:
    """What keeps `state` from loading strictly where `expected` (a model's state dict) is:
    missing and unexpected keys, else the first key of another shape; None when it fits."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        return (
            f"{len(missing)} missing keys (e.g. {missing[:2]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:2]})"
        )
    mismatched = [k for k, v in expected.items() if state[k].shape != v.shape]
    if mismatched:
        k = mismatched[0]
        return f"'{k}' has shape {tuple(state[k].shape)}, expected {tuple(expected[k].shape)}"
    return None


def _load_head(ckpt: str, head, head_opt) -> None:
    start, end = head.class_start, head.class_start + head.num_local
    weight = head.weight.detach()
    new_state: dict = {}
    covered = 0
    for name in sorted(n for n in os.listdir(ckpt) if HEAD_FILE.match(n)):
        path = os.path.join(ckpt, name)
        a, b = (int(v) for v in HEAD_FILE.match(name).groups())
        lo, hi = max(a, start), min(b, end)
        if lo >= hi:
            continue
        part = load_dict(path, "num_classes", "weight", "state")
        if part["num_classes"] != head.num_classes:
            raise CheckpointError(
                f"{path}: head of {part['num_classes']} classes, this run has {head.num_classes}"
            )
        k = part.get("subcenters", 1)
        if k != head.subcenters:
            raise CheckpointError(
                f"{path}: {k} sub-centres per class, this run's margin has {head.subcenters}"
            )
        mine, theirs = slice((lo - start) * k, (hi - start) * k), slice((lo - a) * k, (hi - a) * k)
        with torch.no_grad():
            weight[mine].copy_(part["weight"][theirs])
        for key, v in part["state"].items():
            if torch.is_tensor(v) and v.dim() == 2:
                new_state.setdefault(key, torch.zeros_like(weight, dtype=v.dtype))[mine].copy_(v[theirs])
            else:
                new_state[key] = v
        covered += hi - lo
    if covered != end - start:
        raise CheckpointError(
            f"{ckpt}: head files cover {covered} of the {end - start} classes [{start}, {end})"
        )
    if head_opt is not None and new_state:
        head_opt.state[head.weight] = new_state


def resume_changes(ckpt: str, saved: dict, saved_margin: dict, margin_loss, config) -> bool:
    """The rule for config changes at resume (docs/training.md, Resuming), one line each. Returns whether
    the checkpoint's margin statistics are loaded.
    - another margin type: refused when either margin keeps running statistics (adaface,
      curricularface), unless `reset_margin` (they start afresh); between state-less margins
      it continues with a warning;
    - another `gradient_acc`: continues, warning that the optimizer step now takes another number
      of batches (steps per epoch and the effective batch change; lr is not rescaled);
    - `ema` turned off: continues, warning that the EMA is dropped and ema.pt no longer written.
    `margin_loss` None: a label-free run (no head), whose margin key means nothing."""
    if config is None:
        return True
    before, now = saved.get("margin", config.margin), config.margin
    if before != now and margin_loss is not None:
        stateful = bool(saved_margin) or bool(margin_loss.state_dict())
        if stateful and not config.reset_margin:
            raise CheckpointError(
                f"{ckpt}: trained with margin '{before}', this run uses '{now}', and their running "
                f"statistics cannot carry over: resume with --margin {before}, or pass "
                f"--reset_margin true to start '{now}'s statistics afresh"
            )
        logger.warning(
            "margin '%s' (checkpoint) -> '%s' (this run): the head's weights carry over%s",
            before,
            now,
            "; the margin's running statistics start afresh" if stateful else "",
        )
    acc_before = saved.get("gradient_acc", config.gradient_acc)
    if acc_before != config.gradient_acc:
        logger.warning(
            "gradient_acc %d (checkpoint) -> %d (this run): an optimizer step now takes %d batches per rank, "
            "so steps per epoch and the effective batch change; lr %g is not rescaled",
            acc_before,
            config.gradient_acc,
            config.gradient_acc,
            config.lr,
        )
    if saved.get("ema") and not config.ema:
        logger.warning(
            "ema turned off: the checkpoint's EMA is dropped, ema.pt is no longer written, and model.pt "
            "now holds the trained (not averaged) weights"
        )
    return before == now


def load_checkpoint(
    path: str,
    *,
    backbone,
    backbone_opt,
    head,
    head_opt,
    ema=None,
    scaler=None,
    rank: int = 0,
    world_size: int = 1,
    batch_size: int | None = None,
    config=None,
) -> tuple[TrainState, dict]:
    """Restore everything saved by `save_checkpoint`, resharding to this world size. With
    `config`, its `optimizer` must be the checkpoint's, and a missing ema.pt of a run that
    had EMA on is an error unless `config.reset_ema`."""
    ckpt = resolve_checkpoint(path, ema_optional=bool(config is not None and config.reset_ema), resume=True)
    meta = load_dict(
        os.path.join(ckpt, "meta.pt"), "step", "epoch", "batch_in_epoch", "world_size", "num_classes"
    )
    saved_config = meta.get("config") or {}
    num_classes = head.num_classes if head is not None else 0  # 0: label-free, no head
    if meta["num_classes"] != num_classes:
        raise CheckpointError(
            f"{ckpt}: trained with {meta['num_classes']} classes, this run has {num_classes}"
        )
    if config is not None and saved_config.get("optimizer", config.optimizer) != config.optimizer:
        raise CheckpointError(
            f"{ckpt}: trained with optimizer '{saved_config['optimizer']}', this run uses "
            f"'{config.optimizer}'; its optimizer state cannot carry over: resume with "
            f"--optimizer {saved_config['optimizer']}"
        )
    keep_margin = resume_changes(
        ckpt, saved_config, meta.get("margin") or {}, head.margin_loss if head is not None else None, config
    )
    weights = load_dict(os.path.join(ckpt, "backbone.pt"))  # a corrupt file is reported as such
    try:
        backbone.load_state_dict(weights)
    except RuntimeError:  # torch's text lists every key and shape: the two networks, in one line, say more
        theirs = f"{saved_config.get('network', 'another network')}, embedding_size {saved_config.get('embedding_size', '?')}"
        ours = (
            f"{config.network}, embedding_size {config.embedding_size}"
            if config is not None
            else "this network"
        )
        raise CheckpointError(
            f"{ckpt}/backbone.pt: the checkpoint's backbone is {theirs}; this run builds {ours}: resume with "
            "the checkpoint's --network and --embedding_size, or train into another --output"
        ) from None
    backbone_opt.load_state_dict(safe_load(os.path.join(ckpt, "optimizer.pt")))
    if ema is not None:
        ema_path = os.path.join(ckpt, "ema.pt")
        if os.path.isfile(ema_path):
            saved = load_dict(ema_path, "state", "updates")
            ema.load_state_dict(saved["state"], updates=saved["updates"])
        elif saved_config.get("ema") and not (config is not None and config.reset_ema):
            raise CheckpointError(
                f"{ema_path} is missing, but the checkpoint was trained with ema on: restore "
                f"the file, or pass --reset_ema true to restart the EMA from the loaded weights"
            )
        else:  # EMA switched on at resume (or reset on request): it starts from the loaded weights
            logger.warning("EMA starts from the weights of %s", ckpt)
            ema.load_state_dict(backbone.state_dict(), updates=0)
    if head is not None:
        _load_head(ckpt, head, head_opt)
    if head is not None and meta.get("margin") and keep_margin:
        head.margin_loss.load_state_dict(meta["margin"])
    if scaler is not None and meta.get("scaler"):
        scaler.load_state_dict(meta["scaler"])
    state = TrainState(
        meta["step"], meta["epoch"], meta["batch_in_epoch"], meta.get("run_id") or new_run_id()
    )
    if meta["world_size"] == world_size and not meta.get("imported_from"):
        set_rng_state(safe_load(os.path.join(ckpt, f"rng-rank{rank}.pt")))
    if batch_size and (meta["world_size"], meta["batch_size"]) != (world_size, batch_size):
        # the samples already seen this epoch, in this run's batches (rounded down)
        seen = meta["batch_in_epoch"] * meta["batch_size"] * meta["world_size"]
        state.batch_in_epoch = seen // (batch_size * world_size)
    return state, meta

#!/usr/bin/env python
"""Turn an arcface_torch run into a ShardFace checkpoint, to continue it with train.py.

    python -m scripts.import_arcface_torch CONFIG RUN_DIR OUT_DIR [--key value ...]
    python train.py CONFIG [--key value ...] --output OUT_DIR --resume true   # any number of ranks

CONFIG is the run's arcface_torch config (with the `--key value` overrides it ran with); give
train.py the same overrides (the import prints the command with them).
RUN_DIR holds the run's `checkpoint_gpu_<rank>.pt`, one per rank (arcface_torch writes them
at every epoch end with `save_all_states True`), each with `epoch`, `global_step`,
`state_dict_backbone`, `state_dict_softmax_fc` (the rank's PartialFC_V2 shard),
`state_optimizer` (one SGD or AdamW over [backbone parameters, head shard]) and
`state_lr_scheduler`. OUT_DIR receives a checkpoint at the run's `global_step`: the backbone,
the head rows in class order, the optimizer state of both, and the schedule position.
"""

from __future__ import annotations

import os
import shlex
import sys

import torch

from shardface.builders import build_backbone, build_head, build_head_optimizer
from shardface.checkpoint.files import CheckpointError, safe_load
from shardface.checkpoint.folders import list_checkpoints
from shardface.checkpoint.foreign import ARCFACE_RANK_FILE as RANK_FILE
from shardface.checkpoint.foreign import arcface_torch_rank_files, config_overrides
from shardface.checkpoint.load import state_mismatch
from shardface.checkpoint.save import save_checkpoint
from shardface.checkpoint.state import TrainState, new_run_id
from shardface.configs import ConfigError, get_config
from shardface.heads.sharding import class_shard
from shardface.parallel.user_errors import exits_on_user_error
from shardface.utils.outputs import check_output_dir

KEYS = (
    "epoch",
    "global_step",
    "state_dict_backbone",
    "state_dict_softmax_fc",
    "state_optimizer",
    "state_lr_scheduler",
)
STATE_OF = {"sgd": "momentum_buffer", "adamw": "exp_avg"}  # a key each optimizer's state has


class _SavedOptimizerState:
    """Stands for the backbone optimizer in `save_checkpoint`: its state is already per name."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self, to_rank: int | None = None) -> dict:
        return self._state


def rank_files(run_dir: str) -> list[str]:
    """`checkpoint_gpu_<r>.pt` for r = 0 .. W-1, every one present."""
    names = os.listdir(run_dir) if os.path.isdir(run_dir) else []
    ranks = {int(m.group(1)): os.path.join(run_dir, n) for n in names if (m := RANK_FILE.match(n))}
    if not ranks:
        raise CheckpointError(
            f"{run_dir}: no checkpoint_gpu_<rank>.pt files (arcface_torch writes them with "
            f"save_all_states True)"
        )
    missing = [r for r in range(max(ranks) + 1) if r not in ranks]
    if missing:
        raise CheckpointError(
            f"{os.path.join(run_dir, f'checkpoint_gpu_{missing[0]}.pt')}: missing (the run has "
            f"ranks up to {max(ranks)}; copy every rank's file)"
        )
    return [ranks[r] for r in range(len(ranks))]


def _load_rank(path: str) -> dict:
    ckpt = safe_load(path)
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"{path}: not an arcface_torch checkpoint (a {type(ckpt).__name__})")
    for key in KEYS:
        if key not in ckpt:
            raise CheckpointError(f"{path}: key '{key}' missing: not an arcface_torch checkpoint_gpu file")
    return ckpt


def _optimizer_layout(path: str, opt: dict, num_backbone_params: int) -> tuple[list, object]:
    """(ids of the backbone parameters in order, id of the head shard) in a torch optimizer
    state dict over [backbone parameters, head shard], as train_v2 builds it."""
    groups = opt.get("param_groups") if isinstance(opt, dict) else None
    if not isinstance(groups, list) or "state" not in opt:
        raise CheckpointError(
            f"{path}: state_optimizer is not a torch optimizer state dict (no 'state', 'param_groups')"
        )
    if len(groups) != 2 or len(groups[1]["params"]) != 1:
        raise CheckpointError(
            f"{path}: state_optimizer has {len(groups)} param_groups; train_v2's has two, "
            f"[backbone parameters] and [head shard]"
        )
    if len(groups[0]["params"]) != num_backbone_params:
        raise CheckpointError(
            f"{path}: state_optimizer.param_groups[0] has {len(groups[0]['params'])} backbone "
            f"parameters, the config's network has {num_backbone_params}"
        )
    return groups[0]["params"], groups[1]["params"][0]


def _check_optimizer_kind(path: str, states: list[dict], optimizer: str) -> None:
    for s in states:
        if s and STATE_OF[optimizer] not in s:
            raise CheckpointError(
                f"{path}: state_optimizer holds {sorted(s)}, not the state of config optimizer "
                f"'{optimizer}': pass the run's config (or --optimizer)"
            )


def import_run(cfg, run_dir: str, out_dir: str) -> str:
    """Write the ShardFace checkpoint of the arcface_torch run in `run_dir` into `out_dir`;
    returns its directory."""
    if cfg.gradient_acc != 1:
        raise ConfigError(
            f"config gradient_acc = {cfg.gradient_acc}: only runs with gradient_acc 1 import "
            f"(arcface_torch counts its steps in micro-batches)"
        )
    check_output_dir(out_dir)
    if list_checkpoints(out_dir):
        raise CheckpointError(f"{out_dir} holds checkpoints already: import into a new directory")
    if arcface_torch_rank_files(out_dir):  # the run itself, or another one: never written into
        raise CheckpointError(
            f"{out_dir} is an arcface_torch run (checkpoint_gpu_<rank>.pt): import into a new directory"
        )
    if os.path.lexists(
        os.path.join(out_dir, "model.pt")
    ):  # a finished run's weights (train.py refuses it too)
        raise CheckpointError(f"{out_dir} holds model.pt of an earlier run: import into a new directory")
    files = rank_files(run_dir)
    world_size, num_classes, dim = len(files), cfg.num_classes, cfg.embedding_size
    backbone, head = build_backbone(cfg), build_head(cfg)
    names = [n for n, _ in backbone.named_parameters()]
    params = dict(backbone.named_parameters())

    first = _load_rank(files[0])
    weights = {k.removeprefix("module."): v for k, v in first["state_dict_backbone"].items()}
    problem = state_mismatch(weights, backbone.state_dict())
    if problem:
        raise CheckpointError(
            f"{files[0]}: state_dict_backbone does not fit network '{cfg.network}': {problem}"
        )
    backbone.load_state_dict(weights)
    ids, _ = _optimizer_layout(files[0], first["state_optimizer"], len(names))
    opt_state = {name: first["state_optimizer"]["state"].get(i, {}) for name, i in zip(names, ids)}
    _check_optimizer_kind(files[0], list(opt_state.values()), cfg.optimizer)
    for name, s in opt_state.items():
        for key, v in s.items():
            if torch.is_tensor(v) and v.dim() and v.shape != params[name].shape:
                raise CheckpointError(
                    f"{files[0]}: state_optimizer state of '{name}' ({key}) has shape "
                    f"{tuple(v.shape)}, the parameter {tuple(params[name].shape)}"
                )
    group = {
        k: v
        for k, v in first["state_optimizer"]["param_groups"][0].items()
        if k not in ("params", "initial_lr")
    }
    sched = first["state_lr_scheduler"]
    if sched.get("last_epoch") != first["global_step"]:
        raise CheckpointError(
            f"{files[0]}: state_lr_scheduler.last_epoch is {sched.get('last_epoch')}, global_step "
            f"{first['global_step']}: not a PolynomialLRWarmup stepped once per step"
        )
    base_lr = (sched.get("base_lrs") or [cfg.lr])[0]
    if abs(base_lr - cfg.lr) > 1e-12 * max(1.0, abs(cfg.lr)):
        raise CheckpointError(
            f"{files[0]}: state_lr_scheduler.base_lrs is {base_lr}, config lr {cfg.lr}: pass the "
            f"run's config (or --lr {base_lr})"
        )

    rows, head_states = [], []
    for rank, path in enumerate(files):
        ckpt = first if rank == 0 else _load_rank(path)
        for key in ("epoch", "global_step"):
            if ckpt[key] != first[key]:
                raise CheckpointError(
                    f"{path}: {key} is {ckpt[key]}, rank 0's is {first[key]}: the files are "
                    f"from different saves"
                )
        shard = class_shard(num_classes, world_size, rank)
        weight = ckpt["state_dict_softmax_fc"].get("weight")
        if weight is None:
            raise CheckpointError(f"{path}: key 'state_dict_softmax_fc.weight' missing")
        if tuple(weight.shape) != (shard.size, dim):
            raise CheckpointError(
                f"{path}: state_dict_softmax_fc.weight has shape {tuple(weight.shape)}, rank "
                f"{rank} of {world_size} with num_classes {num_classes} and embedding_size {dim} "
                f"holds ({shard.size}, {dim}): is CONFIG the run's, and every rank's file here?"
            )
        _, head_id = _optimizer_layout(path, ckpt["state_optimizer"], len(names))
        rows.append(weight)
        head_states.append(ckpt["state_optimizer"]["state"].get(head_id, {}))
    _check_optimizer_kind(files[0], head_states, cfg.optimizer)
    head_state = {}
    for key, v in head_states[0].items():  # per-row tensors in class order; scalars (AdamW step) as they are
        head_state[key] = (
            torch.cat([s[key] for s in head_states]) if torch.is_tensor(v) and v.dim() == 2 else v
        )
    with torch.no_grad():
        head.weight.copy_(torch.cat(rows))
    head_opt = build_head_optimizer(cfg, head)
    if head_state:
        head_opt.state[head.weight] = head_state

    os.makedirs(out_dir, exist_ok=True)
    cfg.output = out_dir
    state = TrainState(
        step=int(first["global_step"]), epoch=int(first["epoch"]), batch_in_epoch=0, run_id=new_run_id()
    )
    backbone_opt = _SavedOptimizerState({"state": opt_state, "param_groups": [group], "master": {}})
    return save_checkpoint(
        out_dir,
        state,
        backbone=backbone,
        backbone_opt=backbone_opt,
        head=head,
        head_opt=head_opt,
        config=cfg,
        rank=0,
        world_size=world_size,
        keep=0,
        export_to=os.path.join(out_dir, "model.pt"),
        extra_meta={"imported_from": os.path.abspath(run_dir)},
    )


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 3 or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    config = argv[0]
    run_dir = argv[1]
    out_dir = argv[2]
    overrides = argv[3:]
    cfg = get_config(config, overrides)
    ckpt = import_run(cfg, run_dir, out_dir)  # a checkpoint or config error: one line, exit 2
    if cfg.lr_scheduler != "poly_warmup":
        print(
            f"note: config lr_scheduler is '{cfg.lr_scheduler}', not arcface_torch's poly_warmup: the run "
            f"continues on another learning rate"
        )
    # the import's overrides belong to the run: a resume without them would train another one
    command = [
        "python",
        "train.py",
        config,
        *config_overrides(overrides),
        "--output",
        out_dir,
        "--resume",
        "true",
    ]
    print(f"wrote {ckpt}; continue with: {' '.join(shlex.quote(a) for a in command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

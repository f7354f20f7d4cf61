"""Writing a checkpoint: every rank's part, published atomically, older ones pruned."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import asdict

import torch

from shardface.checkpoint.files import (
    CheckpointError,
    NoSpaceError,
    atomic_save,
    atomic_write_text,
    free_bytes,
)
from shardface.checkpoint.folders import list_checkpoints, prune_checkpoints
from shardface.checkpoint.state import TrainState, cpu_tensors, exported, plain, rng_state
from shardface.parallel.dist import from_every_rank, get_rank
from shardface.utils.atomic import publish, recover


def _head_payload(head, head_opt) -> dict:
    state = head_opt.state.get(head.weight, {}) if head_opt is not None else {}
    return {
        "class_start": head.class_start,
        "num_local": head.num_local,
        "num_classes": head.num_classes,
        "subcenters": head.subcenters,
        "weight": head.weight.detach().cpu(),
        "state": {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in state.items()},
    }


def save_checkpoint(
    output: str,
    state: TrainState,
    *,
    backbone,
    backbone_opt,
    head,
    head_opt,
    ema=None,
    scaler=None,
    config=None,
    rank: int = 0,
    world_size: int = 1,
    keep: int = 2,
    export_to: str | None = None,
    extra_meta: dict | None = None,
) -> str:
    """Collective: every rank calls it. Returns the checkpoint directory. The sharded states
    (optimizer, EMA) are gathered to rank 0 alone, which writes them; with `export_to`, rank 0
    also writes the weights for export there (the EMA's when EMA is on), from the same gather.
    `extra_meta` joins meta.pt (`imported_from`: a checkpoint without RNG states to restore)."""
    final = os.path.join(output, f"checkpoint-{state.step:08d}")
    # one staging folder that every rank names alike; the run lock keeps any other run out of
    # `output`, so one left by a killed run is litter, removed here
    tmp = os.path.join(output, f".{os.path.basename(final)}.partial")
    problem = None
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        problem = _attempt(lambda: os.makedirs(tmp), output, 0, os.path.basename(final))
    _agree(problem, tmp)
    opt_state = backbone_opt.state_dict(to_rank=0)  # collectives: every rank takes part
    ema_state = ema.state_dict(to_rank=0) if ema is not None else None
    head_payload = _head_payload(head, head_opt) if head is not None else None
    # a label-free run (no head): 0 classes, no margin statistics (else identical on every rank)
    num_classes = head.num_classes if head is not None else 0
    margin = {k: v.cpu() for k, v in head.margin_loss.state_dict().items()} if head is not None else {}
    weights = cpu_tensors(backbone.state_dict()) if rank == 0 else None

    def write_parts():
        if head is not None:
            atomic_save(
                head_payload,
                os.path.join(
                    tmp, f"head-{head.class_start:010d}-{head.class_start + head.num_local:010d}.pt"
                ),
            )
        atomic_save(rng_state(), os.path.join(tmp, f"rng-rank{rank}.pt"))
        if rank == 0:
            atomic_save(weights, os.path.join(tmp, "backbone.pt"))
            atomic_save(opt_state, os.path.join(tmp, "optimizer.pt"))
            if ema_state is not None:
                atomic_save({"state": ema_state, "updates": ema.updates}, os.path.join(tmp, "ema.pt"))
            meta = {
                **asdict(state),
                "world_size": world_size,
                "num_classes": num_classes,
                "batch_size": int(config.batch_size) if config else 0,
                "scaler": scaler.state_dict() if scaler is not None else None,
                "margin": margin,
                "config": plain(dict(config)) if config else {},
                **(extra_meta or {}),
            }
            atomic_save(meta, os.path.join(tmp, "meta.pt"))

    # what a checkpoint takes on disk: the previous one's size, else this rank's share times W
    needed = (
        _previous_size(output)
        or _tensor_bytes([weights, opt_state, ema_state]) + _tensor_bytes(head_payload) * world_size
    )
    _agree(_attempt(write_parts, output, needed, os.path.basename(final)), tmp)

    def publish_all():
        recover([final])  # a swap of this step that a killed run left
        publish([tmp], [final])  # utils.atomic's folder swap, as every tool's
        atomic_write_text(os.path.join(output, "latest"), os.path.basename(final) + "\n")
        prune_checkpoints(output, state.step, state.run_id, keep)
        if export_to:
            atomic_save(exported(ema_state if ema_state is not None else weights), export_to)

    _agree(_attempt(publish_all, output, needed, os.path.basename(final)) if rank == 0 else None, tmp)
    return final


def _attempt(write, output: str, needed: int, name: str) -> tuple[str, str] | None:
    """None when `write()` succeeds, else the message to raise on every rank; for want of space it
    names the output (not the staging folder, which is removed), the checkpoint and the file that
    did not fit, what a checkpoint needs and what was free when this rank failed."""
    try:
        write()
        return None
    except CheckpointError as exc:
        message, no_space, failed = str(exc), isinstance(exc, NoSpaceError), getattr(exc, "filename", None)
    except OSError as exc:
        message, no_space, failed = (
            f"{exc.filename or 'checkpoint'}: cannot write ({exc.strerror or exc})",
            exc.errno == errno.ENOSPC,
            exc.filename,
        )
    if no_space:
        need = f"a checkpoint needs about {needed / 2**20:.0f} MiB; " if needed else ""
        file = f"{os.path.basename(failed)} did not fit: " if failed else ""
        message = (
            f"{output}: no space for {name} ({file}No space left on device; {need}"
            f"{free_bytes(output) / 2**20:.0f} MiB free); the partial save was removed and the earlier "
            "checkpoints are intact: free space there or point --output elsewhere"
        )
    return ("no space", message) if no_space else ("error", message)


def _agree(problem: tuple[str, str] | None, tmp: str) -> None:
    """Collective: every rank learns whether any rank's write failed (no rank waits forever at
    a barrier for one that gave up); then all raise the first failing rank's error alike, and
    the partial save is removed."""
    problems = [p for p in from_every_rank(problem) if p is not None]
    if not problems:
        return
    if get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    kind, message = problems[0]
    raise NoSpaceError(message) if kind == "no space" else CheckpointError(message)


def _tensor_bytes(obj) -> int:
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _previous_size(output: str) -> int:
    found = list_checkpoints(output)
    if not found:
        return 0
    newest = found[-1][1]
    return sum(
        os.path.getsize(os.path.join(newest, f))
        for f in os.listdir(newest)
        if os.path.isfile(os.path.join(newest, f))
    )

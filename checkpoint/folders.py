"""The checkpoints in a run's output: listed, checked for completeness, found, pruned."""

from __future__ import annotations

import logging
import os
import re
import shutil

import torch

from shardface.checkpoint.files import CheckpointError

logger = logging.getLogger("shardface")
CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")
HEAD_FILE = re.compile(r"^head-(\d+)-(\d+)\.pt$")


def list_checkpoints(output: str) -> list[tuple[int, str]]:
    """(step, directory) of every `checkpoint-<step>` under `output`, oldest first."""
    if not os.path.isdir(output):
        return []
    found = [
        (int(m.group(1)), os.path.join(output, name))
        for name in os.listdir(output)
        if (m := CHECKPOINT_NAME.match(name))
    ]
    return sorted(found)


def _meta_or_none(ckpt: str) -> dict | None:
    try:
        meta = torch.load(os.path.join(ckpt, "meta.pt"), map_location="cpu", weights_only=True)
    except Exception:  # missing, truncated or foreign: not an intact checkpoint
        return None
    return meta if isinstance(meta, dict) else None


def missing_files(ckpt: str, ema_optional: bool = False) -> list[str]:
    """What checkpoint directory `ckpt` lacks to be complete (empty when intact): meta.pt
    readable, backbone.pt, optimizer.pt, head files covering every class of meta's
    num_classes, an rng file per rank of the saved world size (not for an imported run), and
    ema.pt when EMA was on (unless `ema_optional`: a resume that restarts the EMA)."""
    if not os.path.isdir(ckpt):
        return [ckpt]
    meta = _meta_or_none(ckpt)
    if meta is None:
        return ["meta.pt"]
    names = set(os.listdir(ckpt))
    missing = [f for f in ("backbone.pt", "optimizer.pt") if f not in names]
    if (meta.get("config") or {}).get("ema") and "ema.pt" not in names and not ema_optional:
        missing.append("ema.pt")
    if not meta.get("imported_from"):  # an imported run has no RNG states to restore
        missing += [
            f"rng-rank{r}.pt" for r in range(int(meta.get("world_size", 1))) if f"rng-rank{r}.pt" not in names
        ]
    spans = sorted((int(m.group(1)), int(m.group(2))) for m in map(HEAD_FILE.match, names) if m)
    covered = 0  # the head files must tile [0, num_classes) without a gap
    for a, b in spans:
        if a > covered:
            break
        covered = max(covered, b)
    num_classes = int(meta.get("num_classes", 0))
    if covered < num_classes:
        missing.append(f"head files for classes [{covered}, {num_classes})")
    return missing


def _intact(ckpt: str, ema_optional: bool = False) -> bool:
    return not missing_files(ckpt, ema_optional)


def prune_checkpoints(output: str, newest_step: int, run_id: str, keep: int) -> list[str]:
    """Delete checkpoints of run `run_id` older than `newest_step` so that `keep` remain,
    counting the newest (0 keeps all). Checkpoints of other runs, unreadable ones and newer
    ones are never touched. Returns the deleted directories."""
    if keep <= 0 or not run_id:
        return []
    older = [
        path
        for step, path in list_checkpoints(output)
        if step < newest_step and (_meta_or_none(path) or {}).get("run_id") == run_id
    ]
    doomed = older[: max(0, len(older) - (keep - 1))]
    for path in doomed:
        shutil.rmtree(
            path,
            onerror=lambda _, where, exc: logger.warning(
                "could not delete %s while pruning old checkpoints (%s): it takes disk space; delete it by hand",
                where,
                exc[1],
            ),
        )
    return doomed


def find_checkpoint(path: str, ema_optional: bool = False) -> str | None:
    """The checkpoint directory `path` is, or the one a run output's `latest` names; when
    `latest` is missing, dangling or garbage, the newest intact checkpoint (with a warning).
    None when there is none."""
    if os.path.isfile(os.path.join(path, "meta.pt")):
        return path
    latest = os.path.join(path, "latest")
    named = None
    if os.path.isfile(latest):
        with open(latest, "rb") as f:
            named = f.read(256).decode("utf-8", "replace").strip()
        if CHECKPOINT_NAME.match(named) and _intact(os.path.join(path, named), ema_optional):
            return os.path.join(path, named)
    for _, ckpt in reversed(list_checkpoints(path)):
        if _intact(ckpt, ema_optional):
            if named is not None:
                lacks = (
                    missing_files(os.path.join(path, named), ema_optional)
                    if CHECKPOINT_NAME.match(named)
                    else []
                )
                logger.warning(
                    "%s names %r, which is not an intact checkpoint%s; using the newest intact one, %s",
                    latest,
                    named[:64],
                    f" (it lacks {', '.join(lacks)})" if lacks else "",
                    ckpt,
                )
            return ckpt
    return None


def resolve_checkpoint(path: str, ema_optional: bool = False, *, resume: bool = False) -> str:
    """Like `find_checkpoint`, but an error when there is no checkpoint; its hint is for
    train.py where `resume`, else for the tools."""
    ckpt = find_checkpoint(path, ema_optional)
    if ckpt is None:
        found = list_checkpoints(path)
        lacks = missing_files(found[-1][1], ema_optional) if found else []
        newest = f" (the newest, {found[-1][1]}, lacks {', '.join(lacks)})" if lacks else ""
        if "ema.pt" in lacks:
            newest += "; --reset_ema true resumes without it, restarting the EMA from the loaded weights"
        exported_model = os.path.join(path, "model.pt")
        if os.path.isfile(exported_model):  # a run whose checkpoints were deleted to save space
            newest += (
                f"; its exported model.pt is there: start a new run from its weights with --init_backbone {exported_model}"
                if resume
                else f"; its exported model.pt is there: pass {exported_model} for its weights"
            )
        raise CheckpointError(
            f"{path}: not a checkpoint (no meta.pt), and no intact checkpoint-* directory in it{newest}"
        )
    return ckpt

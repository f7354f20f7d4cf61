"""A checkpoint's files: written atomically, read with `weights_only`, and their errors."""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil

import torch

from shardface.errors import ModelError
from shardface.utils.atomic import publishing


class CheckpointError(ModelError):
    """A checkpoint that is missing, unreadable or does not fit this run (the message names it)."""


class NoSpaceError(CheckpointError):
    """A write failed for want of disk space."""


def _write_atomically(path: str, mode: str, write) -> None:
    try:
        with (
            publishing(path) as tmp,
            open(tmp, mode) as f,
        ):  # a partial file is removed: it would keep the disk full
            write(f)
    except (OSError, RuntimeError) as exc:
        # torch.save reports a failed write as RuntimeError("[enforce fail at inline_container.cc ...")
        if isinstance(exc, RuntimeError) and "inline_container" not in str(exc):
            raise
        cause = (
            exc
            if isinstance(exc, OSError)
            else exc.__context__
            if isinstance(exc.__context__, OSError)
            else None
        )
        code = cause.errno if cause is not None else None
        folder = os.path.dirname(os.path.abspath(path))
        if code is None and free_bytes(folder) < 1 << 20:  # torch's own writer fails without an errno
            code = errno.ENOSPC
        reason = os.strerror(code) if code else str(exc).splitlines()[0]
        if code == errno.ENOSPC:
            full = NoSpaceError(
                f"{path}: cannot write ({reason}); free space on {folder} or point output elsewhere"
            )
            full.filename = path
            raise full from exc
        raise CheckpointError(f"{path}: cannot write ({reason})") from exc


def free_bytes(folder: str) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 1 << 62


def atomic_save(obj, path: str) -> None:
    _write_atomically(path, "wb", lambda f: torch.save(obj, f))


def atomic_write_text(path: str, text: str) -> None:
    _write_atomically(path, "w", lambda f: f.write(text))


def safe_load(path: str):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: checkpoint file missing")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        pickled = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
        if pickled is None:
            raise CheckpointError(
                f"{path}: corrupt or unreadable checkpoint file (UnpicklingError)"
            ) from None
        raise CheckpointError(
            f"{path}: a pickled Python object ({pickled[1]}), not weights; nothing in it was run. Save "
            "the weights instead: torch.save(model.state_dict(), PATH)"
        ) from None
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"{path}: corrupt or unreadable checkpoint file ({type(exc).__name__}: {exc})"
        ) from None


def load_dict(path: str, *keys: str) -> dict:
    """The dict a checkpoint file holds, with every one of `keys`: one CheckpointError naming the
    file (and the missing key) when it holds something else."""
    obj = safe_load(path)
    if not isinstance(obj, dict):
        raise CheckpointError(
            f"{path}: holds a {type(obj).__name__}, not the dict a checkpoint file holds "
            f"(damaged, or not written by ShardFace)"
        )
    missing = [key for key in keys if key not in obj]
    if missing:
        raise CheckpointError(
            f"{path}: no {', '.join(repr(k) for k in missing)} entry in it (damaged, or not "
            f"written by ShardFace)"
        )
    return obj

"""Checks of a tool's outputs before any work, so that nothing fails only when the result is
written: the kind and folder of each output, `--overwrite`, the staging name's length
(utils.atomic writes every output under it first), and an output that is also an input."""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Iterable

from shardface.errors import OutputError
from shardface.utils.atomic import host_name, staging_path


def name_max(folder: str) -> int:
    """The longest file name (bytes) the file system of `folder` takes (255 where it cannot say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_name_length(path: str, what: str = "output") -> None:
    """Before any work: the staging name of `path` (its longest name while it is written) fits the
    file system's limit, so the publish cannot fail with 'File name too long' after the work."""
    name = len(os.fsencode(os.path.basename(os.path.abspath(path))))
    staged = len(os.fsencode(os.path.basename(staging_path(path))))
    folder = os.path.dirname(os.path.abspath(path))
    limit = name_max(folder if os.path.isdir(folder) else os.sep)
    if staged > limit:
        raise OutputError(
            f"{what} {path}: a name of {name} bytes is written first as .NAME.partial-{host_name()}-"
            f"{os.getpid()}, {staged} bytes, past the file system's limit of {limit}: choose a name of "
            f"at most {limit - (staged - name)} bytes"
        )


def _check_creates(path: str, folder: str, what: str) -> None:
    """A file can be created in `folder`: its staging file is created and removed (os.access says
    yes to root in folders that take no file, such as /dev/fd and /proc)."""
    probe = staging_path(path)
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # this process's staging file: the folder takes files
        return
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot create a file in {folder} ({exc.strerror})") from None
    os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.remove(probe)


def check_output_file(path: str, overwrite: bool | None = None, what: str = "output") -> None:
    """Before any work: `path` can be published as a file. Its directory must exist and take a
    new file (`_check_creates`); its staging name must fit (`check_name_length`); a directory
    or anything but a regular file in its place is refused; an existing file is refused unless
    `overwrite` (None: replacing is the tool's normal behaviour)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise OutputError(f"{what} {path}: the directory {folder} does not exist; create it first")
    check_name_length(path, what)
    if os.path.lexists(path):
        mode = os.stat(path).st_mode if os.path.exists(path) else 0
        if stat.S_ISDIR(mode):
            raise OutputError(f"{what} {path} is a directory; name a file")
        if not stat.S_ISREG(mode):
            raise OutputError(f"{what} {path} exists and is not a regular file; name another file")
        if overwrite is False:
            raise OutputError(f"{what} {path} exists; pass --overwrite to replace it")
    if not os.access(folder, os.W_OK):
        raise OutputError(f"{what} {path}: cannot write in {folder}")
    _check_creates(path, folder, what)


def check_output_dir(path: str, what: str = "output") -> None:
    """Before any work: `path` is a directory, or nothing yet (it will be created), and its
    staging name (publishing_dir's, at a symbolic link's target) fits the file system's limit."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise OutputError(f"{what} {path} is a file, not a directory; name a directory")
    check_name_length(os.path.realpath(path) if os.path.islink(path) else path.rstrip(os.sep) or path, what)


def refuse_inputs(outputs: Iterable[str], inputs: Iterable[str]) -> None:
    """An output that is one of the inputs (the same file, by any path or link) is refused:
    writing it would destroy what the run reads. Each path is looked at once (stat)."""
    existing = {}
    for out in outputs:
        with contextlib.suppress(OSError):
            st = os.stat(out)
            existing[(st.st_dev, st.st_ino)] = out
    if not existing:
        return
    for src in inputs:
        try:
            st = os.stat(src)
        except OSError:
            continue
        out = existing.get((st.st_dev, st.st_ino))
        if out is not None:
            raise OutputError(f"output {out} is also an input ({src}); write it elsewhere")

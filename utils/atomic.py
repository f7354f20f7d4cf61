"""Publishing outputs atomically: one helper for a file, one for a folder, one for a set of files.

Everything is written under a staging name beside its final one, `.<name>.partial-<host>-<pid>`,
flushed to disk, and renamed onto the final name, so a run that fails or is killed before the
rename leaves the earlier output as it was. A file is replaced in one `os.replace`.

A folder, and a set of files that belong together (train.rec, train.idx, property; emb.npy,
emb.txt), take more than one rename, so their swap is journaled. The earlier output is kept as
a backup, `.<name>.old-<host>-<pid>` (a folder is moved aside; a file of a set is hard-linked),
and the key (the folder itself; the file of a set that a reader opens first, the last path) is
gone until the new output is whole. Nothing can read a half-swapped output as a good one. A
swap that raises puts the earlier output back at once; one that was killed (no key, backups of
a dead process) is put back by the next publish or by a reader (`recover`). The name holds the
earlier output or the new one, never a mix and never neither.

Litter of killed runs on this host (staging names, backups of a finished swap) is removed by the
next publish of the same name, once its process is gone. A folder output that is a symbolic link
is published at the link's target: the link stays.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
from typing import Iterator

_LITTER = re.compile(r"^\.?(?P<name>.+)\.(?P<kind>partial|old)-(?:(?P<host>.+)-)?(?P<pid>\d+)$")


def host_name() -> str:
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def staging_path(path: str) -> str:
    """Where `path` is written before it is published: a hidden name in the same directory
    (the same file system, so the rename is atomic), unique to this host and process."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.partial-{host_name()}-{os.getpid()}")


def _backup_path(path: str) -> str:
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.old-{host_name()}-{os.getpid()}")


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (signal 0 probes it without touching it): the one
    test of a dead writer, for staging files, journals and run locks."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _dead_litter(path: str, kind: str) -> list[tuple[int, str]]:
    """(pid, entry) of `path`'s staging names (`kind` "partial") or backups ("old") left on this
    host by processes now gone; a live run's, and another host's (its pids mean nothing here),
    are left out. Names without a host are an older align's."""
    folder, name = os.path.split(os.path.abspath(path))
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir(folder):
            m = _LITTER.match(entry)
            if not m or (m["name"], m["kind"]) != (name, kind) or m["host"] not in (None, host_name()):
                continue
            pid = int(m["pid"])
            if pid != os.getpid() and not process_alive(pid):
                found.append((pid, os.path.join(folder, entry)))
    return found


def remove_stale(path: str) -> list[str]:
    """Remove the staging files of `path` that killed runs on this host left. Returns them."""
    removed = sorted(entry for _, entry in _dead_litter(path, "partial"))
    for entry in removed:
        _remove(entry)
    return removed


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(paths: list[str]) -> None:
    """fsync each file of `paths` (a folder's own files are its writer's to flush), then each
    folder holding one."""
    for path in paths:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
        fsync_dir(folder)


@contextlib.contextmanager
def _named_when_full(temps: list[str], paths: list[str], inside: bool = False) -> Iterator[None]:
    """A write that finds no space: its OSError names the output it was for, not the staging
    name, which is removed (`inside`: the write was to a file within a staging folder). The
    tools say it in one line (parallel.user_errors)."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            name = os.path.abspath(exc.filename) if isinstance(exc.filename, str) else None
            hit = [p for t, p in zip(temps, paths) if name and (inside or name == os.path.abspath(t))]
            exc.filename = (hit or paths)[0]
        raise


def recover(paths: list[str]) -> bool:
    """Finish the journal a killed swap of `paths` (key last) left: where the key is missing, the
    earlier output is put back from the dead process's backups (True); where the key is there,
    the output is whole and the backups are removed."""
    by_pid: dict[int, dict[str, str]] = {}
    for path in paths:
        for pid, backup in _dead_litter(path, "old"):
            by_pid.setdefault(pid, {})[path] = backup
    restored = False
    for _, backups in sorted(by_pid.items()):
        if not os.path.lexists(paths[-1]) and not restored:
            _restore(paths, backups)
            restored = True
        for backup in backups.values():
            _remove(backup)
    if restored:
        _fsync(paths)
    return restored


def _restore(paths: list[str], backups: dict[str, str]) -> None:
    """Put the earlier output back, its key last; a file of the set that had no backup (new with
    this set) is removed."""
    *others, key = paths
    _remove(key)
    for path in others:
        if path in backups:
            os.replace(backups[path], path)
        else:
            _remove(path)
    if key in backups:
        os.replace(backups[key], key)


def publish(temps: list[str], paths: list[str]) -> None:
    """Swap the written `temps` in for `paths` (key last), journaled as the module says: a folder
    is moved aside to its backup, a file hard-linked to its (on a file system without hard links
    a file has no backup, but the key still goes first and comes back last). The caller has run
    `recover(paths)` first."""
    _fsync(temps)
    backups = {}
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            os.rename(path, _backup_path(path))
        elif os.path.lexists(path):
            try:
                os.link(path, _backup_path(path))
            except OSError:
                continue
        else:
            continue
        backups[path] = _backup_path(path)
    _fsync(paths)
    try:
        _remove(paths[-1])
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    except BaseException:
        _restore(paths, backups)  # still running: the earlier output goes back at once
        raise
    finally:
        for backup in backups.values():
            _remove(backup)
    _fsync(paths)


@contextlib.contextmanager
def publishing_set(paths: list[str]) -> Iterator[list[str]]:
    """`with publishing_set([a, b, key]) as (ta, tb, tkey):` write the staging files; when the
    block ends normally they are published together (`publish`); when it raises, nothing is."""
    recover(paths)
    for path in paths:
        remove_stale(path)
    temps = [staging_path(p) for p in paths]
    try:
        with _named_when_full(temps, paths):
            yield temps
        publish(temps, paths)
    finally:
        for tmp in temps:
            _remove(tmp)


@contextlib.contextmanager
def publishing(path: str) -> Iterator[str]:
    """`with publishing(out) as tmp:` write the file `tmp`; when the block ends normally it is
    flushed and renamed onto `out`; when it raises, `tmp` is removed and `out` is untouched."""
    remove_stale(path)
    tmp = staging_path(path)
    try:
        with _named_when_full([tmp], [path]):
            yield tmp
            _fsync([tmp])
            os.replace(tmp, path)
    finally:
        _remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def publishing_dir(path: str) -> Iterator[str]:
    """`with publishing_dir(out) as tmp:` fill the folder `tmp` (created); when the block ends
    normally it takes the place of `out` (`publish`); when it raises, `tmp` is removed and `out`
    is untouched. Where `out` is a symbolic link to a folder, the folder it names is replaced."""
    path = os.path.realpath(path) if os.path.islink(path) else path
    recover([path])
    remove_stale(path)
    tmp = staging_path(path)
    os.makedirs(tmp)
    try:
        with _named_when_full([tmp], [path], inside=True):
            yield tmp
        publish([tmp], [path])
    finally:
        _remove(tmp)

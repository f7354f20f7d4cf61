"""Publishing outputs atomically: the one way every tool (and checkpoints) writes a file.

A file is written under a staging name beside its final one, `.<name>.partial-<host>-<pid>`,
flushed to disk, and renamed onto the final name (`os.replace`), so the final name holds the
earlier file or the complete new one, never a part. A set of files that belong together
(train.rec, train.idx, property; emb.npy, emb.txt) has a key, the file a reader needs
first (the index, the file list): the key is removed before the others are replaced and
published after them, so while the set is being swapped it has no key, and nothing can read
a mixed set as a good one. A run killed before the swap leaves the earlier set whole. Before
the swap the earlier set is hard-linked to backups, `.<name>.old-<host>-<pid>` (the journal):
a swap that raises puts them back at once, and one killed mid-swap (no key) is put back by
the next publish of the set or by a reader (`recover_set`), so the folder holds the earlier
set or the new one, never neither.

Staging files of runs that were killed are removed by the next publish of the same name on
the same host, once their process is gone. An output that is also an input is refused, and
every output is checked (its kind, its directory, `--overwrite`, that its staging name fits the
file system's limit on a name, and, for a file, that its folder takes a new file: a staging file
is created and removed, since `os.access` says yes to root anywhere, /dev/fd included) before
the work starts. A folder output that is a symbolic link to a folder is published at the link's
target: the link stays, and the folder it names is replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import socket
import stat
from typing import Iterable, Iterator

from shardface.errors import OutputError

_STAGED = re.compile(r"^\.?(?P<name>.+)\.partial-(?:(?P<host>.+)-)?(?P<pid>\d+)$")
_BACKUP = re.compile(r"^\.?(?P<name>.+)\.old-(?:(?P<host>.+)-)?(?P<pid>\d+)$")  # no host: older align


def host_name() -> str:
    return socket.gethostname().replace(os.sep, "_") or "localhost"


def staging_path(path: str) -> str:
    """Where `path` is written before it is published: a hidden name in the same directory
    (the same file system, so the rename is atomic), unique to this host and process."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.partial-{host_name()}-{os.getpid()}")


def backup_path(path: str, pid: int | None = None) -> str:
    """The journal's copy (a hard link) of the earlier `path` while a set is being swapped."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.old-{host_name()}-{os.getpid() if pid is None else pid}")


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (signal 0 probes it without touching it): the one
    test of a dead writer, for staging files, journals, run locks and the gallery's part folders."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def remove_stale(path: str) -> list[str]:
    """Remove staging files of `path` left by killed runs on this host (their process is gone);
    a live run's, and another host's (its pids mean nothing here), are left alone. Returns
    what was removed."""
    folder, name = os.path.split(os.path.abspath(path))
    removed = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        m = _STAGED.match(entry)
        if not m or m.group("name") != name or m.group("host") not in (None, host_name()):
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or process_alive(pid):
            continue
        _remove_tree_or_file(os.path.join(folder, entry))
        removed.append(os.path.join(folder, entry))
    return removed


def _remove_tree_or_file(path: str) -> None:
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


def _fsync_dirs(paths: list[str]) -> None:
    """fsync each folder holding one of `paths`, once."""
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
        fsync_dir(folder)


def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


@contextlib.contextmanager
def publishing(path: str) -> Iterator[str]:
    """`with publishing(out) as tmp:` write `tmp`; when the block ends normally `tmp` is
    flushed and renamed onto `out`; when it raises, `tmp` is removed and `out` is untouched."""
    remove_stale(path)
    tmp = staging_path(path)
    try:
        with _named_when_full({tmp: path}):
            yield tmp
            _fsync_file(tmp)
            os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


@contextlib.contextmanager
def _named_when_full(outputs: dict[str, str], inside: bool = False) -> Iterator[None]:
    """A write that finds no space: its OSError names the output it was for (`outputs`: staging
    name -> output; `inside`: files within a staging folder), not the staging file, which is
    removed. The tools say it in one line (parallel.user_errors)."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            name = os.path.abspath(exc.filename) if isinstance(exc.filename, str) else None
            staged = next((t for t in outputs if name and (name == os.path.abspath(t) or inside)), None)
            exc.filename = outputs[staged] if staged is not None else next(iter(outputs.values()))
        raise


def _dead_backups(paths: list[str]) -> dict[int, dict[str, str]]:
    """{pid: {path: its backup}} for backups of `paths` left on this host by processes now gone."""
    found: dict[int, dict[str, str]] = {}
    names = {os.path.split(os.path.abspath(p)): p for p in paths}
    for folder in dict.fromkeys(os.path.dirname(os.path.abspath(p)) for p in paths):
        try:
            entries = os.listdir(folder)
        except OSError:
            continue
        for entry in entries:
            m = _BACKUP.match(entry)
            path = names.get((folder, m.group("name"))) if m else None
            if path is None or m.group("host") not in (None, host_name()):
                continue
            pid = int(m.group("pid"))
            if pid != os.getpid() and not process_alive(pid):
                found.setdefault(pid, {})[path] = os.path.join(folder, entry)
    return found


def _restore(paths: list[str], backups: dict[str, str]) -> None:
    """Put the earlier set back: each backed-up file onto its name (the key last); a file of
    the set that had no backup (new with this set) is removed."""
    *others, key = paths
    with contextlib.suppress(FileNotFoundError):
        os.remove(key)
    for path in others:
        if path in backups:
            os.replace(backups[path], path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
    if key in backups:
        os.replace(backups[key], key)


def recover_set(paths: list[str]) -> bool:
    """Finish the journal of a swap of the set `paths` (key last) that a killed run left: where
    the key is missing the swap was cut short, and the earlier set is put back (True); where
    the key is the earlier one or a new one, the set is whole and the backups are removed."""
    restored = False
    for _, backups in sorted(_dead_backups(paths).items()):
        key = paths[-1]
        if not os.path.lexists(key) and not restored:
            _restore(paths, backups)
            restored = True
        for backup in backups.values():
            with contextlib.suppress(FileNotFoundError):
                os.remove(backup)
    if restored:
        _fsync_dirs(paths)
    return restored


@contextlib.contextmanager
def publishing_set(paths: list[str]) -> Iterator[list[str]]:
    """`with publishing_set([a, b, key]) as (ta, tb, tkey):` write the staging files; when the
    block ends normally the set is published with its key (the last path) removed first and
    published last, the earlier set journaled until the new one is whole (see the module
    docstring); when it raises, nothing is published."""
    recover_set(paths)
    for path in paths:
        remove_stale(path)
    temps = [staging_path(p) for p in paths]
    try:
        with _named_when_full(dict(zip(temps, paths))):
            yield temps
            for tmp in temps:
                _fsync_file(tmp)
        backups = {}
        for path in paths:
            if os.path.lexists(path):
                try:
                    os.link(path, backup_path(path))
                except OSError:  # a file system without hard links: no journal (the key still goes last)
                    continue
                backups[path] = backup_path(path)
        _fsync_dirs(paths)
        *others, key = paths
        try:
            with contextlib.suppress(FileNotFoundError):
                os.remove(key)
            for tmp, path in zip(temps, others):
                os.replace(tmp, path)
            os.replace(temps[-1], key)
        except BaseException:
            _restore(paths, backups)  # still running: the earlier set goes back at once
            raise
        finally:
            for backup in backups.values():
                with contextlib.suppress(FileNotFoundError):
                    os.remove(backup)
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
    _fsync_dirs(paths)


_RENAME_EXCHANGE = 2  # linux/fs.h


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where the
    system or file system has no such call."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_cwd = -100
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), _RENAME_EXCHANGE) == 0


def recover_dir(path: str) -> bool:
    """Where a publish of the folder `path` was killed between moving the earlier folder aside
    and moving the new one in (no atomic exchange there), put the earlier one back (True);
    backups of a finished publish are removed."""
    restored = False
    for backups in _dead_backups([path]).values():
        backup = backups[path]
        if not os.path.lexists(path) and not restored:
            os.replace(backup, path)
            restored = True
        else:
            _remove_tree_or_file(backup)
    return restored


@contextlib.contextmanager
def publishing_dir(path: str) -> Iterator[str]:
    """`with publishing_dir(out) as tmp:` fill the folder `tmp` (created); when the block ends
    normally it takes the place of `out`, an earlier `out` exchanged for it in one atomic step
    where the system allows (else moved aside to a journaled backup first) and then removed;
    when it raises, `tmp` is removed and `out` is untouched. Where `out` is a symbolic link to a
    folder, the folder it names is the one replaced (staged beside it), and the link stays: the
    link is the user's way of putting the output elsewhere, not the output."""
    if os.path.islink(path):
        path = os.path.realpath(path)
    recover_dir(path)
    remove_stale(path)
    tmp = staging_path(path)
    os.makedirs(tmp)
    try:
        with _named_when_full({tmp: path}, inside=True):
            yield tmp
        if not os.path.lexists(path):
            os.rename(tmp, path)
        elif _exchange(tmp, path):  # tmp now holds the earlier folder
            shutil.rmtree(tmp)
        else:
            backup = backup_path(path)
            os.rename(path, backup)
            os.rename(tmp, path)
            shutil.rmtree(backup)
    finally:
        if os.path.lexists(tmp):
            _remove_tree_or_file(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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

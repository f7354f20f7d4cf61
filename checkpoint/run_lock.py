"""One live run per output directory: a lock file in the output, held by rank 0.

`<output>/run.lock` holds the holder's host, pid, start time, user and scheduler job id (one
JSON line). While the run lives, a daemon thread of rank 0 refreshes the file's mtime every
`REFRESH_S` seconds (a thread, so a long evaluation or collective does not stop it). A lock
counts as stale, and a new run takes it over with a warning saying which rule, when
  - its holder ran on this host and its pid is no longer alive (or is this very process,
    which does not hold it: a lock left by an earlier in-process run); a live pid on this host
    keeps its lock however long it is stopped (Ctrl-Z, a SLURM suspend), or
  - its holder ran on another host and it was not refreshed for `STALE_S` seconds (a holder
    that died without releasing it). The window is many refresh intervals wide, so a loaded
    file server's late mtime updates or a few seconds of clock skew between hosts never make
    a live run's lock look stale.
Anything else is a live run: the new one is refused at once with a CheckpointError naming it,
before it writes or deletes anything in the output. The lock is released on every exit path
that runs Python's `finally` (normal end, an error, the stop signal's save-and-exit); a
process that ends by `os._exit` or SIGKILL leaves it behind, and the next start on the same
host finds its pid dead. A refused run also removes the output directory it created, if empty.

The lock file also proves that every rank writes the same directory: each rank reads rank 0's
lock in its own `output` (waiting up to `SHARED_WAIT_S` for a network file system to show it),
and a job where some rank does not find it there is refused at start, naming ranks and hosts,
instead of at its first checkpoint. The proof is the directory itself, so two ranks given two
directories on one machine fail the same way as two nodes without a shared file system.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import getpass
import json
import logging
import os
import socket
import threading
import time

from shardface.checkpoint.files import CheckpointError
from shardface.parallel.dist import from_every_rank, from_rank0, get_world_size
from shardface.utils.atomic import process_alive

logger = logging.getLogger("shardface")

LOCK_NAME = "run.lock"
REFRESH_S = 60.0
SHARED_WAIT_S = 30.0  # NFS may show a new file to other clients only once their cached directory expires
STALE_S = 10 * REFRESH_S
_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "TORCHELASTIC_RUN_ID")


def _describe(holder: dict) -> str:
    job = f", job {holder['job']}" if holder.get("job") else ""
    return (
        f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, user {holder.get('user', '?')}{job}, "
        f"started {holder.get('start', '?')}"
    )


def _read(path: str) -> tuple[dict, float] | None:
    """(holder, seconds since the last refresh) of the lock at `path`, or None if it is gone."""
    try:
        with open(path) as f:
            text = f.read(4096)
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return None
    try:
        holder = json.loads(text)
    except ValueError:  # a holder killed between create and write: empty or torn
        holder = {}
    return (holder if isinstance(holder, dict) else {}), age


class RunLock:
    """The output's run lock, held by rank 0 of a run (see the module docstring). Create it
    before the run starts; `acquire` is collective (every rank calls it; all raise alike);
    `release` is safe to call on every rank, any number of times, held or not."""

    # the locks this process holds (a lock naming our own pid but absent here is stale)
    _held_here: set[str] = set()

    def __init__(self) -> None:
        self.path: str | None = None
        self.created = False
        self.me: dict = {}
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def acquire(self, output: str, rank: int = 0) -> None:
        """Create `output` if needed and take its lock, or raise CheckpointError on every rank:
        another live run holds it, the output cannot be written, or some rank does not see the
        lock in its own `output` (not one shared directory)."""
        problem = self._try(output) if rank == 0 else ""
        problem = from_rank0(problem)
        if problem:
            raise CheckpointError(problem)
        self._check_shared(output, rank)

    def _check_shared(self, output: str, rank: int) -> None:
        """Collective: raise on every rank unless each rank finds rank 0's lock in its `output`."""
        if get_world_size() == 1:
            return
        holder = from_rank0(self.me)
        seen = rank == 0 or _sees(os.path.join(output, LOCK_NAME), holder, SHARED_WAIT_S)
        views = from_every_rank((seen, socket.gethostname(), os.path.abspath(output)))
        blind = [
            f"rank {r} (host {host}) in {where}" for r, (saw, host, where) in enumerate(views) if not saw
        ]
        if blind:
            _, host0, where0 = views[0]
            raise CheckpointError(
                f"the output is not one directory shared by every rank: rank 0 (host {host0}) holds its lock "
                f"{os.path.join(where0, LOCK_NAME)}, but {'; '.join(blind[:4])}{' and more' if len(blind) > 4 else ''} "
                f"did not find it within {SHARED_WAIT_S:.0f} s: checkpoints need an output every node mounts "
                f"(a shared file system), given to every rank"
            )

    def _try(self, output: str) -> str:
        path = os.path.join(output, LOCK_NAME)
        self.created = not os.path.lexists(output)  # removed again if the run is refused and leaves it empty
        try:
            os.makedirs(output, exist_ok=True)
        except OSError as exc:
            return f"{output}: cannot create the output directory ({exc.strerror or exc}): choose another --output"
        if not os.path.isdir(output):
            return f"{output}: not a directory (a file is in its place): remove it or choose another --output"
        self.me = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "user": _user(),
            "job": next((os.environ[v] for v in _JOB_VARIABLES if os.environ.get(v)), ""),
            "start": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        for _ in range(3):  # a stale lock removed, then created anew; a racing start may win
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                found = _read(path)
                if found is None:
                    continue
                holder, age = found
                why = self._stale(path, holder, age)
                if why is None:
                    return (
                        f"{output} is in use by a live run ({_describe(holder)}; lock refreshed {age:.0f} s ago): "
                        f"one run per output; wait for it, stop it, or choose another --output (if it is really "
                        f"gone, delete {path}; it counts as stale {STALE_S:.0f} s after its last refresh)"
                    )
                logger.warning("%s: taking over the stale lock of %s (%s)", output, _describe(holder), why)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
                continue
            except OSError as exc:
                return _unwritable(output, exc)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(json.dumps(self.me) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.remove(path)
                return _unwritable(output, exc)
            self.path = path
            RunLock._held_here.add(os.path.abspath(path))
            self._refresher = threading.Thread(target=self._refresh, name="run-lock", daemon=True)
            self._refresher.start()
            return ""
        return f"{output}: could not take {path} (another run is starting there at the same moment)"

    def _stale(self, path: str, holder: dict, age: float) -> str | None:
        """Why the lock of `holder`, refreshed `age` s ago, is stale; None when its run lives."""
        pid = holder.get("pid")
        if not holder and age > 5:  # its creator died between creating and writing it
            return "an empty or torn lock file"
        if holder.get("host") == self.me["host"] and isinstance(pid, int):
            if pid == os.getpid() and os.path.abspath(path) not in RunLock._held_here:
                return "left by an earlier run of this process"
            if not process_alive(pid):
                return f"pid {pid} is not running on this host"
            return None  # alive here: its run's, however long it has not refreshed (Ctrl-Z, a SLURM suspend)
        if age > STALE_S:
            return f"not refreshed for {age:.0f} s (stale after {STALE_S:.0f} s)"
        return None

    def _refresh(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                os.utime(self.path)
            except OSError as exc:  # deleted by hand, or the file system is gone: say so once
                logger.warning(
                    "cannot refresh the run lock %s (%s): another run may take this output over",
                    self.path,
                    exc,
                )
                return

    def release(self) -> None:
        """Remove the lock if this process holds it (and it is still ours)."""
        if self.path is None:
            return
        self._stop.set()
        if self._refresher is not None:
            self._refresher.join(timeout=5)
        found = _read(self.path)
        if (
            found is not None
            and found[0].get("pid") == self.me["pid"]
            and found[0].get("host") == self.me["host"]
        ):
            with contextlib.suppress(OSError):
                os.remove(self.path)
        if (
            self.created
        ):  # a refused run leaves no empty output behind (rmdir fails on one that holds anything)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.path))
        RunLock._held_here.discard(os.path.abspath(self.path))
        self.path = None


def _sees(path: str, holder: dict, wait_s: float) -> bool:
    """Whether the lock at `path` shows `holder` within `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        found = _read(path)
        if found is not None and found[0] == holder:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry for this uid (containers)
        return str(os.getuid())


def _unwritable(output: str, exc: OSError) -> str:
    hint = (
        "free space there or choose another --output"
        if exc.errno == errno.ENOSPC
        else "make it writable or choose another --output"
    )
    return f"{output}: cannot write into the output directory ({exc.strerror or exc}): {hint}"

"""User errors on the console: one line, `error: <message>`, printed once per job, exit code 2.

A `errors.UserError` (ConfigError, DataError, CheckpointError) is bad input the user
can fix, and its traceback says nothing the message does not; `SHARDFACE_DEBUG=1` shows it
anyway. Under torchrun most such errors are found by every rank alike (the same config, the
same missing file), a few by one rank only (a record one rank read). Rank 0 prints at once
and leaves a mark in torchrun's rendezvous store; any other rank waits up to `PEER_WAIT_S`
for a mark and prints only when none comes (its error was its own), marking it in turn.
Rank 0 prints before any rank exits, so torchrun, which stops the job at the first exit,
cannot cut its message off; a rank whose collective then loses its peer sees the mark and
exits quietly instead of adding a traceback.
"""

from __future__ import annotations

import datetime
import errno
import functools
import os
import re
import shutil
import sys
from typing import Callable, TypeVar

from shardface.errors import UserError

EXIT_USER_ERROR = 2
DEBUG_ENV = "SHARDFACE_DEBUG"
PEER_WAIT_S = 10.0
_WORKER_PREFIX = re.compile(r"^[\w.]+: ")

F = TypeVar("F", bound=Callable)


def one_line(exc: BaseException) -> str:
    """The message on one line; for an error a DataLoader worker raised (torch wraps it with
    the worker's traceback), the original message."""
    text = str(exc)
    if "Original Traceback" in text:
        text = _WORKER_PREFIX.sub("", text.strip().splitlines()[-1])
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def _mark_key(env) -> str:
    return f"shardface/user_error/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _store(env, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(
        env["MASTER_ADDR"],
        int(env["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def _reported(env, wait_s: float) -> bool:
    """Whether some rank marks within `wait_s` that it printed a user error. A store that cannot
    be reached or goes away counts as a mark: it was rank 0's (or torchrun's, which ends when the
    job does), so rank 0 has exited, and it prints before it exits."""
    try:
        store = _store(env, max(wait_s, 1.0))
    except Exception:
        return True
    try:
        store.wait([_mark_key(env)], datetime.timedelta(seconds=wait_s))
        return True
    except Exception as exc:
        return "timeout" not in str(exc).lower()


def _peer_reported(env) -> bool:
    """Whether another rank of this job already printed a user error (then this rank's own
    failure, a collective whose peer left, is only its echo)."""
    if int(env.get("WORLD_SIZE", "1")) < 2 or "MASTER_ADDR" not in env:
        return False
    try:
        return _store(env, 2.0).check([_mark_key(env)])
    except Exception:
        return False


def report_user_error(exc: BaseException, env=None, stream=None, wait_s: float = PEER_WAIT_S) -> bool:
    """Print `error: <message>` on `stream` (stderr) unless rank 0 of this job reports one;
    returns whether this process printed."""
    env = os.environ if env is None else env
    stream = sys.stderr if stream is None else stream
    rank, world_size = int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1"))
    if world_size > 1 and rank != 0 and _reported(env, wait_s):
        return False
    print(f"error: {one_line(exc)}", file=stream, flush=True)
    if world_size > 1 and "MASTER_ADDR" in env:
        try:
            _store(env, 5.0).set(_mark_key(env), str(rank))
        except Exception:  # no store: the other ranks find none either and stay silent
            pass
    return True


def _end_open_bars() -> None:
    """End the line of each progress bar (tqdm's) still open, as closing it does, so that what is
    printed next starts a line of its own; a bar whose construction the Ctrl-C cut short, after
    it drew its first line, gets the line's end written for it."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return
    for bar in list(std.tqdm._instances):
        if getattr(bar, "disable", True) or getattr(bar, "sp", None) is None:
            continue  # a bar not shown, or not drawn yet
        ended = hasattr(bar, "last_print_t")  # then close() redraws it and ends its line
        try:
            bar.close()
        except Exception:
            ended = False
        if not ended:
            bar.fp.write("\n")
            bar.fp.flush()


def _interrupt_in_one_line(shown: Callable) -> Callable:
    """A `sys.excepthook` that shows a Ctrl-C which reached the top of the program as one line, as
    training does (the tools publish their outputs whole or not at all: nothing to point at), and
    everything else as `shown` does; SHARDFACE_DEBUG=1 shows the traceback."""

    def hook(kind, exc, tb):
        if issubclass(kind, KeyboardInterrupt) and os.environ.get(DEBUG_ENV, "") in ("", "0"):
            _end_open_bars()
            print(
                "SIGINT received: stopped; outputs are published whole or not at all",
                file=sys.stderr,
                flush=True,
            )
        else:
            shown(kind, exc, tb)

    hook.interrupt_in_one_line = True
    return hook


def _no_space(exc: OSError) -> str:
    """A full disk under an output, in one line: the output (utils.atomic names it), the space
    left, and that what was there before is unchanged (outputs are published whole or not at all)."""
    path = exc.filename if isinstance(exc.filename, str) else "an output"
    try:
        free = (
            f"{shutil.disk_usage(os.path.dirname(os.path.abspath(path)) or '.').free / 2**20:.0f} MiB free; "
        )
    except OSError:
        free = ""
    return f"{path}: no space left on its device to write it ({free}nothing was published: what was there before is unchanged)"


def exits_on_user_error(main: F) -> F:
    """Wrap a command-line entry point: a UserError is printed as one line (see the module
    docstring) and the entry point returns 2; with SHARDFACE_DEBUG=1 it propagates. A Ctrl-C
    goes on to the caller (in-process callers see it; the program then dies of SIGINT as Python
    does) but is shown as one line, not a traceback. Under torchrun, a rank that fails in any
    other way after a peer printed a user error (its collective lost the peer) exits with 2 as
    well, silently."""

    @functools.wraps(main)
    def entry(*args, **kwargs):
        debug = os.environ.get(DEBUG_ENV, "") not in ("", "0")
        if not getattr(sys.excepthook, "interrupt_in_one_line", False):
            sys.excepthook = _interrupt_in_one_line(sys.excepthook)
        try:
            return main(*args, **kwargs)
        except UserError as exc:
            if debug:
                raise
            report_user_error(exc)
            return EXIT_USER_ERROR
        except OSError as exc:
            if debug or exc.errno != errno.ENOSPC:
                if not debug and _peer_reported(os.environ):
                    return EXIT_USER_ERROR
                raise
            report_user_error(UserError(_no_space(exc)))
            return EXIT_USER_ERROR
        except Exception:
            if not debug and _peer_reported(os.environ):
                return EXIT_USER_ERROR
            raise

    return entry

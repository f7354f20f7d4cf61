"""Photos on every core: `map_photos(fn, items, workers)` yields `fn(item)` for each item in the
order of `items`, computed by `workers` processes, so a tool's output is the same whatever their
number. The engine is `concurrent.futures.ProcessPoolExecutor`; this module adds:
- `workers == 1` runs `fn` here, with no pool (so do a worker of ours and a daemonic process, as a
  DataLoader worker). More are capped, said once, at the items and at the cores this process may
  use (`default_workers`): each costs memory, and would only share.
- Input order from a bounded window: at most `window` items are out (in work, or done and waiting
  for an earlier one); `items` is read as they are handed out.
- An exception `fn` raises in a worker is raised here at its item's turn, same type and message (a
  RuntimeError of it where it does not pickle): the first failing item in input order, as with one process.
- A worker that dies (SIGKILL, the out-of-memory killer) ends the map at once with `WorkerDied`
  naming its item, where the executor only says that some process ended.
- A cheap start: workers are forked from this process, with its imports and models, wherever no other
  thread runs (torch's pool, CUDA's, a Python thread may hold a lock the child would wait for forever).
  Else they come from a forkserver that imported `fn`'s module once (seconds: torch), or are spawned
  where none can listen (`_forkserver`), said once. Those run the main module again, so it is hidden
  from them while they start (a script without an `if __name__ == "__main__":` guard would redo its work).
- Workers ignore Ctrl-C (the parent, which gets it too, stops them), end with their parent, run
  torch on one thread, and run `setup()` before their first item (faces.detect hands them this
  process's HOG detector). Closing the iterator, or running it to its end, leaves no worker.

`fn` and the items must be picklable: a module-level function, or a functools.partial of one
holding what every item shares (it reaches each worker once, at its start)."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import types
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, TypeVar

from configs.errors import ConfigError, UserError

logger = logging.getLogger("shardface")
T = TypeVar("T")
R = TypeVar("R")
_worker: tuple | None = None  # in a worker process: (fn, [its setup, until run], the pid table)


class WorkerDied(UserError, RuntimeError):
    """A worker process that ended while it held an item (killed, out of memory)."""


def default_workers(env=os.environ) -> int:
    """The cores this process may run on (its affinity: a container's, taskset's or batch scheduler's
    limit), shared among torchrun's ranks on this node (LOCAL_WORLD_SIZE); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    return max(1, cores // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1)))


def check_workers(workers: int) -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"--workers {workers}: at least 1 (1 runs in this process)")
    return workers


def map_photos(
    fn: Callable[[T], R],
    items: Iterable[T],
    workers: int,
    progress: Callable[[], None] | None = None,
    what: str = "photo",
    name: Callable[[T], str] = str,
    window: int | None = None,
    setup: Callable[[], None] | None = None,
) -> Iterator[R]:
    """`fn(item)` for each of `items`, in order (module docstring). `progress()` once per result; `what`
    and `name(item)` word a dead worker's error; `window` (default 4 x workers) bounds the items out;
    `setup()` runs once in each worker (not with one worker: this process is set up already)."""
    workers = _capped(check_workers(workers), items)
    results = (
        (fn(item) for item in items)
        if workers == 1
        else _pooled(fn, items, workers, window or 4 * workers, what, name, setup)
    )
    with contextlib.closing(results):
        for result in results:
            if progress is not None:
                progress()
            yield result


def warm_up(fn: Callable, workers: int) -> None:
    """Where workers will come from a forkserver, start it now: it imports `fn`'s needs (seconds) meanwhile."""
    if workers > 1 and not multiprocessing.current_process().daemon and not _fork_is_safe():
        _forkserver(fn)


@functools.cache  # each said once per process
def _say_once(message: str) -> None:
    logger.warning("%s", message)


def _capped(workers: int, items: Iterable) -> int:
    if workers == 1 or _worker is not None or multiprocessing.current_process().daemon:
        return 1
    wanted, cores = (
        min(workers, max(1, len(items))) if hasattr(items, "__len__") else workers,
        default_workers(),
    )
    if wanted > cores:
        _say_once(
            f"{workers} worker processes asked for; this process may use {cores} cores: {cores} started"
        )
    return min(wanted, cores)


def _fork_is_safe() -> bool:
    """Whether forking here leaves no thread behind. Pools that stop themselves around a fork
    (numpy's OpenBLAS) do not count: a child that exits at once is forked to stop them first."""
    torch = sys.modules.get("torch")
    if (
        "fork" not in multiprocessing.get_all_start_methods()
        or threading.active_count() > 1
        or (torch is not None and torch.cuda.is_initialized())
    ):
        return False
    try:
        if len(os.listdir("/proc/self/task")) > 1:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", DeprecationWarning
                )  # Python 3.12+ warns of forking with threads
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
            os.waitpid(pid, 0)
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # fork refused (no memory, no process to spare), no /proc (not Linux)
        return False


def _context(fn) -> tuple[multiprocessing.context.BaseContext, dict | None]:
    """(the context the workers start from, the environment they must take or None)."""
    if _fork_is_safe():
        return multiprocessing.get_context("fork"), None
    if _forkserver(fn):
        return multiprocessing.get_context("forkserver"), dict(
            os.environ
        )  # else they would have the server's
    return multiprocessing.get_context("spawn"), None


def _module_of(fn) -> str:
    fn = fn.func if isinstance(fn, functools.partial) else fn  # a partial of a partial is one partial
    return getattr(fn, "__module__", None) or "__main__"


def _forkserver(fn) -> bool:
    """Start the forkserver (once: it serves every later pool), importing `fn`'s module, or where that is
    main (imported by name, runpy would warn) the modules main took its names from. False where it cannot
    run: none here, or no socket in the temporary directory (an AF_UNIX path holds 107 bytes; none writable)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import forkserver

    preload = {_module_of(fn)}
    if preload == {"__main__"}:
        preload = {
            v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
            for v in vars(sys.modules["__main__"]).values()
        }
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        sorted(m for m in preload if isinstance(m, str) and m not in ("__main__", "builtins"))
    )
    # Python 3.11's server drops the sys.path it is handed (and skips what it cannot import,
    # silently): give it ours through the environment it starts with.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    try:
        forkserver.ensure_running()
        return True
    except OSError as exc:
        why = (
            "no writable temporary directory"
            if isinstance(exc, FileNotFoundError)
            else f"the temporary directory cannot hold its socket ({exc}; TMPDIR={os.environ.get('TMPDIR')})"
        )
        _say_once(
            f"worker processes are spawned, each importing what it needs (seconds), instead of forked from a "
            f"forkserver: {why}"
        )
        return False
    finally:
        del os.environ["PYTHONPATH"]
        if saved is not None:
            os.environ["PYTHONPATH"] = saved


@contextlib.contextmanager
def _main_hidden(fn):
    main = sys.modules.get("__main__")
    if main is None or _module_of(fn) == "__main__":  # the workers need it
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _start_worker(fn, setup, pids, env: dict | None) -> None:
    """The executor's initializer, in each worker."""
    global _worker
    parent = os.getppid()
    # An idle worker waits on a queue whose writing end it holds itself: it would outlive a parent
    # killed with SIGKILL. The kernel kills it then (Linux's PR_SET_PDEATHSIG, 1).
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the call
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    signal.signal(
        signal.SIGTERM, signal.SIG_DFL
    )  # a fork inherits our handlers and mask: terminate() must end it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # one core per worker
    _worker = (fn, [setup] if setup is not None else [], pids)


def _work(index: int, item):
    """One item in a worker, its pid in the item's place of the table meanwhile."""
    fn, setup, pids = _worker
    pids[index % len(pids)] = os.getpid()
    try:
        while setup:
            setup.pop()()
        return fn(item)
    except BaseException as exc:  # everything: the parent names it
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        raise
    finally:
        pids[index % len(pids)] = 0


def _how(exitcode: int | None) -> str:
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    sig = next((s.name for s in signal.Signals if s == -exitcode), f"signal {-exitcode}")
    return f"was killed by {sig}" + (" (the out-of-memory killer sends it)" if sig == "SIGKILL" else "")


def _pooled(fn, items: Iterable, workers: int, window: int, what: str, name: Callable, setup) -> Iterator:
    """`map_photos` on an executor started with the first item (no code runs between the check
    that forking is safe and the fork). `out`: the items out, (index, item, future) in input order;
    `pids`: at `index % window` the pid of the worker on item `index`, 0 for none (the items out
    are consecutive: no two share a place). Closed, it terminates the workers still on an item."""
    window, items, out, executor = max(window, workers), enumerate(items), collections.deque(), None
    try:
        while True:
            for index, item in itertools.islice(items, window - len(out)):
                if executor is None:
                    ctx, env = _context(fn)
                    pids = ctx.Array("q", window, lock=False)
                    executor = ProcessPoolExecutor(
                        workers, mp_context=ctx, initializer=_start_worker, initargs=(fn, setup, pids, env)
                    )
                with _main_hidden(fn):  # a forkserver's or spawned worker starts on submit
                    out.append((index, item, executor.submit(_work, index, item)))
            if not out:
                return
            result = out[0][2].result()
            out.popleft()
            yield result
    except BrokenProcessPool:
        raise _died(executor, pids, out, what, name) from None
    finally:
        if executor is not None:
            if any(not future.done() for _, _, future in out):
                for process in (executor._processes or {}).values():  # Python 3.14 adds terminate_workers
                    process.terminate()
            executor.shutdown(wait=True)


def _died(
    executor: ProcessPoolExecutor, pids, out: collections.deque, what: str, name: Callable
) -> WorkerDied:
    """The error of the worker that ended by itself: the executor then ends the others with
    SIGTERM (a SIGTERM from elsewhere cannot be told from theirs: the earliest item is named)."""
    processes = list((executor._processes or {}).values())
    executor.shutdown(wait=True)  # every process joined: exit codes final
    held = {pids[index % len(pids)]: (index, item) for index, item, _ in reversed(out)}
    ended = [p for p in processes if p.exitcode != -signal.SIGTERM] or processes
    if not ended:
        return WorkerDied(f"the worker processes ended before their first {what}")
    dead = min(ended, key=lambda p: (p.pid not in held, held.get(p.pid, (0,))[0]))
    if dead.pid in held:
        return WorkerDied(
            f"{name(held[dead.pid][1])}: the worker process on this {what} {_how(dead.exitcode)}"
        )
    return WorkerDied(f"a worker process {_how(dead.exitcode)} between {what}s")

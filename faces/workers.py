"""Photos on every core: `map_photos(fn, items, workers)` yields `fn(item)` for each item in the
order of `items`, computed by `workers` processes, so a tool's output is the same whatever the
number of workers. The engine is `concurrent.futures.ProcessPoolExecutor`; this module adds:
- `workers == 1` runs `fn` here, with no pool (so do a worker of ours and a daemonic process, a
  DataLoader worker). More are capped, once said, at the items and at the cores this process
  may use (`default_workers`): each costs memory, and would only share.
- Input order from a bounded window: at most `window` items are out (being worked on, or done and
  waiting for an earlier one), and `items` is read as they are handed out.
- An exception `fn` raises in a worker is raised here when its item's turn comes, as the same type
  with the same message (one that does not pickle: a RuntimeError of it): the first failing item
  in input order is named exactly as with one process.
- A worker that dies (SIGKILL, the out-of-memory killer) ends the map at once with `WorkerDied`
  naming the item it held, where the executor only says that some process ended.
- A cheap start: the workers are forked from this process, with its imports and models, wherever
  no other thread runs (torch's pool, CUDA's, a Python thread may hold a lock the child would
  wait for forever). Otherwise they come from a forkserver that imported `fn`'s module once
  (seconds: torch), or are spawned where no forkserver can listen (TMPDIR too long for its socket,
  no writable temporary directory), which is said once. Those run the program's main module
  again, so it is hidden from them while they start (a script without an `if __name__ ==
  "__main__":` guard would redo its work in each).
- Workers ignore Ctrl-C (the parent, which gets it too, stops them), end with their parent, run
  torch on one thread, and run `setup()` before their first item (faces.detect hands them this
  process's HOG detector). Closing the iterator, or running it to its end, leaves no worker.

`fn` and the items must be picklable: a module-level function, or a functools.partial of one
holding what every item shares (it reaches each worker once, at its start).
"""
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
_SAID: set[str] = set()  # the log lines said once per process
_worker: tuple | None = None  # in a worker process: (fn, [its setup, until run], the pid table)


class WorkerDied(UserError, RuntimeError):
    """A worker process that ended while it held an item (killed, out of memory)."""


def default_workers(env=None) -> int:
    """The cores this process may run on (its affinity: the limit of a container, taskset or batch
    scheduler), shared among the ranks torchrun started on this node (LOCAL_WORLD_SIZE); at least 1."""
    env = os.environ if env is None else env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # macOS
    return max(1, cores // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1)))


def check_workers(workers: int, option: str = "--workers") -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"{option} {workers}: at least 1 (1 runs in this process)")
    return workers


def map_photos(fn: Callable[[T], R], items: Iterable[T], workers: int,
               progress: Callable[[], None] | None = None, what: str = "photo",
               name: Callable[[T], str] = str, window: int | None = None,
               setup: Callable[[], None] | None = None) -> Iterator[R]:
    """`fn(item)` for each of `items`, in their order (see the module docstring). `progress()` is
    called once per result; `what` and `name(item)` word the error of a worker that dies; `window`
    (default 4 x workers) bounds the items out at once; `setup()` runs once in each worker (not
    with one worker: this process is set up)."""
    workers = _capped(check_workers(workers), items)
    pool = _Pool(fn, items, workers, window or 4 * workers, what, name, setup) if workers > 1 else None
    try:
        for result in map(fn, items) if pool is None else pool.results():
            if progress is not None:
                progress()
            yield result
    finally:
        if pool is not None:
            pool.close()


def warm_up(fn: Callable, workers: int) -> None:
    """Where the workers will come from a forkserver, start it now, so that it imports what `fn`
    needs (seconds: torch) while this process does other work."""
    if workers > 1 and not multiprocessing.current_process().daemon and not _fork_is_safe():
        _forkserver(fn)


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning("%s", message)


def _capped(workers: int, items: Iterable) -> int:
    if workers == 1 or _worker is not None or multiprocessing.current_process().daemon:
        return 1
    wanted, cores = min(workers, max(1, len(items))) if hasattr(items, "__len__") else workers, default_workers()
    if wanted > cores:
        _say_once(f"{workers} worker processes asked for; this process may use {cores} cores: {cores} started")
    return min(wanted, cores)


def _fork_is_safe() -> bool:
    """Whether forking here leaves no thread behind. Pools that stop themselves around a fork
    (numpy's OpenBLAS) do not count: a child that exits at once is forked to stop them first."""
    torch = sys.modules.get("torch")
    if ("fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1
            or not os.path.isdir("/proc/self/task") or (torch is not None and torch.cuda.is_initialized())):
        return False
    try:
        if len(os.listdir("/proc/self/task")) > 1:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns of forking with threads
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
            os.waitpid(pid, 0)
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # fork refused (no memory, no process to spare), /proc unreadable
        return False


def _context(fn) -> tuple[multiprocessing.context.BaseContext, dict | None]:
    """(the context the workers start from, the environment they must take or None)."""
    if _fork_is_safe():
        return multiprocessing.get_context("fork"), None
    if _forkserver(fn):
        return multiprocessing.get_context("forkserver"), dict(os.environ)  # else they would have the server's
    return multiprocessing.get_context("spawn"), None


def _module_of(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", None) or "__main__"


def _forkserver(fn) -> bool:
    """Start the forkserver (once: it serves every later pool), having it import `fn`'s module, or
    where that is the program's main module (imported under its own name, runpy would warn) the
    modules main took its names from. False where it cannot run: none on this system, or no
    socket for it in the temporary directory (an AF_UNIX path holds 107 bytes)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    from multiprocessing import forkserver
    preload = {_module_of(fn)}
    if preload == {"__main__"}:
        preload = {v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
                   for v in vars(sys.modules["__main__"]).values()}
    multiprocessing.get_context("forkserver").set_forkserver_preload(
        sorted(m for m in preload if isinstance(m, str) and m not in ("__main__", "builtins")))
    # Python 3.11's server drops the sys.path it is handed (and skips what it cannot import,
    # silently): give it ours through the environment it starts with.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    try:
        forkserver.ensure_running()
        return True
    except OSError as exc:
        why = ("no writable temporary directory" if isinstance(exc, FileNotFoundError)
               else f"the temporary directory cannot hold its socket ({exc}; TMPDIR={os.environ.get('TMPDIR')})")
        _say_once(f"worker processes are spawned, each importing what it needs (seconds), instead of forked from a "
                  f"forkserver: {why}")
        return False
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
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
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork inherits our handlers and mask: terminate() must end it
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
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"was killed by {sig}" + (" (the out-of-memory killer sends it)" if sig == "SIGKILL" else "")
    return f"exited with code {exitcode}"


class _Pool:
    """One `map_photos`' executor and its window of items out. The table `pids` holds, at
    `index % window`, the pid of the worker on item `index` (0: none): the items out are
    consecutive, so none shares a place with another, and an item's place is free again once its
    result is in."""

    def __init__(self, fn, items: Iterable, workers: int, window: int, what: str, name: Callable, setup):
        self.fn, self.items, self.workers, self.setup = fn, enumerate(items), workers, setup
        self.window, self.what, self.name = max(window, workers), what, name
        self.out: collections.deque = collections.deque()  # (index, item, future) in input order
        self.executor: ProcessPoolExecutor | None = None  # started with the first item: no code
        # runs between the check that forking is safe and the fork

    def results(self) -> Iterator:
        try:
            while True:
                for index, item in itertools.islice(self.items, self.window - len(self.out)):
                    if self.executor is None:
                        ctx, env = _context(self.fn)
                        self.pids = ctx.Array("q", self.window, lock=False)
                        self.executor = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_start_worker,
                                                            initargs=(self.fn, self.setup, self.pids, env))
                    with _main_hidden(self.fn):  # a forkserver's or spawned worker starts on submit
                        self.out.append((index, item, self.executor.submit(_work, index, item)))
                if not self.out:
                    return
                result = self.out[0][2].result()
                self.out.popleft()
                yield result
        except BrokenProcessPool:
            raise self._died() from None

    def _processes(self) -> list[multiprocessing.Process]:
        """The executor's own table of its processes (Python 3.14 adds terminate_workers)."""
        return list((self.executor._processes or {}).values())

    def _died(self) -> WorkerDied:
        """The error of the worker that ended by itself: the executor then ends the others with
        SIGTERM (a SIGTERM from elsewhere cannot be told from theirs: the earliest item is named)."""
        processes = self._processes()
        self.executor.shutdown(wait=True)  # every process joined: exit codes final
        held = {self.pids[index % self.window]: (index, item) for index, item, _ in reversed(self.out)}
        ended = [p for p in processes if p.exitcode != -signal.SIGTERM] or processes
        if not ended:
            return WorkerDied(f"the worker processes ended before their first {self.what}")
        dead = min(ended, key=lambda p: (p.pid not in held, held.get(p.pid, (0,))[0]))
        if dead.pid in held:
            return WorkerDied(f"{self.name(held[dead.pid][1])}: the worker process on this {self.what} "
                              f"{_how(dead.exitcode)}")
        return WorkerDied(f"a worker process {_how(dead.exitcode)} between {self.what}s")

    def close(self) -> None:
        """Workers still on an item nobody will take (an error or the caller ended the map) are
        terminated; idle ones end on the executor's word. Every process is joined."""
        if self.executor is None:
            return
        if any(not future.done() for _, _, future in self.out):
            for process in self._processes():
                process.terminate()
        self.executor.shutdown(wait=True)
        self.out.clear()

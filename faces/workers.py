"""Photos on every core: `map_photos(fn, items, workers)` yields `fn(item)` for each item in the
order of `items`, computed by `workers` processes, so a tool's output is the same whatever the
number of workers.

The engine is `concurrent.futures.ProcessPoolExecutor`; this module adds what it does not give:
- `workers == 1` runs `fn` here, with no pool. More are capped, once said, at the items and at the
  cores this process may use (`default_workers`): each worker costs memory, and would only share.
- Input order from a bounded window: at most `window` items are out (being worked on, or done and
  waiting for an earlier one), and `items` is read as they are handed out.
- An exception `fn` raises in a worker is raised here when its item's turn comes, as the same type
  with the same message (the worker's traceback is its `__cause__`): the first failing item in
  input order is named exactly as with one process.
- A worker that dies (SIGKILL, the out-of-memory killer) ends the map at once with `WorkerDied`
  naming the item it held, where the executor only says that some process ended: each worker
  notes the item it is on in a small shared table (`_Slots`).
- A cheap start: the workers are forked from this process, with its imports and models, in
  milliseconds, wherever that is safe (`_fork_is_safe`: no thread but the forking one). Otherwise
  (torch's thread pool or CUDA started, another thread running) they come from a forkserver that
  imported `fn`'s module once (seconds: torch), or are spawned where no forkserver can listen
  (TMPDIR too long for its socket, no writable temporary directory), which is said once.
- Workers ignore Ctrl-C (the parent, which gets it too, stops them) and run torch on one thread;
  `setup()` runs in each before its first item (faces.photos hands them this process's HOG
  detector: 1.5 s to build, milliseconds to unpickle). Closing the iterator (or running it to its
  end) stops the workers: none is left behind.

`fn` and the items must be picklable: a module-level function, or a functools.partial of one
holding what every item shares (it reaches each worker once, at its start).
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
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


class WorkerDied(UserError, RuntimeError):
    """A worker process that ended while it held an item (killed, out of memory)."""


def default_workers(env=None) -> int:
    """The cores this process may run on (`os.sched_getaffinity`: the limit of a container,
    taskset or batch scheduler), shared among the ranks torchrun started on this node
    (LOCAL_WORLD_SIZE); at least 1."""
    env = os.environ if env is None else env
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1)))


def check_workers(workers: int, option: str = "--workers") -> int:
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ConfigError(f"{option} {workers}: at least 1 (1 runs in this process)")
    return workers


def map_photos(fn: Callable[[T], R], items: Iterable[T], workers: int,
               progress: Callable[[], None] | None = None, what: str = "photo",
               name: Callable[[T], str] = str, window: int | None = None,
               setup: Callable[[], None] | None = None) -> Iterator[R]:
    """`fn(item)` for each of `items`, in their order, on `workers` processes (see the module
    docstring). `progress()` is called once per result; `what` and `name(item)` word the
    message of a worker that dies; `window` (default 4 x workers) bounds the items out at once;
    `setup()` runs once in each worker process (not with one worker: this process is set up).
    Close the iterator (or run it to its end) to stop the workers; an abandoned one is closed
    when it is collected."""
    workers = _capped(check_workers(workers), items)
    if workers == 1:
        for item in items:
            result = fn(item)
            if progress is not None:
                progress()
            yield result
        return
    pool = _Pool(fn, items, workers, window or 4 * workers, what, name, setup)
    try:
        for result in pool.results():
            if progress is not None:
                progress()
            yield result
    finally:
        pool.close()


def warm_up(fn: Callable, workers: int) -> None:
    """Where the workers will come from a forkserver (see `_start_method`), start it now, so that
    it imports what `fn` needs (seconds: torch) while this process does other work; forked
    workers need nothing ahead."""
    if workers > 1 and not multiprocessing.current_process().daemon and not _fork_is_safe():
        _forkserver(fn)


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        logger.warning("%s", message)


def _capped(workers: int, items: Iterable) -> int:
    """`workers`, at most one per item and one per core this process may use; 1 in a worker of
    ours (no pool in a pool) and in a daemonic process (a DataLoader worker, a test rank), which
    may not start processes."""
    if workers == 1 or _Worker.current is not None or multiprocessing.current_process().daemon:
        return 1  # one (a photo at a time, as training's aligned folders read theirs) asks nothing of the system
    wanted, cores = max(1, min(workers, len(items))) if hasattr(items, "__len__") else workers, default_workers()
    if wanted > cores:
        _say_once(f"{workers} worker processes asked for; this process may use {cores} cores: {cores} started")
    return min(wanted, cores)


def _fork_is_safe() -> bool:
    """Whether this process may fork the workers: only where no thread but the forking one would
    be left behind by the fork (torch's OpenMP pool once an op ran, CUDA's, gloo's, a Python
    thread): such a thread may hold a lock the child then waits for forever. Pools that stop
    themselves before a fork (numpy's OpenBLAS) do not count: a child that exits at once (it runs
    only Python's after-fork hooks) is forked to stop them, and the threads are counted after."""
    torch = sys.modules.get("torch")
    if ("fork" not in multiprocessing.get_all_start_methods() or threading.active_count() > 1
            or not os.path.isdir("/proc/self/task") or (torch is not None and torch.cuda.is_initialized())):
        return False
    try:
        if len(os.listdir("/proc/self/task")) == 1:
            return True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+ warns of forking with threads
            pid = os.fork()
            if pid == 0:
                os._exit(0)
        os.waitpid(pid, 0)
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:  # fork refused (no memory, no process to spare), /proc unreadable
        return False


def _start_method(fn) -> tuple[multiprocessing.context.BaseContext, dict | None]:
    """(the context the workers start from, the environment they must take or None): forked from
    here where that is safe, else a forkserver's, else spawned (see the module docstring)."""
    if _fork_is_safe():
        return multiprocessing.get_context("fork"), None
    ctx = _forkserver(fn)
    if ctx is not None:
        return ctx, dict(os.environ)  # a forkserver's children have the server's: give them ours
    return multiprocessing.get_context("spawn"), None


def _preload(fn) -> list[str]:
    """The modules the forkserver imports before it forks workers: `fn`'s, or where that is the
    program's main module (run again in each worker as `__mp_main__`, and runpy warns when it
    was imported under its own name), the modules it took its names from."""
    module = _module_of(fn)
    if module != "__main__":
        return [module]
    names = set()
    for value in vars(sys.modules["__main__"]).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name not in ("__main__", "builtins"):
            names.add(name)
    return sorted(names)


@contextlib.contextmanager
def _main_left_alone(fn):
    """While workers start: a worker from a forkserver or spawned runs the program's main module
    again (as `__mp_main__`) before its first item, so a user's script without an
    `if __name__ == "__main__":` guard would do its whole work again in each. Where `fn` lives
    in a module of its own, the main module is hidden from multiprocessing meanwhile."""
    main = sys.modules.get("__main__")
    if main is None or _module_of(fn) == "__main__":
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


def _module_of(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__module__", None) or "__main__"


def _forkserver(fn):
    """The forkserver context, its server running and having imported what `fn` needs (it starts
    with this program's first such pool and serves every later one), or None where it cannot run:
    no forkserver on this system, or no socket for it in the temporary directory (an AF_UNIX path
    holds 107 bytes; TMPDIR, /tmp, /var/tmp unwritable)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return None
    from multiprocessing import forkserver
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_preload(fn))
    # Python 3.11's server drops the sys.path it is handed (and imports from its own, silently
    # skipping what it cannot find): give it ours through the environment it starts with.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    try:
        forkserver.ensure_running()
    except OSError as exc:
        why = ("no writable temporary directory" if isinstance(exc, FileNotFoundError)
               else f"the temporary directory cannot hold its socket ({exc}; TMPDIR={os.environ.get('TMPDIR')})")
        _say_once(f"worker processes are spawned, each importing what it needs (seconds), instead of forked from a "
                  f"forkserver: {why}")
        return None
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


class _Slots:
    """Which item each worker is on, in shared memory: per worker its pid and the index of its
    item (-1 between items). A worker writes only its own slot (one word: no lock); the parent reads
    them once a worker died, to name the item it held."""

    def __init__(self, ctx, workers: int):
        self.table = ctx.Array("q", 2 * workers)  # zeros: no worker yet; its lock guards claims only

    def claim(self) -> int:
        """In a worker, at its start: the slot it writes."""
        with self.table.get_lock():
            raw = self.table.get_obj()
            slot = next(s for s in range(0, len(raw), 2) if raw[s] == 0)
            raw[slot], raw[slot + 1] = os.getpid(), -1
        return slot

    def note(self, slot: int, index: int) -> None:
        self.table.get_obj()[slot + 1] = index

    def held(self) -> dict[int, int]:
        """pid -> the index of the item it is on (-1: none)."""
        raw = self.table.get_obj()
        return {raw[s]: raw[s + 1] for s in range(0, len(raw), 2) if raw[s]}


class _Worker:
    """What a worker process keeps between items: the task, the setup still to run, its slot."""
    current: _Worker | None = None

    def __init__(self, fn, setup, slots: _Slots):
        self.fn, self.setup, self.slots, self.slot = fn, setup, slots, slots.claim()


def _end_with_parent() -> None:
    """Have the kernel kill this process when its parent dies (Linux's PR_SET_PDEATHSIG): an
    executor's idle worker waits on a queue whose writing end it holds itself, so it would never
    see a parent killed with SIGKILL, and stay."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def _start_worker(fn, setup, slots: _Slots, env: dict | None) -> None:
    """The executor's initializer, in each worker."""
    _end_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork inherits our handlers and mask: terminate() must end it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # one core per worker
    _Worker.current = _Worker(fn, setup, slots)


def _work(index: int, item):
    """One item in a worker: `setup()` first if it has not run yet, then `fn(item)`. An exception
    that would not survive pickling comes back as a RuntimeError of its message."""
    worker = _Worker.current
    worker.slots.note(worker.slot, index)
    try:
        if worker.setup is not None:
            setup, worker.setup = worker.setup, None
            setup()
        return worker.fn(item)
    except BaseException as exc:  # everything: the parent names it
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        raise
    finally:
        worker.slots.note(worker.slot, -1)


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"was killed by {sig}" + (" (the out-of-memory killer sends it)" if sig == "SIGKILL" else "")
    return f"exited with code {exitcode}"


class _Executor(ProcessPoolExecutor):
    def processes(self) -> list[multiprocessing.Process]:
        """Its worker processes, from the executor's own table (`_processes`): their exit codes
        tell which one died, and close() terminates busy ones (Python 3.14 adds terminate_workers)."""
        return list((self._processes or {}).values())


class _Pool:
    """One `map_photos`' executor and its window of items out (see the module docstring).
    `results()` yields in input order; `close()` stops everything."""

    def __init__(self, fn, items: Iterable, workers: int, window: int, what: str, name: Callable, setup):
        self.items, self.window, self.what, self.name = enumerate(items), max(window, workers), what, name
        self.out: collections.deque = collections.deque()  # (index, item, future) in input order
        self.fn, self.workers, self.setup = fn, workers, setup
        self.executor: _Executor | None = None  # started with the first item: no code runs between
        # the check that forking is safe and the fork

    def _start(self) -> None:
        ctx, env = _start_method(self.fn)
        self.slots = _Slots(ctx, self.workers)
        self.executor = _Executor(self.workers, mp_context=ctx, initializer=_start_worker,
                                  initargs=(self.fn, self.setup, self.slots, env))

    def results(self) -> Iterator:
        while True:
            while self.items is not None and len(self.out) < self.window:
                try:
                    index, item = next(self.items)
                except StopIteration:
                    self.items = None
                    break
                if self.executor is None:
                    self._start()
                try:
                    with _main_left_alone(self.fn):  # a forkserver's or spawned worker starts on submit
                        self.out.append((index, item, self.executor.submit(_work, index, item)))
                except BrokenProcessPool:
                    raise self._died() from None
            if not self.out:
                return
            try:
                result = self.out[0][2].result()
            except BrokenProcessPool:
                raise self._died() from None
            self.out.popleft()
            yield result

    def _died(self) -> WorkerDied:
        """The error of the worker that ended by itself: the executor then ends the others with
        SIGTERM (a SIGTERM from elsewhere cannot be told from theirs: the earliest item is named)."""
        processes = self.executor.processes()
        self.executor.shutdown(wait=True)  # every process joined: exit codes final
        held, out = self.slots.held(), {index: item for index, item, _ in self.out}
        ended = [p for p in processes if p.exitcode != -signal.SIGTERM] or processes
        if not ended:
            return WorkerDied(f"the worker processes ended before their first {self.what}")
        dead = min(ended, key=lambda p: (held.get(p.pid, -1) not in out, held.get(p.pid, -1)))
        index = held.get(dead.pid, -1)
        if index in out:
            return WorkerDied(f"{self.name(out[index])}: the worker process on this {self.what} {_how(dead.exitcode)}")
        return WorkerDied(f"a worker process {_how(dead.exitcode)} between {self.what}s")

    def close(self) -> None:
        """Workers still on an item nobody will take (an error or the caller ended the map) are
        terminated; idle ones end on the executor's word. Every process is joined."""
        if self.executor is None:
            return
        if any(not future.done() for _, _, future in self.out):
            for process in self.executor.processes():
                process.terminate()
        self.executor.shutdown(wait=True)
        self.out.clear()

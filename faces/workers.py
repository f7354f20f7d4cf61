"""Photos on every core: `map_photos(fn, items, workers=N)` yields `fn(item)` for each item in the
order of `items`, computed by N processes of `concurrent.futures.ProcessPoolExecutor`, so a tool's
output is the same whatever their number. Around the executor this module adds what it lacks:
- `workers=1` runs `fn` here, with no pool (so do a worker of ours and a daemonic process, such as
  a DataLoader worker). More are capped, said once, at the items and at the cores this process may
  use (`default_workers`): each costs memory, and would only share.
- Input order from a bounded window: at most `window` items are out (in work, or done and waiting
  for an earlier one); `items` is read as they are handed out.
- An exception `fn` raises in a worker is raised here at its item's turn, same type and message (a
  RuntimeError of it where it does not pickle): the first failing item in input order, as with one process.
- A worker that dies (SIGKILL, the out-of-memory killer) ends the map at once with `WorkerDied`
  naming its item, where the executor only says that some process ended.
- A cheap start from any thread: workers are forked by multiprocessing's forkserver, which imported
  `fn`'s module once (seconds: torch; `warm_up` starts it early), or are spawned where it cannot
  listen (no socket in the temporary directory), said once. Never forked from this process, whose
  other threads may hold locks. As in every multiprocessing program, a script that starts workers
  keeps its work under `if __name__ == "__main__":` (a worker imports the main module).
- Workers take this process's environment as it is at the map's start, ignore Ctrl-C from their
  first instruction (the parent, which gets it too, stops them), end with their parent, run torch
  on one thread, and run `setup()` before their first item. Closing the iterator, or running it to
  its end, leaves no worker.

This process's environment, signal dispositions and start method are left as they are. `fn` and
the items must be picklable: a module-level function, or a functools.partial of one holding what
every item shares (it reaches each worker once, at its start)."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import signal
import sys
import threading
import types
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, TypeVar

from shardface.errors import ConfigError, UserError

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
    *,
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
    """Where workers will come from the forkserver, start it now: it imports `fn`'s needs (seconds) meanwhile."""
    if workers > 1 and _worker is None and not multiprocessing.current_process().daemon:
        _context(fn)


@functools.cache  # each said once per process
def _say_once(message: str) -> None:
    logger.warning("%s", message)


def _capped(workers: int, items: Iterable) -> int:
    if workers == 1 or _worker is not None or multiprocessing.current_process().daemon:
        return 1
    wanted = min(workers, max(1, len(items))) if hasattr(items, "__len__") else workers
    cores = default_workers()
    if wanted > cores:
        _say_once(
            f"{workers} worker processes asked for; this process may use {cores} cores: {cores} started"
        )
    return min(wanted, cores)


@contextlib.contextmanager
def _ctrl_c_held():
    """Ctrl-C held back in this thread while it starts workers: a spawned worker inherits the mask,
    so it ignores Ctrl-C from its first instruction, not only once its initializer runs (a thread's
    own mask: no other thread's signals change)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _module_of(fn) -> str:
    fn = fn.func if isinstance(fn, functools.partial) else fn  # a partial of a partial is one partial
    return getattr(fn, "__module__", None) or "__main__"


def _preload(fn) -> list[str]:
    """`fn`'s module and the modules the main module took its names from: a worker imports both (it
    runs the main module again), so the forkserver imports them once (those it cannot, it skips)."""
    main = sys.modules.get("__main__")
    names = {_module_of(fn)}
    for value in vars(main).values() if main is not None else ():
        names.add(
            value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        )
    return sorted(n for n in names if isinstance(n, str) and n not in ("__main__", "__mp_main__", "builtins"))


def _context(fn) -> multiprocessing.context.BaseContext:
    """The forkserver's context, its server running and importing `_preload(fn)` (the first call in a
    process decides what it imports), or spawn's where it cannot listen. The server starts with
    Ctrl-C held back, so every worker it forks starts so too."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_preload(fn))
    try:
        # the resource tracker first: starting it unblocks Ctrl-C in this thread (multiprocessing's own)
        multiprocessing.resource_tracker.ensure_running()
        with _ctrl_c_held():
            multiprocessing.forkserver.ensure_running()
        return context
    except OSError as exc:  # no temporary directory to write in, or a path too long for its socket
        why = (
            "no writable temporary directory"
            if isinstance(exc, FileNotFoundError)
            else f"the temporary directory cannot hold its socket ({exc}; TMPDIR={os.environ.get('TMPDIR')})"
        )
        _say_once(
            "worker processes are spawned, each importing what it needs (seconds), instead of forked "
            f"from a forkserver: {why}"
        )
        return multiprocessing.get_context("spawn")


def _start_worker(fn, setup, pids, env: dict) -> None:
    """The executor's initializer, in each worker."""
    global _worker
    os.environ.clear()  # the parent's, at the map's start (a forkserver's workers have the server's)
    os.environ.update(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGTERM, _terminated)
    # An idle worker waits on a queue whose writing end it holds itself: it would outlive a parent
    # killed with SIGKILL. Its parent's sentinel becomes ready when the parent ends.
    threading.Thread(target=_end_with_parent, args=(multiprocessing.parent_process(),), daemon=True).start()
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # one core per worker
    _worker = (fn, [setup] if setup is not None else [], pids)


def _end_with_parent(parent) -> None:
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)


def _terminated(signum, frame) -> None:
    """SIGTERM, from the executor ending the others after one worker died, or from closing the map:
    this worker's item is not the one that killed it, so its place in the pid table is cleared."""
    if _worker is not None:
        pids = _worker[2]
        for i in range(len(pids)):
            if pids[i] == os.getpid():
                pids[i] = 0
    os._exit(128 + signal.SIGTERM)


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


def _pooled(fn, items: Iterable, workers: int, window: int, what: str, name: Callable, setup) -> Iterator:
    """`map_photos` on an executor of forkserver's or spawned workers. `out`: the items out, (index, item, future) in input order;
    `pids`: at `index % window` the pid of the worker on item `index`, 0 for none (the items out are
    consecutive: no two share a place). Closed, it terminates the workers still on an item."""
    window, items, out = max(window, workers), enumerate(items), collections.deque()
    context = _context(fn)
    pids = context.Array("q", window, lock=False)
    executor = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(fn, setup, pids, dict(os.environ))
    )
    try:
        while True:
            for index, item in itertools.islice(items, window - len(out)):
                with _ctrl_c_held():  # a worker starts on submit
                    out.append((index, item, executor.submit(_work, index, item)))
            if not out:
                return
            result = out[0][2].result()
            out.popleft()
            yield result
    except BrokenProcessPool:
        executor.shutdown(wait=True)  # every worker ended: the pid table is final
        raise _died(pids, out, what, name) from None
    finally:
        for pid in {pids[index % window] for index, _, future in out if not future.done()} - {0}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        executor.shutdown(wait=True, cancel_futures=True)


def _died(pids, out: collections.deque, what: str, name: Callable) -> WorkerDied:
    """The error of the worker that ended by itself: the others, which the executor then ends with
    SIGTERM, have cleared their places. The earliest item still held is named."""
    held = [item for index, item, _ in out if pids[index % len(pids)] != 0]
    if held:
        return WorkerDied(
            f"{name(held[0])}: the worker process on this {what} died (killed by a signal: the "
            "out-of-memory killer sends SIGKILL)"
        )
    return WorkerDied(
        f"a worker process ended before it took a {what} (a script that starts workers keeps its work "
        'under `if __name__ == "__main__":`, see faces/workers.py)'
    )

"""Photos on every core: `map_photos(fn, items, workers)` yields `fn(item)` for each item in the
order of `items`, computed by `workers` processes, so a tool's output is the same whatever the
number of workers.

- `workers == 1` runs `fn` here, with no pool at all (what the tools did before).
- Otherwise the workers are forked from a forkserver: a clean process that imported `fn`'s module
  once. Forking this process is unsafe once torch runs threads, and spawning imports torch in
  every worker (seconds and hundreds of MB each); a fork of the server shares its imports. dlib's
  detector and landmark model are loaded once per worker by `faces.detect`'s caches.
- A thread here hands each idle worker one item and collects its result, so the workers keep
  working while the caller uses the results (writes files, embeds a batch). At most `window`
  items are out at a time (being worked on, or done and waiting for an earlier one): memory
  stays bounded however many items there are, and `items` is read as they are handed out.
- An exception `fn` raises in a worker is raised here when its item's turn comes, as the same
  type with the same message, so the first failing item (in input order) is named exactly as
  with one process; the worker's traceback is its `__cause__`.
- A worker that dies (SIGKILL, the out-of-memory killer) ends the map at once with
  `WorkerDied` naming the item it held: never a hang. The remaining workers are stopped.
- Progress (`progress()`, once per item, as results are taken) counts every worker's items.
- `setup()`, where given, runs in each worker before its first item (faces.photos passes one that
  hands the workers this process's HOG detector: 1.5 s to build, milliseconds to unpickle).

`fn` and the items must be picklable: a module-level function, or a functools.partial of one
holding what every item shares (it reaches each worker once, at its start).
"""
from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import types
from multiprocessing.connection import wait
from typing import Callable, Iterable, Iterator, TypeVar

from configs.errors import ConfigError, UserError

T = TypeVar("T")
R = TypeVar("R")


class WorkerDied(UserError, RuntimeError):
    """A worker process that ended while it held an item (killed, out of memory)."""


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker, as text (the cause of the one raised here)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


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
    workers = check_workers(workers)
    if hasattr(items, "__len__"):
        workers = max(1, min(workers, len(items)))  # no idle processes for a few photos
    if workers > 1 and multiprocessing.current_process().daemon:
        workers = 1  # a daemonic process (a DataLoader worker, a test rank) may not start processes
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
    """Start the process the workers are forked from now (with more than one worker), so that it
    imports what `fn` needs while this one does other work (lists and checks the photos);
    `map_photos` then finds it ready. The imports take seconds (torch)."""
    if workers > 1 and not multiprocessing.current_process().daemon:
        _context(fn)


def _preload(fn) -> list[str]:
    """The modules the forkserver imports before it forks workers: `fn`'s, or where that is the
    program's main module (run again in each worker as `__mp_main__`, and runpy warns when it
    was imported under its own name), the modules it took its names from."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    module = getattr(fn, "__module__", None) or "__main__"
    if module != "__main__":
        return [module]
    names = set()
    for value in vars(sys.modules["__main__"]).values():
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        if isinstance(name, str) and name not in ("__main__", "builtins"):
            names.add(name)
    return sorted(names)


def _context(fn):
    """A forkserver context whose server has imported what `fn` needs (spawn where there is no
    forkserver). The server starts with this program's first pool and serves every later one."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    from multiprocessing import forkserver
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_preload(fn))
    # Python 3.11's server drops the sys.path it is handed (and imports from its own, silently
    # skipping what it cannot find): give it ours through the environment it starts with.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return ctx


def _portable(exc: BaseException, traceback_text: str):
    """(exception, traceback text), the exception replaced by a RuntimeError of its message
    where it would not survive pickling."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc, traceback_text


def _serve(conn, fn, env, setup) -> None:
    """A worker: `fn` on each item it is handed, until it is handed None or its parent is gone."""
    import traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    os.environ.clear()
    os.environ.update(env)  # the parent's, now (a forkserver's children have the server's)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)  # one core per worker
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if task is None:
            return
        index, item = task
        try:
            if setup is not None:
                setup, once = None, setup
                once()
            reply = (index, True, fn(item))
        except BaseException as exc:  # everything: the parent names it
            reply = (index, False, _portable(exc, traceback.format_exc()))
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError, ConnectionError):
            return
        except Exception as exc:  # a result that cannot be pickled
            conn.send((index, False, _portable(exc, traceback.format_exc())))


def _how(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            sig = signal.Signals(-exitcode).name
        except ValueError:
            sig = f"signal {-exitcode}"
        return f"was killed by {sig}" + (" (the out-of-memory killer sends it)" if sig == "SIGKILL" else "")
    return f"exited with code {exitcode}"


class _Pool:
    """The worker processes of one `map_photos` and the thread that feeds them (see the module
    docstring). `results()` yields in input order; `close()` stops everything."""

    def __init__(self, fn, items: Iterable, workers: int, window: int, what: str, name: Callable, setup):
        self.items, self.window, self.what, self.name = enumerate(items), max(window, workers), what, name
        self.done: dict[int, tuple[bool, object]] = {}  # index -> (ok, result or (exception, traceback))
        self.failure: BaseException | None = None  # ends the map at once (a worker died, `items` raised)
        self.total: int | None = None  # the number of items, once `items` is exhausted
        self.taken = 0  # results yielded so far: items up to taken + window may be handed out
        self.stopping = False
        self.busy: set[int] = set()  # workers holding an item when the feeder ended
        self.cond = threading.Condition()
        self.wake_r, self.wake_w = os.pipe()  # wakes the feeder when the window moves or at close
        os.set_blocking(self.wake_w, False)
        ctx, env = _context(fn), dict(os.environ)
        self.procs, self.conns = [], []
        try:
            for i in range(workers):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(there, fn, env, setup), name=f"{what}-worker-{i}", daemon=True)
                proc.start()
                there.close()
                self.procs.append(proc)
                self.conns.append(here)
        except BaseException:
            self._stop_workers(busy=set(range(len(self.procs))))
            raise
        self.feeder = threading.Thread(target=self._feed, name=f"{what}-feeder", daemon=True)
        self.feeder.start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a full pipe is already a wake-up
            os.write(self.wake_w, b"x")

    def results(self) -> Iterator:
        index = 0
        while True:
            with self.cond:
                while (self.failure is None and index not in self.done
                       and (self.total is None or index < self.total)):
                    self.cond.wait()
                if self.failure is not None:
                    raise self.failure
                if index not in self.done:  # every item taken
                    return
                ok, value = self.done.pop(index)
                index = self.taken = index + 1
            self._wake()
            if not ok:
                exc, text = value
                raise exc from WorkerTraceback(text)
            yield value

    def _fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.failure is None:
                self.failure = exc
            self.cond.notify_all()

    def _feed(self) -> None:
        held: dict[int, tuple[int, object]] = {}  # worker -> (index, item) it works on
        last: dict[int, object] = {}  # worker -> the last item it finished
        handed, exhausted, stop_after = 0, False, None  # stop_after: the first failed index
        try:
            while not self.stopping:
                idle = [w for w in range(len(self.procs)) if w not in held]
                while idle and not exhausted:
                    with self.cond:
                        limit = self.taken + self.window
                    if handed >= limit or (stop_after is not None and handed > stop_after):
                        break
                    try:
                        index, item = next(self.items)
                    except StopIteration:
                        exhausted = True
                        with self.cond:
                            self.total = handed
                            self.cond.notify_all()
                        break
                    w = idle.pop()
                    held[w] = (index, item)
                    handed += 1
                    try:
                        self.conns[w].send((index, item))
                    except (BrokenPipeError, ConnectionError, EOFError):
                        pass  # it died: its sentinel says so below
                if exhausted and not held:
                    return
                watched = [self.wake_r] + [c for c in self.conns] + [p.sentinel for p in self.procs]
                ready = set(wait(watched))
                if self.wake_r in ready:
                    os.read(self.wake_r, 4096)
                for w, (proc, conn) in enumerate(zip(self.procs, self.conns)):
                    if conn not in ready and proc.sentinel not in ready:
                        continue
                    reply = None
                    with contextlib.suppress(EOFError, OSError):
                        if conn.poll():
                            reply = conn.recv()
                    if reply is None:
                        if proc.is_alive():
                            continue
                        proc.join(1.0)
                        if w in held:
                            raise WorkerDied(f"{self.name(held[w][1])}: the worker process on this {self.what} "
                                             f"{_how(proc.exitcode)}")
                        after = f" after {self.name(last[w])}" if w in last else ""
                        raise WorkerDied(f"a worker process {_how(proc.exitcode)} between {self.what}s{after}")
                    index, ok, value = reply
                    last[w] = held.pop(w)[1]
                    if not ok and (stop_after is None or index < stop_after):
                        stop_after = index  # later items would only be thrown away
                    with self.cond:
                        self.done[index] = (ok, value)
                        self.cond.notify_all()
        except BaseException as exc:  # a worker died, `items` raised, or a bug here: the caller raises it
            self._fail(exc)
        finally:
            self.busy = set(held)

    def close(self) -> None:
        self.stopping = True
        self._wake()
        self.feeder.join()
        self._stop_workers(self.busy)
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _stop_workers(self, busy: set[int]) -> None:
        """Idle workers are told to end and waited for; busy ones (an error ended the map while
        they worked) are terminated."""
        for w, (proc, conn) in enumerate(zip(self.procs, self.conns)):
            if w in busy:
                proc.terminate()
            else:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(None)
        for proc, conn in zip(self.procs, self.conns):
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()

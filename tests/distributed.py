"""Test machinery: run a function on W local gloo ranks in spawned processes and surface
their failures. Benchmarks use it too (`from tests.distributed import run_distributed`).

Every distributed test and benchmark uses `run_distributed(fn, world_size, *args)`: `fn(rank, world_size,
*args)` must be a module-level function; its return values (picklable) come back as a list
ordered by rank. With `init=False` the ranks get torchrun's environment variables but no
process group, for functions that set one up themselves. A rank that raises fails the call
with that rank's traceback, a rank that dies fails it at once, and one that hangs fails it
after `timeout` seconds.

The ranks are forked from a forkserver that has imported torch and the heavy libraries once
(about 0.2 s a call instead of 5-10 s of imports per rank). Each rank gets the caller's
environment, working directory and stdout/stderr as they are at the call (`monkeypatch.setenv`
reaches it, `capfd` reads it).
What only a new process reads (glibc's MALLOC_* variables, LD_PRELOAD) needs `fresh=True`:
the ranks are then spawned. On a machine with a CUDA device they are always spawned, as before:
a process forked after the CUDA driver was touched cannot use CUDA, and forking has not been
proven on a GPU.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "numpy", "torchvision", "sklearn.model_selection", "PIL.Image"]


def _context(fresh: bool):
    if fresh or torch.cuda.is_available():  # a fork after the CUDA driver is touched is unsafe: spawn
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts: the first call
    return ctx


def _write_where_the_caller_writes(pid: int) -> None:
    """Points this rank's fds 1 and 2 where the caller's point now: a forked rank inherits the
    forkserver's, from its start (pytest's capture of an earlier test). So `capfd` sees a rank's
    output, as it sees a spawned one's. Without /proc (not Linux) the server's stay."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd in (1, 2):
        try:
            target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        except OSError:
            continue
        os.dup2(target, fd)
        os.close(target)


def _worker(rank, world_size, port, fn, args, results, init, env, cwd, caller):
    try:
        if caller is not None:
            _write_where_the_caller_writes(caller)
        os.environ.clear()
        os.environ.update(env)  # the caller's, at the call (the forkserver's are from its start)
        os.chdir(cwd)
        torch.set_num_threads(1)
        # torchrun's own mark (dataset.shares.launch_rank)
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            TORCHELASTIC_RUN_ID="tests",
        )
        if init:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
        try:
            # serialised here: shared-memory tensors would die with this process
            buf = io.BytesIO()
            torch.save(fn(rank, world_size, *args), buf)
            results.put((rank, "ok", buf.getvalue()))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_distributed(
    fn, world_size: int, *args, timeout: float = 180.0, init: bool = True, fresh: bool = False
) -> list:
    ctx = _context(fresh)
    results = ctx.Queue()
    port = free_port()
    env, cwd, caller = dict(os.environ), os.getcwd(), None if fresh else os.getpid()
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, fn, args, results, init, env, cwd, caller), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out, errors = {}, []
    deadline = time.time() + timeout
    try:
        while len(out) < world_size and not errors:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive()]
                if dead:
                    time.sleep(1.0)  # a result may still be in flight from a rank that just exited
                    if results.empty():
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RuntimeError(
                            f"{fn.__name__} on {world_size} ranks: ranks exited without a "
                            f"result (exit codes {codes})"
                        ) from None
                if time.time() > deadline:
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks: no result after {timeout}s"
                    ) from None
                continue
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{value}")
            else:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError(f"{fn.__name__} failed on {world_size} ranks:\n" + "\n".join(errors))
    return [out[r] for r in range(world_size)]

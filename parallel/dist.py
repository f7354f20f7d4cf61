"""Distributed bootstrap: torchrun environment -> process group, device, rank-0 logging."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(timeout_min: float = 10.0, force_group: bool = False) -> DistInfo:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK; NCCL with CUDA, gloo otherwise.

    A plain `python` process (no torchrun variables) runs as world size 1 with no process
    group, unless `force_group` (the GPU tests: NCCL's code paths on one GPU). Each process
    takes the GPU of its LOCAL_RANK; more processes per node than GPUs are refused. Under
    NCCL the gloo side group for host-side checks (`cpu_group()`) is created and connected
    here, so a network set-up gloo cannot use fails now, naming GLOO_SOCKET_IFNAME, instead
    of at the first step. A rank that dies makes the others fail after `timeout_min`.
    """
    launch_problem = check_launch_variables(os.environ)
    if launch_problem:  # before any wait: a wrong launch would hang for `timeout_min`, then blame the network
        raise RuntimeError(launch_problem)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if torch.cuda.is_available():
        check_local_rank(local_rank, torch.cuda.device_count(), local_world_size)
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if (world_size > 1 or force_group) and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(minutes=timeout_min)
        problem = gloo_interface_problem(world_size, local_world_size)
        if problem:  # gloo would hang for `timeout` trying to connect: refuse at once
            raise RuntimeError(problem)
        # device_id binds NCCL to this rank's GPU at once (no lazy, guessed device)
        extra = {"device_id": device} if device.type == "cuda" else {}
        store = attempt_store(world_size, timeout)
        if store is not None:
            extra.update(store=store)
        with _naming_gloo_interface(backend == "gloo", "the gloo process group"):
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **extra)
        create_cpu_group(timeout=timeout)
    return DistInfo(rank, local_rank, world_size, device)


def check_launch_variables(env) -> str | None:
    """What is wrong with torchrun's variables in `env`, naming them; None when they fit:
    none set (one process), or WORLD_SIZE, RANK, MASTER_ADDR and MASTER_PORT consistent."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name in env and not env[name].strip().lstrip("-").isdigit():
            return f"{name}={env[name]} is not an integer"
    if "WORLD_SIZE" not in env:  # one process; a non-zero rank would write as if rank 0 existed elsewhere
        stray = " ".join(f"{n}={env[n]}" for n in ("RANK", "LOCAL_RANK") if int(env.get(n, "0")) != 0)
        if stray:
            return (
                f"{stray} is set but WORLD_SIZE is not: a leftover from another job's environment? unset it "
                f"for one process, or launch with torchrun --nproc_per_node N"
            )
        return None
    world_size, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
    if world_size < 1 or not 0 <= rank < world_size:
        return f"RANK={env.get('RANK', '0')} with WORLD_SIZE={world_size}: a rank must lie in [0, WORLD_SIZE)"
    if world_size > 1:
        if "RANK" not in env:
            return f"WORLD_SIZE={world_size} but RANK is not set: launch with torchrun --nproc_per_node {world_size}"
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            return (
                f"WORLD_SIZE={world_size} but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not "
                f"set, so the ranks cannot meet: launch with torchrun --nproc_per_node {world_size} (or unset "
                f"WORLD_SIZE for one process)"
            )
    return None


def attempt_store(world_size: int, timeout: datetime.timedelta, env=None):
    """The store for this attempt's process group, or None for torch's own (env://).

    torchrun's agent shares its rendezvous store with the workers, and that store outlives a
    restart (`--max-restarts`); torch no longer keys it per attempt, so restarted ranks read
    the dead ranks' entries: gloo connects to closed ports, NCCL takes the old unique id
    (pytorch#135712, #167288). On one node the restart count is the agent's own, the same for
    every rank: each attempt gets its own key prefix. Across nodes the counts can differ, so a
    shared store with restarts is refused (clearly, at start) in favour of torch's fix,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a fresh store per rendezvous round)."""
    env = os.environ if env is None else env
    if (
        env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0
    ):
        return None
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "torchrun --max-restarts across several nodes needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
            "in torchrun's environment (scripts/train_multinode.sh sets it): with the shared store a "
            "restarted job would connect to the previous attempt's ranks (pytorch#135712)"
        )
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world_size, is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"/shardface/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def check_local_rank(local_rank: int, gpus: int, local_world_size: int | None = None) -> None:
    """One process per GPU: more local processes than GPUs would put two ranks on one GPU.
    Every local rank refuses (LOCAL_WORLD_SIZE), not only the ones without a GPU, so none is
    left waiting for the others at the rendezvous."""
    if local_rank >= gpus:
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but this node has {gpus} visible GPU(s): start at most "
            f"{gpus} processes per node (torchrun --nproc_per_node {gpus}) or make more GPUs "
            f"visible (CUDA_VISIBLE_DEVICES)"
        )
    if local_world_size is not None and local_world_size > gpus:
        raise RuntimeError(
            f"LOCAL_WORLD_SIZE {local_world_size} processes on this node but it has {gpus} "
            f"visible GPU(s): two ranks would share a GPU; start at most {gpus} "
            f"(torchrun --nproc_per_node {gpus})"
        )


def _host_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "unresolvable"


def gloo_interface_problem(
    world_size: int,
    local_world_size: int,
    ifname: str | None = None,
    host_address: str | None = None,
    interfaces: list[str] | None = None,
) -> str | None:
    """Why gloo cannot connect these ranks, when that is known before trying, else None.

    gloo binds to GLOO_SOCKET_IFNAME, or else to the address the hostname resolves to; across
    nodes a loopback address (Debian's 127.0.1.1) or a missing interface hangs every rank
    for the whole timeout. The arguments default to this host's values.
    """
    ifname = os.environ.get("GLOO_SOCKET_IFNAME") if ifname is None else ifname
    if interfaces is None:
        interfaces = [name for _, name in socket.if_nameindex()]
    if ifname:
        missing = [name for name in ifname.split(",") if name not in interfaces]
        if missing:
            return (
                f"GLOO_SOCKET_IFNAME={ifname}: no interface '{missing[0]}' on this host "
                f"(interfaces: {', '.join(interfaces)})"
            )
        return None
    host_address = _host_address() if host_address is None else host_address
    multi_node = world_size > local_world_size
    if multi_node and (host_address.startswith("127.") or host_address in ("::1", "unresolvable")):
        return (
            f"{world_size} ranks on several nodes, but this host's name {socket.gethostname()} resolves to "
            f"{host_address}, which other nodes cannot reach: set GLOO_SOCKET_IFNAME to the interface "
            f"that connects the nodes (interfaces: {', '.join(interfaces)})"
        )
    return None


@contextlib.contextmanager
def _naming_gloo_interface(uses_gloo: bool, what: str):
    """Re-raise gloo's connection errors with the setting that fixes them."""
    try:
        yield
    except Exception as exc:
        if not uses_gloo:
            raise
        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        chosen = (
            f"GLOO_SOCKET_IFNAME={ifname}"
            if ifname
            else f"GLOO_SOCKET_IFNAME unset, so the hostname's address {_host_address()}"
        )
        raise RuntimeError(
            f"{what} could not connect the ranks ({chosen}): {type(exc).__name__}: {exc}. "
            f"Set GLOO_SOCKET_IFNAME to the network interface that reaches the other "
            f"nodes (e.g. GLOO_SOCKET_IFNAME=eth0)"
        ) from exc


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier(group=None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group)


def from_rank0(value):
    """Rank 0's `value` (any picklable object), on every rank: collective over the CPU group."""
    if get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=cpu_group())
    return box[0]


def from_every_rank(value) -> list:
    """Every rank's `value` (picklable), in rank order, on every rank: collective over the CPU
    group. It doubles as a barrier that tells each rank how the others fared."""
    if get_world_size() == 1:
        return [value]
    out = [None] * get_world_size()
    dist.all_gather_object(out, value, group=cpu_group())
    return out


_CPU_GROUPS: dict = {}  # id(group) (None: the default group) -> its gloo side group


def new_gloo_group(ranks: list[int] | None = None, timeout: datetime.timedelta | None = None):
    """A gloo group over `ranks` (all when None), connected and checked with one all-reduce
    now; a failure names GLOO_SOCKET_IFNAME. Collective over the whole default group."""
    with _naming_gloo_interface(True, "the gloo side group"):
        group = dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
        if ranks is None or dist.get_rank() in ranks:
            dist.all_reduce(torch.zeros(1), group=group)
    return group


def create_cpu_group(group=None, timeout: datetime.timedelta | None = None):
    """Make `cpu_group(group)` available: under gloo the group itself, otherwise a new gloo
    group over the same ranks. Collective over the default group, at set-up (init_distributed
    does it for the default group); never on a training step."""
    if not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return group
    key = id(group) if group is not None else None
    if key not in _CPU_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _CPU_GROUPS[key] = new_gloo_group(ranks, timeout)
    return _CPU_GROUPS[key]


def cpu_group(group=None):
    """A gloo group over the same ranks, for host-side checks without a device sync.

    Under gloo this is the group itself; otherwise the side group `create_cpu_group` made at
    set-up (init_distributed makes the default group's).
    """
    if not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return group
    key = id(group) if group is not None else None
    if key not in _CPU_GROUPS:
        raise RuntimeError(
            f"no gloo side group for the {dist.get_backend(group)} group "
            f"{'(default)' if group is None else dist.get_process_group_ranks(group)}: "
            f"create it at set-up with parallel.dist.create_cpu_group(group) on every rank "
            f"(init_distributed does so for the default group)"
        )
    return _CPU_GROUPS[key]


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


class _HeldFileHandler(logging.Handler):
    """A log file that is not created until `open_log_file()`: its records wait in memory, so a
    run refused at start leaves no log behind, and an accepted one keeps every line."""

    def __init__(self, path: str):
        super().__init__()
        self.path, self.records, self.file = path, [], None

    def emit(self, record: logging.LogRecord) -> None:
        if self.file is None:
            self.records.append(record)
        else:
            self.file.emit(record)

    def open(self) -> None:
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.file = logging.FileHandler(self.path)
            self.file.setFormatter(self.formatter)
            for record in self.records:
                self.file.emit(record)
            self.records = []

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        super().close()


def open_log_file() -> None:
    """Create the log file `setup_logging(..., held=True)` holds back, with the lines so far."""
    for handler in logging.getLogger("shardface").handlers:
        if isinstance(handler, _HeldFileHandler):
            handler.open()


def setup_logging(
    rank: int, log_file: str | None = None, level: int = logging.INFO, held: bool = False
) -> logging.Logger:
    """Rank 0 logs progress to stdout (and `log_file`; with `held`, only from `open_log_file()`
    on, the lines before kept until then); other ranks only report errors."""
    logger = logging.getLogger("shardface")
    for handler in logger.handlers:
        handler.close()
    logger.handlers.clear()
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file and rank == 0 and held:
        handlers.append(_HeldFileHandler(log_file))
    elif log_file and rank == 0:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(fmt)
        handler.addFilter(_RankFilter(rank))
        logger.addHandler(handler)
    return logger

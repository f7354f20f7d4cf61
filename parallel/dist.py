"""Distributed bootstrap: torchrun environment -> process group, device, rank-0 logging."""
from __future__ import annotations

import datetime
import logging
import os
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


def init_distributed(timeout_min: float = 10.0) -> DistInfo:
    """Read torchrun's RANK/WORLD_SIZE/LOCAL_RANK; NCCL with CUDA, gloo otherwise.

    A plain `python` process (no torchrun variables) runs as world size 1 with no process
    group. A rank that dies makes the others fail after `timeout_min` instead of hanging.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        check_local_rank(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        # device_id binds NCCL to this rank's GPU at once (no lazy, guessed device)
        extra = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(minutes=timeout_min), **extra)
    return DistInfo(rank, local_rank, world_size, device)


def check_local_rank(local_rank: int, gpus: int) -> None:
    """One process per GPU: more local processes than GPUs would put two ranks on one GPU."""
    if local_rank >= gpus:
        raise RuntimeError(f"LOCAL_RANK {local_rank} but this node has {gpus} visible GPU(s): start at most "
                           f"{gpus} processes per node (torchrun --nproc_per_node {gpus}) or make more GPUs "
                           f"visible (CUDA_VISIBLE_DEVICES)")


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def barrier(group=None) -> None:
    if get_world_size(group) > 1:
        dist.barrier(group)


_CPU_GROUPS: dict = {}


def cpu_group(group=None):
    """A gloo group over the same ranks, for host-side metadata checks without a device sync.

    Under gloo this is the group itself. Must be first called on every rank of `group`.
    """
    if not dist.is_initialized() or dist.get_backend(group) == "gloo":
        return group
    key = id(group)
    if key not in _CPU_GROUPS:
        ranks = None if group is None else dist.get_process_group_ranks(group)
        _CPU_GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo")
    return _CPU_GROUPS[key]


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


def setup_logging(rank: int, log_file: str | None = None, level: int = logging.INFO) -> logging.Logger:
    """Rank 0 logs progress to stdout (and `log_file`); other ranks only report errors."""
    logger = logging.getLogger("shardface")
    logger.handlers.clear()
    logger.setLevel(level)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S")
    handlers = [logging.StreamHandler(sys.stdout)]
    if log_file and rank == 0:
        os.makedirs(os.path.dirname(log_file) or ".", exist_ok=True)
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(fmt)
        handler.addFilter(_RankFilter(rank))
        logger.addHandler(handler)
    return logger

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fails_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("rank one broke")
    return rank


def test_runs_function_on_every_rank_and_returns_in_rank_order():
    assert run_distributed(_sum_of_ranks, 3) == [6.0, 6.0, 6.0]


def test_failure_on_one_rank_surfaces_its_traceback():
    with pytest.raises(AssertionError, match="rank one broke"):
        run_distributed(_fails_on_rank_one, 2, timeout=60)


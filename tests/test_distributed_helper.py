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


def test_more_local_processes_than_gpus_is_refused_by_name():
    import pytest

    from parallel.dist import check_local_rank
    check_local_rank(7, 8)
    with pytest.raises(RuntimeError, match="LOCAL_RANK 8 but this node has 8 visible GPU"):
        check_local_rank(8, 8)


def test_only_this_ranks_cuda_generator_state_is_restored():
    """1x8 -> 2x4 GPUs: a rank restores the one state it saved, never a list by position."""
    import torch

    from utils.checkpoint import cuda_state_to_restore
    own = torch.arange(8, dtype=torch.uint8)
    assert torch.equal(cuda_state_to_restore({"cuda": own}), own)
    assert cuda_state_to_restore({"cuda": [own, own]}) is None  # older per-node lists
    assert cuda_state_to_restore({}) is None                     # written on a CPU host

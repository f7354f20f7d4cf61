import os

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


def _where(rank, world_size):
    return os.environ.get("SHARDFACE_TEST_MARK"), os.getcwd(), os.getpid()


@pytest.mark.parametrize("fresh", [False, True])
def test_ranks_see_the_callers_environment_and_directory_at_the_call(fresh, tmp_path, monkeypatch):
    """Forked ranks come from a server started earlier, with its own environment and directory:
    the caller's, as they are now, must reach them as they reach spawned ones."""
    run_distributed(_where, 1)  # the forkserver is running before the change below
    monkeypatch.setenv("SHARDFACE_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_distributed(_where, 2, fresh=fresh)
    assert [r[:2] for r in ranks] == [("set after the server started", str(tmp_path))] * 2
    assert ranks[0][2] != ranks[1][2]

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
    os.write(1, f"rank {rank} to stdout\n".encode())  # one write each: lines of two ranks never interleave
    os.write(2, f"rank {rank} to stderr\n".encode())
    return os.environ.get("SHARDFACE_TEST_MARK"), os.getcwd(), os.getpid()


@pytest.fixture(scope="module")
def forkserver_started():
    """The forkserver running, started outside the test below (with other fds, as for every
    test but the session's first distributed one)."""
    run_distributed(_where, 1)


@pytest.mark.parametrize("fresh", [False, True])
def test_ranks_see_the_callers_environment_directory_and_output_at_the_call(
    fresh, forkserver_started, tmp_path, monkeypatch, capfd
):
    """Forked ranks come from a server started earlier, with its own environment, directory and
    stdout/stderr: the caller's, as they are now, must reach them as they reach spawned ones."""
    monkeypatch.setenv("SHARDFACE_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    ranks = run_distributed(_where, 2, fresh=fresh)
    assert [r[:2] for r in ranks] == [("set after the server started", str(tmp_path))] * 2
    assert ranks[0][2] != ranks[1][2]
    out, err = capfd.readouterr()
    assert {"rank 0 to stdout", "rank 1 to stdout"} <= set(out.splitlines()), out
    assert {"rank 0 to stderr", "rank 1 to stderr"} <= set(err.splitlines()), err

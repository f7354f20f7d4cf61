"""Distributed set-up: one process per GPU, the gloo side group connected at start, and
network mistakes named (GLOO_SOCKET_IFNAME) before any rank waits for the timeout."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from shardface.parallel.dist import (
    attempt_store,
    check_local_rank,
    cpu_group,
    gloo_interface_problem,
    init_distributed,
    new_gloo_group,
)
from tests.distributed import run_distributed


def test_more_local_processes_than_gpus_is_refused_on_every_local_rank():
    check_local_rank(7, 8, local_world_size=8)
    with pytest.raises(RuntimeError, match="LOCAL_RANK 8 but this node has 8 visible GPU"):
        check_local_rank(8, 8)
    # rank 0 has a GPU, but its neighbour would share it: rank 0 refuses too
    with pytest.raises(
        RuntimeError, match=r"LOCAL_WORLD_SIZE 3 processes on this node but it has 2 visible GPU"
    ):
        check_local_rank(0, 2, local_world_size=3)


def test_gloo_interface_problems_are_named_before_connecting():
    ifs = ["lo", "eth0", "ib0"]
    problem = gloo_interface_problem(16, 8, ifname="", host_address="127.0.1.1", interfaces=ifs)
    assert "GLOO_SOCKET_IFNAME" in problem and "127.0.1.1" in problem and "eth0" in problem
    # one node
    assert gloo_interface_problem(8, 8, ifname="", host_address="127.0.1.1", interfaces=ifs) is None
    assert gloo_interface_problem(16, 8, ifname="", host_address="10.0.0.5", interfaces=ifs) is None
    assert gloo_interface_problem(16, 8, ifname="eth0,ib0", interfaces=ifs) is None
    missing = gloo_interface_problem(16, 8, ifname="eth1", interfaces=ifs)
    assert missing.startswith("GLOO_SOCKET_IFNAME=eth1: no interface 'eth1'")


def _cpu_only():
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before CUDA is initialised: the CPU/gloo path


def _init_and_reduce(rank, world_size):
    _cpu_only()
    info = init_distributed(timeout_min=1)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=cpu_group())
    return info.rank, info.local_rank, info.world_size, str(info.device), dist.is_initialized(), t.item()


def test_init_distributed_reads_torchrun_environment_and_cpu_group_reduces():
    out = run_distributed(_init_and_reduce, 2, init=False, timeout=120)
    assert out == [(0, 0, 2, "cpu", True, 3.0), (1, 1, 2, "cpu", True, 3.0)]


def _forced_single_rank(rank, world_size):
    _cpu_only()
    info = init_distributed(timeout_min=1, force_group=True)
    return info.world_size, dist.is_initialized(), dist.get_world_size()


def test_force_group_creates_a_process_group_at_world_size_one():
    assert run_distributed(_forced_single_rank, 1, init=False, timeout=120) == [(1, True, 1)]


def _bad_interface_at_init(rank, world_size):
    _cpu_only()
    os.environ["GLOO_SOCKET_IFNAME"] = "nosuchif0"
    try:
        init_distributed(timeout_min=1)
    except RuntimeError as exc:
        return str(exc), dist.is_initialized()
    return "no error", dist.is_initialized()


def test_missing_gloo_interface_fails_at_start_on_every_rank():
    for message, initialised in run_distributed(_bad_interface_at_init, 2, init=False, timeout=120):
        assert (
            message.startswith("GLOO_SOCKET_IFNAME=nosuchif0: no interface 'nosuchif0'") and not initialised
        )


def _side_group(rank, world_size):
    group = new_gloo_group()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    os.environ["GLOO_SOCKET_IFNAME"] = "nosuchif0"  # gloo's own error, past our pre-check
    try:
        new_gloo_group()
    except RuntimeError as exc:
        return t.item(), str(exc)
    return t.item(), "no error"


def test_gloo_side_group_connects_at_creation_and_its_failure_names_gloo_socket_ifname():
    for total, message in run_distributed(_side_group, 2, timeout=120):
        assert total == 3.0
        assert "the gloo side group could not connect the ranks (GLOO_SOCKET_IFNAME=nosuchif0)" in message


def test_each_torchrun_attempt_gets_its_own_store_keys_on_one_node():
    """torchrun's shared store outlives a restart: a restarted rank must not see the previous
    attempt's entries (gloo would connect to dead ranks' ports)."""
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
    env = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(server.port),
    }
    first = attempt_store(2, timeout, dict(env, TORCHELASTIC_RESTART_COUNT="0"))
    first.set("rank_0", "old address")
    again = attempt_store(2, timeout, dict(env, TORCHELASTIC_RESTART_COUNT="0"))
    restarted = attempt_store(2, timeout, dict(env, TORCHELASTIC_RESTART_COUNT="1"))
    assert again.check(["rank_0"]) and not restarted.check(["rank_0"])
    assert attempt_store(2, timeout, dict(env, TORCHELASTIC_MAX_RESTARTS="0")) is None  # nothing to restart
    assert attempt_store(2, timeout, {}) is None  # not under torchrun's agent store: torch's env://
    with pytest.raises(RuntimeError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"):
        attempt_store(2, timeout, dict(env, GROUP_WORLD_SIZE="2"))


def _ddp_under_detail(rank, world_size):
    from torch import nn

    from shardface.parallel.ddp import DDPOptimizer

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()
    init_distributed(timeout_min=1)
    try:
        DDPOptimizer(nn.Linear(4, 4), torch.optim.SGD, lr=0.1)
    except RuntimeError as exc:
        return str(exc)
    return "built"


def test_ddp_under_detail_debugging_on_gloo_is_refused_not_a_segfault():
    # torch 2.15's DDP constructor dies with SIGSEGV there (its logger): every rank says why instead
    for message in run_distributed(_ddp_under_detail, 2, init=False, timeout=120):
        assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message and "--zero true" in message, message


@pytest.mark.parametrize(
    "env,named",
    [
        ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
        (
            {"RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "x"},
            "RANK=1 LOCAL_RANK=1 is set but WORLD_SIZE is not",
        ),
        ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 but RANK is not set"),
        ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 but MASTER_ADDR and MASTER_PORT are not set"),
        (
            {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1"},
            "WORLD_SIZE=2 but MASTER_PORT is not set",
        ),
        (
            {"WORLD_SIZE": "2", "RANK": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
            "RANK=2 with WORLD_SIZE=2",
        ),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE=two is not an integer"),
    ],
)
def test_wrong_launch_variables_are_named_at_once_before_any_wait(monkeypatch, env, named):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(RuntimeError, match=named.replace("(", r"\(")) as refused:
        init_distributed(timeout_min=10)
    assert "GLOO_SOCKET_IFNAME" not in str(refused.value) and not dist.is_initialized()


def test_one_process_with_harmless_leftovers_runs_alone(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "somewhere")
    assert init_distributed().world_size == 1 and not dist.is_initialized()


def _agree(rank, world_size):
    from shardface.errors import ConfigError
    from shardface.parallel.agreement import check_same_on_every_rank

    try:
        check_same_on_every_rank(
            {"lr": 0.1 if rank == 0 else 0.2, "seed": 7, "wandb_key": f"key{rank}"},
            "the config",
            secret=["wandb_key"],
        )
    except ConfigError as exc:
        return str(exc)
    return None


def test_config_agreement_refuses_on_every_rank_naming_keys_values_and_ranks():
    messages = run_distributed(_agree, 2, timeout=120)
    assert len(set(messages)) == 1 and messages[0].startswith(
        "the config differs between the ranks of this job: lr 0.1 on rank 0, 0.2 on rank 1; wandb_key <hidden> on "
        "rank 0, <hidden> on rank 1;"
    ), messages
    assert "key0" not in messages[0]

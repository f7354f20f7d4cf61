"""The capacity planner's head and ZeRO-2 figures against what the code really holds."""

import pytest
import torch

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.losses import CosFace
from shardface.parallel import Zero2Optimizer
from shardface.planner import backbone_counts, head_memory, zero_memory
from tests.distributed import run_distributed

C, D, B_LOCAL = 60_000, 128, 64


def _rss_status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _head_peak(rank, world_size, fused):
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    head = PartialFC(
        CosFace(s=32.0, m=0.3), D, C, chunk_size=4096, row_block=32, validate=False, fused_optimizer=fused
    )
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9)
    emb = torch.randn(B_LOCAL, D, requires_grad=True)
    labels = torch.randint(0, C, (B_LOCAL,))
    for step in range(2):
        if step == 1:  # steady state: weight and momentum exist, the gradient does not
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            resting = _rss_status("VmRSS")
        head(emb, labels).backward()
        opt.step()
        opt.zero_grad()
        emb.grad = None
    held = head.weight.numel() * 4 * 2  # weight + momentum, resident before the measured step
    return _rss_status("VmHWM") - resting + held


@pytest.mark.parametrize("fused", [pytest.param(False, marks=pytest.mark.slow), True])
def test_planner_head_memory_matches_the_measured_peak(fused, monkeypatch):
    # exact resident-set peaks: large blocks straight from mmap, returned when freed
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    planned = sum(head_memory(C, 2, B_LOCAL, D, chunk=4096, row_block=32, fused=fused).values())
    measured = []
    for _ in range(2):  # a resident-set peak now and then comes out a few per cent low: measured once more
        measured.append(
            max(run_distributed(_head_peak, 2, fused, timeout=300, fresh=True))
        )  # malloc reads it at exec
        if abs(planned - measured[-1]) < 0.10 * measured[-1]:
            break
    assert abs(planned - measured[-1]) < 0.10 * measured[-1], (planned, measured)


def _zero_bytes(rank, world_size, optimizer):
    from shardface.backbones import get_model

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = get_model("r18", num_features=128)
    cls, kw = (torch.optim.SGD, {"momentum": 0.9}) if optimizer == "sgd" else (torch.optim.AdamW, {})
    opt = Zero2Optimizer(model, cls, lr=0.01, exchange="collective", **kw)  # the NCCL algorithm
    for _ in range(2):
        model(torch.randn(2, 3, 112, 112)).sum().backward()
        opt.step()
        opt.zero_grad()
    state = sum(
        v.numel() * v.element_size()
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.dim() > 0
    )
    grad = sum(g.grad_shard.numel() * 4 for g in opt.groups)
    buckets = sum(g.grad_buffer.numel() * g.grad_buffer.element_size() for g in opt.groups)
    return state, grad, buckets


@pytest.mark.parametrize("optimizer", ["sgd", pytest.param("adamw", marks=pytest.mark.slow)])
def test_planner_zero2_shards_and_gradient_buckets_match_the_optimizer(optimizer):
    from shardface.backbones import get_model

    params, _ = backbone_counts("r18", 128, 2)
    assert params == sum(p.numel() for p in get_model("r18", num_features=128).parameters())
    planned = zero_memory(params, 2, optimizer, 0.9)
    for state, grad, scratch in run_distributed(_zero_bytes, 2, optimizer, timeout=300):
        assert abs(planned["zero optimizer state shard"] - state) < 0.10 * state
        assert abs(planned["zero gradient shard"] - grad) < 0.10 * grad
        assert abs(planned["zero gradient buckets"] - scratch) < 0.10 * scratch, (planned, scratch)


def _empty_shard_rank(rank, world_size):
    from shardface.configs import ConfigError

    try:
        PartialFC(CosFace(), 8, world_size - 1)
    except ConfigError as exc:
        return str(exc)
    return "built"


@pytest.mark.slow
def test_more_ranks_than_classes_is_refused_at_start_on_every_rank_and_by_the_plan():
    import subprocess
    import sys

    messages = run_distributed(_empty_shard_rank, 2, timeout=120)
    assert (
        messages
        == [
            "config num_classes = 1 is fewer than the world size 2: every rank needs at least one "
            "class of the head; run at most 1 ranks"
        ]
        * 2
    )
    plan = subprocess.run(
        [sys.executable, "-m", "scripts.plan", "configs/demo.py", "--gpus", "3", "--num_classes", "2"],
        capture_output=True,
        text=True,
    )
    assert plan.returncode != 0 and "num_classes = 2 is fewer than the world size 3" in plan.stderr
    zero = subprocess.run(
        [sys.executable, "-m", "scripts.plan", "configs/demo.py", "--gpus", "0"],
        capture_output=True,
        text=True,
    )
    assert zero.returncode == 2 and "--gpus 0: a job needs at least one rank" in zero.stderr
    assert "ZeroDivisionError" not in zero.stderr


def test_channels_last_scratch_is_planned_per_sample_only_when_on():
    """The measured GPU cost of channels-last batches (planner.CHANNELS_LAST_SCRATCH_PER_SAMPLE)
    is one part of the plan, proportional to the batch, and absent in NCHW; nothing else moves."""
    from shardface.configs import get_config
    from shardface.planner import CHANNELS_LAST_SCRATCH_PER_SAMPLE, plan

    part = "backbone channels-last scratch"
    on = plan(get_config("configs/demo.py", ["--batch_size", "64"]), 2)
    doubled = plan(get_config("configs/demo.py", ["--batch_size", "128"]), 2)
    off = plan(get_config("configs/demo.py", ["--batch_size", "64", "--channels_last", "false"]), 2)
    assert (
        on.parts[part] == 64 * CHANNELS_LAST_SCRATCH_PER_SAMPLE and doubled.parts[part] == 2 * on.parts[part]
    )
    assert part not in off.parts and on.total - off.total == on.parts[part]


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "1.5"])
def test_plan_refuses_a_gpu_memory_that_is_not_a_finite_size_above_the_reserve_in_one_line(value, capsys):
    """--gpu_mem_gb nan failed at int(nan) inside max_classes; -5 planned for an impossible GPU."""
    from shardface.scripts.plan import main

    assert main(["configs/demo.py", "--gpus", "2", "--gpu_mem_gb", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"error: --gpu_mem_gb {float(value)}: expected the GPU's memory"
    )


def test_plan_of_a_real_gpu_still_answers(capsys):
    from shardface.scripts.plan import main

    assert main(["configs/demo.py", "--gpus", "2", "--gpu_mem_gb", "16"]) == 0
    assert "budget 14.5 GB" in capsys.readouterr().out

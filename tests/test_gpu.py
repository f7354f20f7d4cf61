"""The GPU kit (`make test-gpu`, one GPU): what no CPU run can show.

- train.py on the GPU in fp32, fp16 and bf16, with ZeRO-2 and with DDP, and every file the
  run wrote opened on a CPU-only host (no `map_location`; every saved tensor on the CPU);
- NCCL at world size 1 with the multi-rank code paths forced on, under
  TORCH_DISTRIBUTED_DEBUG=DETAIL: ZeRO-2's collective exchange, DDP, the head's autograd
  all-gather, the gloo side group; ZeRO-2 with forward/backward on a side stream gives the
  same gradients and weights bit for bit;
- the head against an fp64 full softmax: full fp32, TF32 (torch's global setting and the
  head's `precision="tf32"`) and bf16 logits;
- no host synchronisation in the head under `torch.cuda.set_sync_debug_mode("error")`, and
  its forward and backward captured in a CUDA graph replay the eager step's gradients.

Each test takes the device it runs on. The cuda cases are marked `gpu` (skipped without CUDA,
selected by `make test-gpu`); the cheap cpu cases of the same bodies run in `make test`, so the
kit cannot rot where no GPU has run it (it had: stale imports and expectations that only a GPU
run would have shown). A cpu case proves the harness, not the GPU.
"""

import contextlib
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.losses import CombinedMarginLoss
from tests.collective_log import recording
from tests.devices import CUDA, device_of, env_for
from tests.distributed import run_distributed
from tests.fp64_head import M2, S, head_errors_against_fp64
from tests.train_runs import train_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_STEPS = 6


# ----- train.py on the device, its files opened on a CPU-only host -------------------------------

_OPEN_ON_CPU = """
import glob, os, sys
import torch
assert not torch.cuda.is_available()
out, argv = sys.argv[1], sys.argv[2:]

def devices(obj):
    if torch.is_tensor(obj):
        return {obj.device.type}
    if isinstance(obj, dict):
        return set().union(*(devices(v) for v in obj.values())) if obj else set()
    if isinstance(obj, (list, tuple)):
        return set().union(*(devices(v) for v in obj)) if obj else set()
    return set()

paths = sorted(glob.glob(os.path.join(out, "**", "*.pt"), recursive=True))
assert paths, "no .pt files in " + out
for path in paths:
    found = devices(torch.load(path, weights_only=True))  # no map_location, as a CPU-only host loads
    assert found <= {"cpu"}, f"{path} holds tensors on {sorted(found)}"
from shardface.builders import build_backbone, build_data_parallel, build_head, build_head_optimizer
from shardface.configs import get_config
from shardface.checkpoint.load import load_checkpoint
cfg = get_config(argv[0], argv[1:])
backbone, head = build_backbone(cfg), build_head(cfg)
_, backbone_opt = build_data_parallel(cfg, backbone)
state, _ = load_checkpoint(out, backbone=backbone, backbone_opt=backbone_opt, head=head,
                           head_opt=build_head_optimizer(cfg, head), config=cfg)
print("opened", len(paths), "files; step", state.step)
"""

# cuda: every precision with both data-parallel optimizers, on an IResNet (BatchNorm, PReLU,
# autocast), fp16 and bf16 with the batch in channels-last memory; cpu: one case, the demo's tiny CNN
TRAIN_CASES = [
    pytest.param("cuda", p, z, marks=pytest.mark.gpu, id=f"cuda-{p}-{'zero2' if z else 'ddp'}")
    for p in ("fp32", "fp16", "bf16")
    for z in (True, False)
] + [pytest.param("cpu", "fp32", True, id="cpu-fp32-zero2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kind,precision,zero", TRAIN_CASES)
def test_train_runs_on_the_device_and_its_files_open_on_a_cpu_only_host(
    drawn_faces, tmp_path, kind, precision, zero
):
    out = str(tmp_path / "run")
    # NHWC on tensor cores
    argv = train_argv(
        drawn_faces,
        out,
        "--max_steps",
        str(SMOKE_STEPS),
        "--checkpoint_interval",
        "3",
        "--num_workers",
        "2",
        "--network",
        "r18" if kind == "cuda" else "tiny",
        "--zero",
        str(zero).lower(),
        "--fp16",
        str(precision == "fp16").lower(),
        "--bf16",
        str(precision == "bf16").lower(),
        "--channels_last",
        str(precision != "fp32").lower(),
    )
    done = subprocess.run(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        env=env_for(kind),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = open(os.path.join(out, "training.log")).read()
    assert f"(world size 1, {kind}" in log  # it trained on that device
    losses = re.findall(r"loss ([0-9.]+|nan|inf) ", log)
    assert len(losses) == SMOKE_STEPS and all(v not in ("nan", "inf") for v in losses), losses
    assert bool(re.search(r"loss [0-9.]+ .*scale \d+", log)) == (precision == "fp16")  # the loss scaler ran
    from shardface.checkpoint.folders import resolve_checkpoint

    assert resolve_checkpoint(out).endswith(f"checkpoint-{SMOKE_STEPS:08d}")
    assert os.path.isfile(os.path.join(out, "model.pt"))

    opened = subprocess.run(
        [sys.executable, "-c", _OPEN_ON_CPU, out, *argv],
        cwd=ROOT,
        env=env_for("cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert opened.returncode == 0, opened.stderr[-3000:]
    assert f"step {SMOKE_STEPS}" in opened.stdout, opened.stdout


# ----- the multi-rank code paths at world size 1 (NCCL on a GPU, gloo on the CPU) -----------------


def _small_model(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.PReLU(256), nn.Linear(256, 256), nn.PReLU(256), nn.Linear(256, 32)
    ).to(device)


def _plain_sgd_model(device, x) -> nn.Module:
    """The small model after two steps of the plain torch optimizer: what ZeRO-2 and DDP must equal."""
    model = _small_model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model


def _max_diff(params, reference: nn.Module) -> float:
    return max((a - b).abs().max().item() for a, b in zip(params, reference.parameters()))


def _zero2_steps(device, x, side_stream: bool):
    """Two ZeRO-2 steps (collective exchange, small buckets, two in flight), forward/backward
    on the current or a side stream: gradient shards after each backward and the weights."""
    from shardface.parallel import Zero2Optimizer

    model = _small_model(device)
    opt = Zero2Optimizer(
        model,
        torch.optim.SGD,
        lr=0.1,
        momentum=0.9,
        weight_decay=5e-4,
        bucket_cap_mb=0.1,
        max_inflight_buckets=2,
        exchange="collective",
    )
    assert len(opt.groups[0].buckets) > 2  # several buckets, so some are in flight together
    grads = []
    for _ in range(2):
        stream = torch.cuda.Stream() if side_stream else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            model(x).square().mean().backward()
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)
        grads.append([g.clone() for g in opt.grad_shards()])
        opt.step()
        opt.zero_grad()
    opt.wait_params()
    params = [p.detach().clone() for p in model.parameters()]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return grads, params


def _world_one(rank, world_size):
    from shardface.parallel.collectives import _AllGatherRows
    from shardface.parallel.dist import cpu_group, init_distributed

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch read the variable at import, before this worker set it
    # cuBLAS is deterministic across streams only with a fixed workspace (set before CUDA starts)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    info = init_distributed(timeout_min=2, force_group=True)
    device = info.device
    report = {
        "backend": dist.get_backend(),
        "device": str(device),
        "debug": str(dist.get_debug_level()),
        "side_backend": dist.get_backend(cpu_group()),
    }
    flag = torch.ones(1)
    dist.all_reduce(flag, group=cpu_group())
    report["side_sum"] = flag.item()

    x = torch.randn(48, 64, device=device)
    with recording() as (log, p2p):
        grads, params = _zero2_steps(device, x, side_stream=False)
        emb = torch.randn(8, 16, device=device, requires_grad=True)
        gathered = _AllGatherRows.apply(emb, None, 2.0)  # the head's embedding all-gather, forced
        gathered.backward(torch.ones_like(gathered))
        row_max = torch.randn(8, device=device)
        reduced = row_max.clone()
        dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
    report["calls"] = sorted({entry[0] for entry in log})
    report["p2p"] = len(p2p)
    report["gather_exact"] = bool(
        torch.equal(gathered, emb) and torch.equal(emb.grad, torch.full_like(emb, 2.0))
    )
    report["max_exact"] = bool(torch.equal(reduced, row_max))

    # ZeRO-2 (collective exchange) equals the plain optimizer
    report["zero_vs_plain"] = _max_diff(params, _plain_sgd_model(device, x))

    if device.type == "cuda":  # forward/backward on a side stream: the same values, bit for bit
        side_grads, side_params = _zero2_steps(device, x, side_stream=True)
        report["side_stream_bitwise"] = all(
            torch.equal(a, b) for ga, gb in zip(grads, side_grads) for a, b in zip(ga, gb)
        ) and all(torch.equal(a, b) for a, b in zip(params, side_params))
        torch.cuda.synchronize()
    return report


def _ddp_world_one(rank, world_size):
    """DDP through a world-size-1 group equals the plain optimizer. Its own process, without
    TORCH_DISTRIBUTED_DEBUG=DETAIL: torch 2.15's DDP constructor crashes (SIGSEGV, in its
    construction-time logger) on a process group made under DETAIL."""
    from shardface.parallel.ddp import DDPOptimizer
    from shardface.parallel.dist import init_distributed

    device = init_distributed(timeout_min=2, force_group=True).device
    x = torch.randn(48, 64, device=device)
    model = _small_model(device)
    ddp_opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
    ddp_opt.ddp = nn.parallel.DistributedDataParallel(  # DDPOptimizer skips the wrapper at W=1
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )
    for _ in range(2):
        ddp_opt.ddp(x).square().mean().backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    return {
        "backend": dist.get_backend(),
        "ddp_vs_plain": _max_diff(model.parameters(), _plain_sgd_model(device, x)),
    }


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_world_size_one_group_runs_the_multi_rank_paths(kind, monkeypatch):
    if kind == "cpu":
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # spawned ranks inherit it
    (r,) = run_distributed(_world_one, 1, init=False, timeout=300)
    (ddp,) = run_distributed(_ddp_world_one, 1, init=False, timeout=300)
    assert r["backend"] == ("nccl" if kind == "cuda" else "gloo") and r["device"].startswith(kind), r
    assert r["debug"].endswith("DETAIL") and r["side_backend"] == "gloo" and r["side_sum"] == 1.0, r
    # the collectives the multi-rank code issues did run through the group
    calls = set(r["calls"])
    assert (
        "all_reduce" in calls
        and {"reduce_scatter_tensor", "reduce_scatter_single"} & calls
        and {"all_gather_into_tensor", "all_gather_single"} & calls
        and "reduce" not in calls
    ), calls
    assert r["p2p"] == 0
    assert r["gather_exact"] and r["max_exact"]
    assert r["zero_vs_plain"] < 1e-6, r
    assert ddp["backend"] == r["backend"] and ddp["ddp_vs_plain"] < 1e-6, ddp
    assert r.get("side_stream_bitwise", kind == "cpu"), r


# ----- the head on the device --------------------------------------------------------------------


def _fp64_errors(kind: str, **kw) -> dict:
    if kind == "cpu":  # the same check at a size two CPU cores do in a second
        kw.update(classes=3000, batch=128, dim=128)
    return head_errors_against_fp64(device_of(kind), **kw)


@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_head_matches_fp64_full_softmax_in_fp32(kind, chunk):
    err = _fp64_errors(kind, tf32=False, chunk=chunk)
    assert err["loss"] < 1e-6 and err["grad_emb"] < 1e-5 and err["grad_weight"] < 1e-5, err


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [None, 4096])
@pytest.mark.parametrize("how", ["global", "head_precision"])
def test_head_with_tf32_stays_close_to_fp64_full_softmax(how, chunk):
    err = _fp64_errors(
        "cuda", tf32=how == "global", precision="tf32" if how == "head_precision" else "fp32", chunk=chunk
    )
    assert err["loss"] < 1e-4 and err["grad_emb"] < 5e-3 and err["grad_weight"] < 5e-3, err
    assert not torch.backends.cuda.matmul.allow_tf32  # both restore torch's default afterwards


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_head_with_bf16_logits_stays_close_to_fp64_full_softmax(kind):
    err = _fp64_errors(kind, tf32=False, precision="bf16", chunk=4096)
    assert err["loss"] < 2e-2 and err["grad_emb"] < 2e-2 and err["grad_weight"] < 2e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("sample_rate", [1.0, 0.3])
def test_head_forward_and_backward_never_synchronise_the_host(chunk, sample_rate, fused):
    device = device_of("cuda")
    torch.manual_seed(0)
    head = PartialFC(
        CombinedMarginLoss(S, 1.0, M2, 0.0),
        128,
        8000,
        sample_rate,
        chunk_size=chunk,
        validate=False,
        fused_optimizer=fused,
    ).to(device)
    emb = torch.randn(256, 128, device=device, requires_grad=True)
    labels = torch.randint(0, 8000, (256,), device=device)
    head_opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9)
    head(emb, labels).backward()  # warm-up: cuBLAS handles, allocator pools, optimizer state exist
    head_opt.step()
    head_opt.zero_grad()  # also forgets the rows sampled in the warm-up
    emb.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head(emb, labels).backward()
        head_opt.step()
        head_opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()


# ----- benchmarks/gpu.py -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_gpu_benchmark_runs_every_part_at_toy_sizes(kind):
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--smoke"],
        cwd=ROOT,
        env=env_for(kind),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for title in (
        "backbone step",
        "head forward+backward",
        "head vs fp64 full softmax",
        "distillation step",
        "embedding 16 crops",
    ):
        assert title in done.stdout, done.stdout
    distill = re.findall(
        r"\n\s*(\S+)\s+\d+\s+(\d+)\s+(\d+)\s+(\d+\.\d+)\s", done.stdout.split("distillation step")[1]
    )
    assert [row[0] for row in distill] == ["tiny"] and all(
        int(r[1]) > 0 and int(r[2]) > 0 for r in distill
    ), done.stdout  # the plain and the distillation step's samples/s of each backbone
    rows = re.findall(r"\s(ours|pfc_v2)\s+(off|on)\s", done.stdout)  # (head, TF32) of each head row
    assert sorted(rows) == sorted([(h, t) for h in ("ours", "pfc_v2") for t in ("off", "on")] * 2), (
        done.stdout
    )


@pytest.mark.parametrize("kind", [CUDA, "cpu"])
def test_head_profile_splits_gemm_from_the_rest(kind):
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/head_profile.py",
            "--smoke",
            "--sweep",
            "--chunks",
            "64",
            "--row_blocks",
            "4",
            "--case",
            "WebFace42M",
        ],
        cwd=ROOT,
        env=env_for(kind),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # its step, GEMM and non-GEMM times, an op table with the GEMMs marked, a sweep row (the
    # sampled case: Partial FC's path)
    steps = re.findall(r"GEMM (\d+\.\d+) ms, the rest (\d+\.\d+) ms", done.stdout)
    assert len(steps) == 1 and all(float(g) > 0 and float(r) > 0 for g, r in steps), done.stdout
    assert len(re.findall(r"\syes\n", done.stdout)) >= 1, done.stdout
    assert len(re.findall(r"ours 64/4\s", done.stdout)) == 1, done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["Glint360K", "WebFace42M"])
def test_the_head_step_replayed_from_a_cuda_graph_gives_the_eager_gradients(case):
    """The head's forward and backward capture in one CUDA graph (no host sync, Partial FC's
    sampling included), and a replay writes the eager step's embedding gradient."""
    done = subprocess.run(
        [sys.executable, "benchmarks/head_profile.py", "--smoke", "--graph", "--case", case],
        cwd=ROOT,
        env=env_for("cuda"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ours = re.search(
        rf"^\s*{case}\s+ours\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(.+)$", done.stdout, re.M
    )
    assert ours, done.stdout  # a failed capture prints "capture failed" where the replay's ms go
    eager_ms, replay_ms, diff = float(ours[1]), float(ours[3]), ours[5].strip()
    assert eager_ms > 0 and replay_ms > 0
    if case == "Glint360K":  # every class in the step: the replay must equal the eager step
        assert float(diff) <= 1e-6, done.stdout
    else:  # each replay samples anew, so only its running is checked
        assert diff == "n/a (resampled)", done.stdout

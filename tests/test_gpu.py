"""The GPU kit (`make test-gpu`, one GPU): what no CPU run can show. Every test here is marked
`gpu` and skipped without CUDA (tests/conftest.py).

- train.py smoke runs on the GPU in fp32, fp16 and bf16, with ZeRO-2 and with DDP;
- NCCL at world size 1 with the multi-rank code paths forced on, under
  TORCH_DISTRIBUTED_DEBUG=DETAIL (collective fingerprints checked): ZeRO-2's collective
  exchange, DDP, the autograd all-gather, the gloo side group; ZeRO-2 with forward/backward
  on a side stream gives the same gradients bit for bit;
- the head against an fp64 full softmax, with and without TF32;
- no host synchronisation in the head under `torch.cuda.set_sync_debug_mode("error")`;
- a checkpoint and model.pt written on the GPU open on a CPU-only host.
"""
import contextlib
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from heads import PartialFC, SampledRowsOptimizer
from losses import CombinedMarginLoss
from tests.collective_log import recording
from tests.fp64_head import M2, S, head_errors_against_fp64
from tests.distributed import run_distributed

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE_STEPS = 6


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from scripts.make_synthetic import main as make_synthetic
    root = str(tmp_path_factory.mktemp("data") / "syn")
    make_synthetic(["--output", root, "--num-ids", "16", "--per-id", "8", "--val-ids", "6",
                    "--val-per-id", "4", "--val-pairs", "40", "--workers", "1"])
    return root


def _train(data_dir, output, *extra) -> subprocess.CompletedProcess:
    """train.py in its own process, as a user starts it: one rank on the visible GPU."""
    args = ["configs/synthetic.py", "--rec", data_dir, "--num_classes", "16", "--batch_size", "16",
            "--num_workers", "2", "--frequent", "1", "--verbose", "0", "--val_targets", "[]",
            "--checkpoint_interval", "3", "--num_epoch", "2", "--warmup_epoch", "0",
            "--max_steps", str(SMOKE_STEPS), "--chunk_size", "5", "--ema", "true", "--output", output, *extra]
    return subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("zero", [True, False], ids=["zero2", "ddp"])
def test_train_smoke_on_one_gpu(data_dir, tmp_path, precision, zero):
    out = str(tmp_path / "run")
    done = _train(data_dir, out, "--zero", str(zero).lower(), "--fp16", str(precision == "fp16").lower(),
                  "--bf16", str(precision == "bf16").lower())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = open(os.path.join(out, "training.log")).read()
    assert "(world size 1, cuda:" in log  # it trained on the GPU
    losses = [float(v) for v in re.findall(r"loss ([0-9.]+|nan|inf)", log)]
    assert len(losses) == SMOKE_STEPS and all(math.isfinite(v) for v in losses), losses
    assert bool(re.search(r"loss [0-9.]+ .*scale \d+", log)) == (precision == "fp16")  # the loss scaler ran
    from utils.checkpoint import resolve_checkpoint
    assert resolve_checkpoint(out).endswith(f"checkpoint-{SMOKE_STEPS:08d}")
    assert os.path.isfile(os.path.join(out, "model.pt"))


_OPEN_ON_CPU = """
import glob, os, sys
import torch
assert not torch.cuda.is_available()
out = sys.argv[1]
for path in sorted(glob.glob(os.path.join(out, "**", "*.pt"), recursive=True)):
    torch.load(path, weights_only=True)  # no map_location: a CPU-only host as users have
from configs import get_config
from utils.checkpoint import load_checkpoint
from utils.training import build_backbone, build_head, build_optimizers
cfg = get_config("configs/synthetic.py", sys.argv[2:])
backbone, head = build_backbone(cfg), build_head(cfg)
backbone_opt, head_opt = build_optimizers(cfg, backbone, head)
state, _ = load_checkpoint(out, backbone=backbone, backbone_opt=backbone_opt, head=head, head_opt=head_opt)
print("opened step", state.step)
"""


@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="checkpoint rework pending: backbone, optimizer, EMA and model.pt tensors are saved "
                          "on the device")
def test_checkpoint_written_on_gpu_opens_on_a_cpu_only_host(data_dir, tmp_path):
    out = str(tmp_path / "run")
    done = _train(data_dir, out, "--fp16", "true")
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    opened = subprocess.run([sys.executable, "-c", _OPEN_ON_CPU, out, "--num_classes", "16", "--chunk_size", "5",
                             "--fp16", "true"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert opened.returncode == 0 and f"opened step {SMOKE_STEPS}" in opened.stdout, opened.stderr[-3000:]


# ----- NCCL at world size 1, multi-rank paths forced on ----------------------------------------

def _small_model(device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.PReLU(256), nn.Linear(256, 256), nn.PReLU(256),
                         nn.Linear(256, 32)).to(device)


def _zero2(model):
    from parallel import Zero2Optimizer
    opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4, bucket_cap_mb=0.1,
                         max_inflight_buckets=2, exchange="collective")
    opt._collective = True  # before the exchange rework this path is gated on W > 1: force it at W=1
    return opt


def _zero2_steps(device, x, side_stream: bool):
    """Two ZeRO-2 steps, forward/backward on the default or a side stream: gradient shards
    after each backward and the weights at the end."""
    model = _small_model(device)
    opt = _zero2(model)
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
    torch.cuda.synchronize()
    return grads, [p.detach().clone() for p in model.parameters()]


def _nccl_world_one(rank, world_size):
    from parallel.collectives import _AllGatherRows
    from parallel.ddp import DDPOptimizer
    from parallel.dist import cpu_group, init_distributed
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch read the variable at import, before this worker set it
    # cuBLAS is deterministic across streams only with a fixed workspace (set before CUDA starts)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    info = init_distributed(timeout_min=2, force_group=True)
    device = info.device
    report = {"backend": dist.get_backend(), "device": str(device), "debug": str(dist.get_debug_level()),
              "side_backend": dist.get_backend(cpu_group())}
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
    report["gather_exact"] = bool(torch.equal(gathered, emb) and torch.equal(emb.grad, torch.full_like(emb, 2.0)))
    report["max_exact"] = bool(torch.equal(reduced, row_max))

    # ZeRO-2 (collective exchange) equals the plain optimizer
    reference = _small_model(device)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    for _ in range(2):
        reference(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    report["zero_vs_plain"] = max((a - b).abs().max().item() for a, b in zip(params, reference.parameters()))

    # forward/backward on a side stream: the same gradients and weights, bit for bit
    side_grads, side_params = _zero2_steps(device, x, side_stream=True)
    report["side_stream_bitwise"] = all(torch.equal(a, b) for ga, gb in zip(grads, side_grads) for a, b in zip(ga, gb)) \
        and all(torch.equal(a, b) for a, b in zip(params, side_params))

    # DDP through NCCL at W=1 equals the plain optimizer
    model = _small_model(device)
    ddp_opt = DDPOptimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
    ddp_opt.ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index], broadcast_buffers=False,
                                                      gradient_as_bucket_view=True)  # W=1 skips the wrapper
    for _ in range(2):
        ddp_opt.ddp(x).square().mean().backward()
        ddp_opt.step()
        ddp_opt.zero_grad()
    report["ddp_vs_plain"] = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    torch.cuda.synchronize()
    return report


def test_nccl_world_size_one_runs_the_multi_rank_paths():
    (r,) = run_distributed(_nccl_world_one, 1, init=False, timeout=300)
    assert r["backend"] == "nccl" and r["device"].startswith("cuda") and r["debug"].endswith("DETAIL")
    assert r["side_backend"] == "gloo" and r["side_sum"] == 1.0
    # the collectives the multi-rank code issues did run through NCCL
    assert {"all_reduce"} <= set(r["calls"]) and {"reduce", "reduce_scatter_tensor", "reduce_scatter_single"} & \
        set(r["calls"]) and {"all_gather_into_tensor", "all_gather_single"} & set(r["calls"]), r["calls"]
    assert r["p2p"] == 0
    assert r["gather_exact"] and r["max_exact"]
    assert r["zero_vs_plain"] < 1e-6 and r["ddp_vs_plain"] < 1e-6, r
    assert r["side_stream_bitwise"]


# ----- the head on the GPU ---------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [None, 4096])
def test_head_matches_fp64_full_softmax_without_tf32(device, chunk):
    err = head_errors_against_fp64(device, tf32=False, chunk=chunk)
    assert err["loss"] < 1e-6 and err["grad_emb"] < 1e-5 and err["grad_weight"] < 1e-5, err


@pytest.mark.parametrize("chunk", [None, 4096])
def test_head_with_tf32_stays_close_to_fp64_full_softmax(device, chunk):
    err = head_errors_against_fp64(device, tf32=True, chunk=chunk)
    assert err["loss"] < 1e-4 and err["grad_emb"] < 5e-3 and err["grad_weight"] < 5e-3, err


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="head rework pending: the head still uses nonzero/unique")
@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("sample_rate", [1.0, 0.3])
def test_head_forward_and_backward_never_synchronise_the_host(device, chunk, sample_rate):
    torch.manual_seed(0)
    head = PartialFC(CombinedMarginLoss(S, 1.0, M2, 0.0), 128, 8000, sample_rate, chunk, validate=False).to(device)
    emb = torch.randn(256, 128, device=device, requires_grad=True)
    labels = torch.randint(0, 8000, (256,), device=device)
    head_opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1)
    head(emb, labels).backward()  # warm-up: cuBLAS handles and allocator pools exist before the check
    head_opt.zero_grad()  # also forgets the rows sampled in the warm-up
    emb.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        head(emb, labels).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert emb.grad is not None and torch.isfinite(emb.grad).all()

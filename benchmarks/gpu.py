#!/usr/bin/env python
"""GPU figures on one GPU: backbone throughput, the head at the per-rank shapes of 8-GPU jobs
against PFC v2, and the head's accuracy with TF32 against an fp64 full softmax.

1. backbone: samples/s of r50 and r100 at batch 128 per GPU, fp16 autocast with dynamic loss
   scaling: forward, backward and a ZeRO-2 SGD step at world size 1 (the per-GPU work of a
   data-parallel job, without its communication and without the head).
2. head: forward+backward time (median) and peak memory (torch.cuda.max_memory_allocated
   over the timed steps, the weight included) at the shapes one rank of an 8-GPU job sees:
   the global batch of 8 x 128 embeddings (D=512, fp32) against its class shard.
   Glint360K: 360,232 classes -> 45,029 per rank. WebFace42M: 2,059,906 classes -> 257,489
   per rank, sample_rate 0.2 -> 51,497 sampled. PFC v2 (benchmarks/pfc_v2_reference.py) has
   no sampling: on WebFace42M it runs over the 51,497 sampled rows only (what it computes
   after sampling, without the sampling's own cost). Each in full fp32 and with TF32.
3. accuracy: relative errors of the head's loss and gradients against float64, TF32 off/on.

Run from the repository root: `.venv/bin/python benchmarks/gpu.py`. On a machine without
CUDA it says so and exits with status 0.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch

from common import MB, table

BATCH = 128          # images per GPU
GPUS = 8             # the job whose per-rank shapes the head is measured at
D = 512
HEAD_CASES = {       # name: (classes in the data set, sample_rate)
    "Glint360K": (360_232, 1.0),
    "WebFace42M": (2_059_906, 0.2),
}


def _timed(step, warmup: int, iters: int) -> tuple[list[float], int]:
    """Per-iteration milliseconds (CUDA events) and the peak allocated bytes while timed."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in events], torch.cuda.max_memory_allocated()


def backbone_throughput(name: str, device: torch.device, warmup: int, iters: int) -> dict:
    from backbones import get_model
    from parallel import DynamicLossScaler, Zero2Optimizer
    torch.manual_seed(0)
    model = get_model(name, num_features=D, fp16=True).to(device)
    opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
    scaler = DynamicLossScaler()
    images = torch.randn(BATCH, 3, 112, 112, device=device)

    def step():
        scaler.scale(model(images).float().square().mean()).backward()
        if scaler.unscale_(opt):
            opt.step()
        opt.zero_grad()

    times, peak = _timed(step, warmup, iters)
    del model, opt
    return {"backbone": name, "batch": BATCH, "samples/s": f"{BATCH * 1e3 * len(times) / sum(times):.0f}",
            "ms/step": f"{statistics.median(times):.1f}", "peak MB": f"{peak / MB:.0f}"}


def _head(method: str, classes_per_rank: int, sample_rate: float, device: torch.device):
    from heads import PartialFC, SampledRowsOptimizer
    from losses import CombinedMarginLoss
    from pfc_v2_reference import PFCv2Reference
    margin = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    if method == "pfc_v2":
        rows = int(sample_rate * classes_per_rank) if sample_rate < 1 else classes_per_rank
        return PFCv2Reference(margin, D, rows).to(device), None
    head = PartialFC(margin, D, classes_per_rank, sample_rate, chunk_size=8192, validate=False).to(device)
    return head, SampledRowsOptimizer(head, torch.optim.SGD, lr=0.0)


def head_step(case: str, method: str, tf32: bool, device: torch.device, warmup: int, iters: int) -> dict:
    from tests.fp64_head import matmul_precision
    classes, sample_rate = HEAD_CASES[case]
    per_rank = classes // GPUS + (classes % GPUS > 0)
    torch.manual_seed(0)
    head, head_opt = _head(method, per_rank, sample_rate, device)
    emb = torch.randn(GPUS * BATCH, D, device=device, requires_grad=True)
    labels = torch.randint(0, head.weight.shape[0], (GPUS * BATCH,), device=device)

    def step():
        head.weight.grad, emb.grad = None, None
        if head_opt is not None:
            head_opt.zero_grad()  # forget the previous step's Partial FC sample
        head(emb, labels).backward()

    with matmul_precision(tf32):
        times, peak = _timed(step, warmup, iters)
    weight_mb = head.weight.numel() * head.weight.element_size() / MB
    del head, head_opt, emb
    torch.cuda.empty_cache()
    return {"data set": case, "classes/rank": f"{per_rank:,}", "sample_rate": sample_rate, "head": method,
            "TF32": "on" if tf32 else "off", "ms": f"{statistics.median(times):.2f}",
            "peak MB": f"{peak / MB:.0f}", "weight MB": f"{weight_mb:.0f}"}


def _process_group() -> None:
    """A world-size-1 NCCL group: the PFC v2 reference all-reduces unconditionally."""
    from parallel.dist import init_distributed
    from parallel.spawn import free_port
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                           LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    init_distributed(force_group=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["backbone", "head", "accuracy"], nargs="+",
                   default=["backbone", "head", "accuracy"])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device on this machine; nothing measured "
              "(run it on a GPU machine; the CPU figures are in benchmarks/README.md)")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True  # fixed 112x112 input, as train.py sets it
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")

    if "backbone" in args.only:
        rows = [backbone_throughput(name, device, args.warmup, args.iters) for name in ("r50", "r100")]
        print(f"\nbackbone step (fp16, ZeRO-2 SGD at W=1, no head), batch {BATCH}/GPU")
        print(table(rows, list(rows[0])))
        torch.cuda.empty_cache()

    if "head" in args.only:
        _process_group()
        rows = [head_step(case, method, tf32, device, args.warmup, args.iters)
                for case in HEAD_CASES for tf32 in (False, True) for method in ("ours", "pfc_v2")]
        print(f"\nhead forward+backward at one rank's shapes of a {GPUS}-GPU job "
              f"({GPUS * BATCH} embeddings x D={D}, fp32; ours chunk_size 8192)")
        print(table(rows, list(rows[0])))

    if "accuracy" in args.only:
        from tests.fp64_head import head_errors_against_fp64
        rows = []
        for tf32 in (False, True):
            err = head_errors_against_fp64(device, tf32)
            rows.append({"TF32": "on" if tf32 else "off", **{k: f"{v:.2e}" for k, v in err.items()}})
        print("\nhead vs fp64 full softmax (ArcFace s=64 m=0.5, 20k classes, 512 x 512): relative errors")
        print(table(rows, list(rows[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

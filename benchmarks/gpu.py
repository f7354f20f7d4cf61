#!/usr/bin/env python
"""GPU figures on one GPU: backbone throughput, the head at the per-rank shapes of 8-GPU jobs
against PFC v2, and the head's accuracy with TF32 against an fp64 full softmax.

1. backbone: samples/s of r50 and r100 at batch 128 per GPU, fp16 autocast with dynamic loss
   scaling: forward, backward and a ZeRO-2 SGD step at world size 1 (the per-GPU work of a
   data-parallel job, without its communication and without the head); each also with the
   batch in channels-last memory (`config.channels_last`), side by side.
2. head: forward+backward time (median) and peak memory (torch.cuda.max_memory_allocated
   over the timed steps, the weight included) at the shapes one rank of an 8-GPU job sees:
   the global batch of 8 x 128 embeddings (D=512, fp32) against its class shard.
   Glint360K: 360,232 classes -> 45,029 per rank. WebFace42M: 2,059,906 classes -> 257,489
   per rank, sample_rate 0.2 -> 51,497 sampled. PFC v2 (benchmarks/pfc_v2_reference.py) has
   no sampling: on WebFace42M it runs over the 51,497 sampled rows only (what it computes
   after sampling, without the sampling's own cost). Each in full fp32 and with TF32.
3. accuracy: relative errors of the head's loss and gradients against float64, TF32 off/on.
4. distillation: samples/s of the backbone step of 1. with an on-the-fly teacher (the same
   network, frozen, its weights cast to fp16 once: distill/teacher.py) and the cosine loss as
   its only loss, beside the plain step's.
5. embed: models used on the GPU (issue 56 item 3): images/s of `infer.embed.embed` (uint8
   112x112 crops in, unit rows out, flip included as the tools embed) for r50 over LFW-sized
   work (13,233 crops) on the GPU in fp32, fp16 and bf16 (channels-last, autocast), beside the
   CPU's rate (measured on 512 of them); and how far each precision's embeddings are from fp32's
   (the least cosine over all crops). `--bin VAL.bin` adds the 10-fold verification accuracy
   of that set from each precision's embeddings (LFW's lfw.bin for the issue's 0.001 check).

Run from the repository root: `.venv/bin/python benchmarks/gpu.py`. On a machine without
CUDA it says so and exits with status 0. `--smoke` runs every part at toy sizes on whatever
device there is (the CPU too; `make test` does so, so the script cannot rot unrun): its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch
from common import MB, table

D = 512
HEAD_CASES = {  # name: (classes in the data set, sample_rate)
    "Glint360K": (360_232, 1.0),
    "WebFace42M": (2_059_906, 0.2),
}


@dataclass(frozen=True)
class Sizes:
    batch: int = 128  # images per GPU
    gpus: int = 8  # the job whose per-rank shapes the head is measured at
    backbones: tuple = ("r50", "r100")
    class_divisor: int = 1  # the head's classes are HEAD_CASES' / this
    embed_network: str = "r50"
    embed_crops: int = 13_233  # LFW's photos
    embed_cpu_crops: int = 512
    accuracy: dict | None = None  # head_errors_against_fp64's sizes (None: its defaults)


FULL = Sizes()
SMOKE = Sizes(
    batch=4,
    gpus=2,
    backbones=("tiny",),
    class_divisor=500,
    embed_network="tiny",
    embed_crops=16,
    embed_cpu_crops=8,
    accuracy={"classes": 2000, "batch": 64, "dim": 64},
)


def _timed(step, device: torch.device, warmup: int, iters: int) -> tuple[list[float], int | None]:
    """Per-iteration milliseconds (CUDA events on a GPU, the wall clock elsewhere) and the
    peak allocated bytes while timed (None off the GPU)."""
    for _ in range(warmup):
        step()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            step()
            times.append((time.perf_counter() - start) * 1e3)
        return times, None
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


def _mb(peak: int | None) -> str:
    return "n/a" if peak is None else f"{peak / MB:.0f}"


def backbone_throughput(
    name: str,
    device: torch.device,
    sizes: Sizes,
    warmup: int,
    iters: int,
    distill: bool = False,
    channels_last: bool = False,
) -> dict:
    """The backbone step of part 1; `distill`: with an on-the-fly teacher of the same network
    and the cosine distillation loss alone (label-free: no head); `channels_last`: the batch in
    NHWC, the parameters as they are (what `config.channels_last` does in train.py)."""
    from shardface.backbones import get_model
    from shardface.parallel import DynamicLossScaler, Zero2Optimizer

    batch = sizes.batch
    torch.manual_seed(0)
    fp16 = device.type == "cuda"
    model = get_model(name, num_features=D, fp16=fp16).to(device)
    opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=5e-4)
    scaler = DynamicLossScaler()
    images = torch.randn(batch, 3, 112, 112, device=device)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    loss_of = lambda: model(images).float().square().mean()  # noqa: E731
    if distill:
        from shardface.distill.head import DistillLoss
        from shardface.distill.teacher import OnlineTeacher
        from shardface.faces.align import ARCFACE_112
        from shardface.infer.model import Model

        teacher = OnlineTeacher(
            Model(get_model(name, num_features=D).eval(), ARCFACE_112, name, ""),
            device,
            "fp16" if fp16 else None,
        )
        cosine = DistillLoss("cosine", 1.0)
        loss_of = lambda: cosine(None, model(images), None, teacher.targets(images, None))  # noqa: E731

    def step():
        scaler.scale(loss_of()).backward()
        if scaler.unscale_(opt):
            opt.step()
        opt.zero_grad()

    times, peak = _timed(step, device, warmup, iters)
    del model, opt
    return {
        "backbone": name,
        "batch": batch,
        "samples/s": f"{batch * 1e3 * len(times) / sum(times):.0f}",
        "ms/step": f"{statistics.median(times):.1f}",
        "peak MB": _mb(peak),
    }


def embed_rates(device: torch.device, sizes: Sizes, bin_path: str | None) -> list[dict]:
    """Part 5: one row per (device, precision): images/s, the least cosine to fp32's embedding of
    the same crop, and the .bin's accuracy where one is given."""
    import numpy as np

    from shardface.backbones import get_model
    from shardface.eval.verification import evaluate, load_bin
    from shardface.infer.embed import embed, l2_normalize

    torch.manual_seed(0)
    module = get_model(sizes.embed_network, num_features=D).eval()
    crops = torch.randint(0, 256, (sizes.embed_crops, 3, 112, 112), dtype=torch.uint8)
    pairs = load_bin(bin_path) if bin_path else None

    def both(images, on, precision):  # the tools' flip test: each crop's embedding plus its mirror's
        return l2_normalize(
            embed(images, on, 64, precision) + embed(torch.flip(images, dims=[3]), on, 64, precision)
        )

    def rate(images, on, precision):
        both(images[:64], on, precision)  # warm-up: cuDNN's autotuning, the allocator
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = both(images, on, precision)
        return out, len(images) / (time.perf_counter() - start)

    rows = []
    _, cpu_rate = rate(crops[: sizes.embed_cpu_crops], module, "fp32")
    rows.append({"device": "cpu", "precision": "fp32", "images/s": f"{cpu_rate:.1f}", "x CPU": "1.00"})
    if device.type == "cuda":
        on = module.to(device)
        reference = None
        for precision in ("fp32", "fp16", "bf16"):
            out, r = rate(crops, on, precision)
            reference = out if reference is None else reference
            row = {
                "device": "cuda",
                "precision": precision,
                "images/s": f"{r:.1f}",
                "x CPU": f"{r / cpu_rate:.2f}",
                "least cosine to fp32": f"{float(np.min(np.sum(out * reference, axis=1))):.6f}",
            }
            if pairs is not None:
                images, issame = pairs
                emb = both(images[0], on, precision)  # uint8 crops; both() adds the mirror's
                row["bin accuracy"] = f"{float(np.mean(evaluate(emb, issame)[2])):.4f}"
            rows.append(row)
    return rows


def _ratio(slow: dict, fast: dict) -> str:
    return f"{float(slow['ms/step']) / max(float(fast['ms/step']), 1e-9):.2f}"


def _base_config():
    from shardface.configs.base import config

    return config


def _head(method: str, classes_per_rank: int, sample_rate: float, device: torch.device):
    from pfc_v2_reference import PFCv2Reference

    from shardface.heads import PartialFC, SampledRowsOptimizer
    from shardface.losses import CombinedMarginLoss

    margin = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    if method == "pfc_v2":
        rows = int(sample_rate * classes_per_rank) if sample_rate < 1 else classes_per_rank
        return PFCv2Reference(margin, D, rows).to(device), None
    base = _base_config()  # the tiling a training run gets by default
    head = PartialFC(
        margin,
        D,
        classes_per_rank,
        sample_rate,
        chunk_size=base.chunk_size or None,
        row_block=base.row_block,
        validate=False,
    ).to(device)
    return head, SampledRowsOptimizer(head, torch.optim.SGD, lr=0.0)


def head_step(
    case: str, method: str, tf32: bool, device: torch.device, sizes: Sizes, warmup: int, iters: int
) -> dict:
    from tests.fp64_head import matmul_precision

    classes, sample_rate = HEAD_CASES[case]
    classes //= sizes.class_divisor
    gpus, batch = sizes.gpus, sizes.batch
    per_rank = classes // gpus + (classes % gpus > 0)
    torch.manual_seed(0)
    head, head_opt = _head(method, per_rank, sample_rate, device)
    emb = torch.randn(gpus * batch, D, device=device, requires_grad=True)
    labels = torch.randint(0, head.weight.shape[0], (gpus * batch,), device=device)

    def step():
        head.weight.grad, emb.grad = None, None
        if head_opt is not None:
            head_opt.zero_grad()  # forget the previous step's Partial FC sample
        head(emb, labels).backward()

    with matmul_precision(tf32):
        times, peak = _timed(step, device, warmup, iters)
    weight_mb = head.weight.numel() * head.weight.element_size() / MB
    del head, head_opt, emb
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "data set": case,
        "classes/rank": f"{per_rank:,}",
        "sample_rate": sample_rate,
        "head": method,
        "TF32": "on" if tf32 else "off",
        "ms": f"{statistics.median(times):.2f}",
        "peak MB": _mb(peak),
        "weight MB": f"{weight_mb:.0f}",
    }


def _process_group() -> None:
    """A world-size-1 group (NCCL on a GPU): the PFC v2 reference all-reduces unconditionally."""
    from shardface.parallel.dist import init_distributed
    from tests.distributed import free_port

    for key, value in dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    ).items():
        os.environ.setdefault(key, value)
    init_distributed(force_group=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        choices=["backbone", "head", "accuracy", "distill", "embed"],
        nargs="+",
        default=["backbone", "head", "accuracy", "distill", "embed"],
    )
    p.add_argument("--bin", default=None, help="a verification .bin (lfw.bin) for part 5's accuracy")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="toy sizes on any device (figures mean nothing)")
    args = p.parse_args(argv)
    sizes = SMOKE if args.smoke else FULL
    if args.smoke:
        args.warmup, args.iters = 1, 2
    if not torch.cuda.is_available() and not args.smoke:
        print(
            "benchmarks/gpu.py: no CUDA device on this machine; nothing measured "
            "(run it on a GPU machine; the CPU figures are in benchmarks/README.md)"
        )
        return 0
    if torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed 112x112 input, as train.py sets it
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    else:
        device = torch.device("cpu")
        print(f"CPU, torch {torch.__version__} (--smoke: toy sizes, the figures mean nothing)")

    plain = {}
    if "backbone" in args.only or "distill" in args.only:
        plain = {
            name: backbone_throughput(name, device, sizes, args.warmup, args.iters)
            for name in sizes.backbones
        }
    if "backbone" in args.only:
        rows = []
        for name, row in plain.items():
            nhwc = backbone_throughput(name, device, sizes, args.warmup, args.iters, channels_last=True)
            rows.append(
                {
                    **row,
                    "channels_last samples/s": nhwc["samples/s"],
                    "NCHW/NHWC step time": _ratio(row, nhwc),
                    "channels_last peak MB": nhwc["peak MB"],
                }
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(
            f"\nbackbone step ({'fp16, ' if device.type == 'cuda' else ''}ZeRO-2 SGD at W=1, no head), "
            f"batch {sizes.batch}/GPU; channels_last: the batch in NHWC"
        )
        print(table(rows, list(rows[0])))
    if device.type == "cuda":
        torch.cuda.empty_cache()

    if "distill" in args.only:
        rows = []
        for name in sizes.backbones:
            with_teacher = backbone_throughput(name, device, sizes, args.warmup, args.iters, distill=True)
            rows.append(
                {
                    "backbone": name,
                    "batch": sizes.batch,
                    "plain samples/s": plain[name]["samples/s"],
                    "distill samples/s": with_teacher["samples/s"],
                    "step time ratio": _ratio(with_teacher, plain[name]),
                    "distill peak MB": with_teacher["peak MB"],
                }
            )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print(
            f"\ndistillation step (the backbone step with an on-the-fly teacher of the same network"
            f"{', its weights cast to fp16 once' if device.type == 'cuda' else ''}, cosine loss, no head), "
            f"batch {sizes.batch}/GPU"
        )
        print(table(rows, list(rows[0])))

    if "head" in args.only:
        _process_group()
        rows = [
            head_step(case, method, tf32, device, sizes, args.warmup, args.iters)
            for case in HEAD_CASES
            for tf32 in (False, True)
            for method in ("ours", "pfc_v2")
        ]
        print(
            f"\nhead forward+backward at one rank's shapes of a {sizes.gpus}-GPU job "
            f"({sizes.gpus * sizes.batch} embeddings x D={D}, fp32; ours chunk_size "
            f"{_base_config().chunk_size}, row_block {_base_config().row_block}: configs/schema.py)"
        )
        print(table(rows, list(rows[0])))

    if "accuracy" in args.only:
        from tests.fp64_head import head_errors_against_fp64

        rows = []
        for tf32, precision in ((False, "fp32"), (True, "fp32"), (False, "tf32"), (False, "bf16")):
            err = head_errors_against_fp64(device, tf32, precision=precision, **(sizes.accuracy or {}))
            rows.append(
                {
                    "torch TF32": "on" if tf32 else "off",
                    "head_precision": precision,
                    **{k: f"{v:.2e}" for k, v in err.items()},
                }
            )
        shape = sizes.accuracy or {"classes": 20000, "batch": 512, "dim": 512}
        print(
            f"\nhead vs fp64 full softmax (ArcFace s=64 m=0.5, {shape['classes']} classes, "
            f"{shape['batch']} x {shape['dim']}): relative errors"
        )
        print(table(rows, list(rows[0])))

    if "embed" in args.only:
        rows = embed_rates(device, sizes, args.bin)
        print(
            f"\nembedding {sizes.embed_crops} crops ({sizes.embed_network}, flip test, unit rows; the CPU on "
            f"{sizes.embed_cpu_crops} of them, {torch.get_num_threads()} threads)"
        )
        columns = list(dict.fromkeys(c for r in rows for c in r))
        print(table(rows, columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())

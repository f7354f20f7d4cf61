#!/usr/bin/env python
"""Head step time and peak memory per rank: ours (chunked) vs arcface_torch's PFC v2.

W=2 gloo ranks on CPU (one thread each), b=128 per rank, D=512, fp32, C in {100k, 400k}.
Each case runs in fresh processes; memory is the weight plus the peak growth of the
resident set during a step after a warm-up step (gradient + temporaries); the floor is the
weight plus its gradient.
"""
from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401,I001
import torch

from common import MB, peak_bytes, reset_peak, rss_bytes, table
from pfc_v2_reference import PFCv2Reference
from heads import PartialFC
from losses import CombinedMarginLoss
from parallel.spawn import run_distributed

B, D = 128, 512


def _case(rank, world_size, method, num_classes, chunk, iters):
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    margin = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    if method == "pfc_v2":
        head = PFCv2Reference(margin, D, num_classes)
    else:
        head = PartialFC(margin, D, num_classes, chunk_size=chunk, validate=False)
    emb = torch.randn(B, D, requires_grad=True)
    labels = torch.randint(0, num_classes, (B,))
    weight_bytes = head.weight.numel() * 4
    times = []
    for it in range(iters + 1):
        head.weight.grad, emb.grad = None, None
        if it == 1:  # after a warm-up step: thread pools and buffers already exist
            reset_peak()
            resting = rss_bytes()
        t = time.perf_counter()
        head(emb, labels).backward()
        times.append(time.perf_counter() - t)
    # the weight plus the largest growth of the process during a step
    return statistics.median(times[1:]), peak_bytes() - resting + weight_bytes, weight_bytes


def measure(method, num_classes, chunk, iters):
    results = run_distributed(_case, 2, method, num_classes, chunk, iters, timeout=900)
    step = max(r[0] for r in results)
    peak = max(r[1] for r in results)
    weight = max(r[2] for r in results)
    return step, peak, 2 * weight


def main(argv=None):
    common.exact_rss_allocator()
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--classes", type=int, nargs="+", default=[100_000, 400_000])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--budget-mb", type=float, default=4096, help="per-rank memory budget for the capacity line")
    args = p.parse_args(argv)
    rows, fits = [], {}
    for c in args.classes:
        base_t, base_m, floor = measure("pfc_v2", c, None, args.iters)
        ours_t, ours_m, _ = measure("ours", c, args.chunk, args.iters)
        fits.setdefault("pfc_v2", []).append((c, base_m))
        fits.setdefault("ours", []).append((c, ours_m))
        rows.append({"C": c, "pfc_v2 ms": f"{base_t * 1e3:.0f}", "ours ms": f"{ours_t * 1e3:.0f}",
                     "time ours/pfc_v2": f"{ours_t / base_t:.2f}", "floor MB": f"{floor / MB:.0f}",
                     "pfc_v2 MB": f"{base_m / MB:.0f}", "ours MB": f"{ours_m / MB:.0f}",
                     "pfc_v2/floor": f"{base_m / floor:.2f}", "ours/floor": f"{ours_m / floor:.2f}"})
    print(f"W=2 gloo ranks, 1 thread each, b={B}/rank, D={D}, fp32, chunk_size={args.chunk}")
    print(table(rows, list(rows[0])))
    if len(args.classes) >= 2:
        budget = args.budget_mb * MB
        print(f"\nlargest C within {args.budget_mb:.0f} MB per rank (W=2), from the linear fit of the peaks above:")
        for name, pts in fits.items():
            (c0, m0), (c1, m1) = pts[0], pts[-1]
            slope = (m1 - m0) / (c1 - c0)
            print(f"  {name:7s} {int((budget - (m0 - slope * c0)) / slope):>12,d} classes")


if __name__ == "__main__":
    main()

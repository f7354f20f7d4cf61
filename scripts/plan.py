#!/usr/bin/env python
"""Will this job fit? Per-rank memory and per-step traffic from a config.

    python -m scripts.plan configs/glint360k_r100 --gpus 8 --gpu_mem_gb 80 [--key value ...]

Prints the bytes each rank holds (backbone, ZeRO-2 shards and bucket scratch, activations at
the batch size, head weight, gradient, optimizer state and buffers), whether the job fits,
the largest num_classes that would, the head's tile size and the bytes each rank sends per
step. The model is planner.py's; tests hold it against peaks measured on the CPU.
"""

from __future__ import annotations

import argparse
import sys

from shardface.configs import get_config
from shardface.heads.sharding import class_shard
from shardface.parallel.user_errors import exits_on_user_error
from shardface.planner import CUDA_RESERVE, GB, budget_bytes, max_classes, pfc_v2_max_classes, plan
from shardface.scripts.cli import ArgumentParser


@exits_on_user_error
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a job config (configs/x or configs/x.py); --key value overrides follow")
    p.add_argument("--gpus", type=int, required=True, help="world size (ranks)")
    p.add_argument("--gpu_mem_gb", type=float, default=80.0, help="memory of one GPU in GB (default 80)")
    p.add_argument(
        "--table",
        action="store_true",
        help="print docs/heads.md's capacity table (r50, r100; 8 and 64 GPUs; ours vs PFC v2)",
    )
    args, overrides = p.parse_known_args(argv)
    if args.gpus < 1:
        p.error(f"--gpus {args.gpus}: a job needs at least one rank")
    budget = budget_bytes(args.gpu_mem_gb)  # before the config: nan, inf, -5 named in one line
    cfg = get_config(args.config, overrides)
    if args.table:
        return capacity_table(args.config, overrides, args.gpu_mem_gb, budget)
    result = plan(cfg, args.gpus)
    classes = f"{cfg.num_classes:,} classes" if cfg.num_classes else "label-free (num_classes 0: no head)"
    print(
        f"{args.config}: {cfg.network}, {classes}, batch {cfg.batch_size}/rank, "
        f"{args.gpus} ranks, {'ZeRO-2' if cfg.zero else 'DDP'}, sample_rate {cfg.sample_rate}, "
        f"fused head optimizer {cfg.head_fused_optimizer}"
    )
    print("\nper rank:")
    for name, value in result.parts.items():
        print(f"  {name:32s} {value / GB:9.3f} GB")
    print(
        f"  {'total':32s} {result.total / GB:9.3f} GB   (budget {budget / GB:.1f} GB: "
        f"{args.gpu_mem_gb:g} GB less {CUDA_RESERVE / GB:g} GB for CUDA, NCCL and the allocator)"
    )
    fits = result.total <= budget
    print(
        f"\nfits: {'yes' if fits else 'NO'}; largest num_classes that fits: "
        f"{max_classes(cfg, args.gpus, budget):,}"
    )
    if cfg.num_classes:  # label-free (0): no head
        n = class_shard(cfg.num_classes, args.gpus, 0).size
        print(f"head tile: {min(cfg.chunk_size or n, n):,} classes; row block {cfg.row_block} rows")
    print("\nsent per rank per step:")
    for name, value in result.sends.items():
        print(f"  {name:36s} {value / 1e6:10.2f} MB")
    print(f"  {'total':36s} {sum(result.sends.values()) / 1e6:10.2f} MB")
    return 0 if fits else 1


def capacity_table(config: str, overrides: list[str], gpu_mem_gb: float, budget: float) -> int:
    print("| network | GPUs | ours | ours, fused head optimizer | PFC v2 (memory model) |")
    print("|---|---|---|---|---|")
    for network in ("r50", "r100"):
        for gpus in (8, 64):
            base = overrides + ["--network", network, "--batch_size", "128", "--sample_rate", "1.0"]
            ours = max_classes(get_config(config, base), gpus, budget)
            fused = max_classes(
                get_config(
                    config,
                    base
                    + [
                        "--head_fused_optimizer",
                        "true",
                        "--fp16",
                        "false",
                        "--bf16",
                        "true",
                        "--clip_head",
                        "false",
                    ],
                ),
                gpus,
                budget,
            )
            theirs = pfc_v2_max_classes(get_config(config, base), gpus, budget)
            print(f"| {network} | {gpus} | {ours / 1e6:.0f}M | {fused / 1e6:.0f}M | {theirs / 1e6:.0f}M |")
    print(f"\n{gpu_mem_gb:g} GB per GPU, batch 128 per GPU, sample_rate 1, D=512, SGD with momentum.")
    return 0


if __name__ == "__main__":
    sys.exit(main())

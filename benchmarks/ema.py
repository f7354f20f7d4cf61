#!/usr/bin/env python
"""EMA update time per step of an r50 (43.6M parameters) at W=2 gloo ranks, one thread each.

ours        ShardedEMA over Zero2Optimizer: one lerp_ of this rank's fp32 master shard
per-tensor  yolov5 ModelEMA: `v *= d; v += (1 - d) * p` for every floating tensor, full model
foreach     torch._foreach_lerp_ over every parameter, full model
floor       one bare lerp_ over a fresh tensor the size of this rank's shard (memory bound)
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401,I001
import torch
import torch.distributed as dist

from shardface.backbones import get_model
from shardface.parallel import ShardedEMA, Zero2Optimizer
from tests.distributed import run_distributed


def _timed_round_robin(fns: dict, iters: int) -> dict:
    """Median time of each function, measured in turns so all see the same conditions; the
    ranks start each call together (they share the memory bandwidth)."""
    times = {name: [] for name in fns}
    for it in range(iters + 1):
        for name, fn in fns.items():
            dist.barrier()
            t = time.perf_counter()
            fn()
            if it:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _case(rank, world_size, network, iters):
    torch.set_num_threads(1)
    model = get_model(network)
    opt = Zero2Optimizer(model, torch.optim.SGD, lr=0.1)
    ema = ShardedEMA(model, decay=0.9999, tau=2000, optimizer=opt)

    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    live = model.state_dict()
    d = 0.999

    def per_tensor():
        for k, v in full.items():
            if v.dtype.is_floating_point:
                v.mul_(d)
                v.add_((1 - d) * live[k].detach())

    ema_params = [p.detach().clone() for p in model.parameters()]
    params = [p.detach() for p in model.parameters()]
    shard = sum(s.numel() for s in ema.shards)
    a, b = torch.randn(shard), torch.randn(shard)
    t = _timed_round_robin(
        {
            "ours": ema.update,
            "loop": per_tensor,
            "foreach": lambda: torch._foreach_lerp_(ema_params, params, 1 - d),
            "floor": lambda: a.lerp_(b, 1 - d),
        },
        iters,
    )
    n_params = sum(p.numel() for p in model.parameters())
    return t["ours"], t["loop"], t["foreach"], t["floor"], shard, n_params


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--network", default="r50")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args(argv)
    res = run_distributed(_case, 2, args.network, args.iters, timeout=900)
    ours, loop, foreach, floor = (max(r[i] for r in res) for i in range(4))
    shard, n = res[0][4], res[0][5]
    print(
        f"{args.network}: {n / 1e6:.1f}M parameters, EMA shard per rank {shard / 1e6:.1f}M floats "
        f"({shard * 4 / 1e6:.0f} MB instead of {n * 4 / 1e6:.0f} MB); W=2, one thread per rank"
    )
    for name, t in [
        ("ours (sharded lerp)", ours),
        ("per-tensor loop (yolov5)", loop),
        ("foreach lerp (full)", foreach),
        ("floor (bare shard lerp)", floor),
    ]:
        print(f"  {name:26s} {t * 1e3:8.2f} ms   {t / floor:5.2f}x floor")
    print(
        f"ours / floor = {ours / floor:.2f} (target <= 1.1);  per-tensor / ours = {loop / ours:.1f}x "
        f"(target >= {2 * 2}x)"
    )


if __name__ == "__main__":
    main()

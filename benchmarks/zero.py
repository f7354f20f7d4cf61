#!/usr/bin/env python
"""ZeRO-2 vs DDP with the same torch optimizer (SGD + momentum or AdamW), W=2 gloo ranks, one thread
each: optimizer-state and gradient bytes per rank, and step time (forward + backward +
optimizer step), the two measured in alternating steps of one process pair (median of
--iters steps after one warm-up step)."""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401,I001
import torch
from common import MB, table

from shardface.backbones import get_model
from shardface.parallel import Zero2Optimizer
from shardface.parallel.ddp import DDPOptimizer
from tests.distributed import run_distributed

OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.01, momentum=0.9, weight_decay=5e-4)),  # arcface_torch's
    "adamw": (torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.1)),
}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def _case(rank, world_size, network, batch, iters, bucket_mb, optimizer):
    torch.set_num_threads(1)
    cls, kw = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    zero_model = get_model(network)
    ddp_model = get_model(network)
    ddp_model.load_state_dict(zero_model.state_dict())
    zero = Zero2Optimizer(zero_model, cls, bucket_cap_mb=bucket_mb, **kw)
    ddp = DDPOptimizer(ddp_model, cls, **kw)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, 112, 112, generator=g)
    times = {"zero": [], "ddp": []}
    for it in range(iters + 1):
        for name, opt, fwd in (("zero", zero, zero_model), ("ddp", ddp, ddp.ddp)):
            t = time.perf_counter()
            fwd(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if it:
                times[name].append(time.perf_counter() - t)
    fwd_bytes = lambda opt: _tensor_bytes(v for s in opt.state.values() for v in s.values())  # noqa: E731
    return {
        "zero_state": fwd_bytes(zero),
        "ddp_state": fwd_bytes(ddp),
        "zero_grad": _tensor_bytes(zero.grad_shards()),
        "ddp_grad": _tensor_bytes(p.grad for p in ddp_model.parameters() if p.grad is not None)
        or _tensor_bytes(p for p in ddp_model.parameters() if p.requires_grad),
        "zero_scratch": zero.peak_scratch_bytes,
        "zero_time": statistics.median(times["zero"]),
        "ddp_time": statistics.median(times["ddp"]),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--networks", nargs="+", default=["r18", "r50"])
    p.add_argument("--batch", type=int, default=4, help="images per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd")
    p.add_argument("--bucket-mb", type=float, default=16.0, help="Zero2Optimizer bucket_cap_mb")
    args = p.parse_args(argv)
    rows = []
    for net in args.networks:
        res = run_distributed(
            _case, 2, net, args.batch, args.iters, args.bucket_mb, args.optimizer, timeout=1800
        )
        r = {k: max(x[k] for x in res) for k in res[0]}
        zero_total, ddp_total = r["zero_state"] + r["zero_grad"], r["ddp_state"] + r["ddp_grad"]
        rows.append(
            {
                "network": net,
                "DDP state+grad MB": f"{ddp_total / MB:.1f}",
                "ZeRO-2 state+grad MB": f"{zero_total / MB:.1f}",
                "ratio": f"{zero_total / ddp_total:.4f}",
                "scratch MB": f"{r['zero_scratch'] / MB:.1f}",
                "DDP step s": f"{r['ddp_time']:.2f}",
                "ZeRO-2 step s": f"{r['zero_time']:.2f}",
                "time ZeRO-2/DDP": f"{r['zero_time'] / r['ddp_time']:.3f}",
            }
        )
    print(
        f"W=2 gloo ranks, one thread each, {args.batch} images per rank, {args.optimizer}; "
        f"{args.bucket_mb:g} MB buckets; target ratio 1/W = 0.5 (+-1%), time <= 1.05"
    )
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Head step time and peak memory per rank, side by side in one run:

- ours (chunked, one pass), and ours with the optimizer fused into backward (no weight gradient);
- arcface_torch's PFC v2 algorithm (benchmarks/pfc_v2_reference.py);
- the limit: the three bare GEMMs any exact head must do at the same shapes (logits B x n,
  dE = G @ W, dW = G^T @ E), with nothing else;
- the limit with the two collectives any class-sharded head makes besides: the embeddings
  all-gathered before the GEMMs and their gradient reduce-scattered after (`limit+comm`: the
  ranks then wait for each other, as every head's do);
- at W=1: torch's `F.linear_cross_entropy` (no margin, no normalisation) at the same shapes.

W=2 gloo ranks on CPU (one thread each), b=128 per rank, D=512, fp32. Each case runs in fresh
processes with the default allocator; memory is the weight plus the peak growth of the
resident set during a step after a warm-up step; the floor is the weight plus its gradient.
`--paired STEPS` times the limit, limit+comm and ours instead in the same two processes, a step
of each in turn, and gives each ratio step by step (time only): a machine that drifts between
processes then moves both sides of a ratio alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401,I001
import torch
import torch.nn.functional as F
from common import MB, peak_bytes, reset_peak, rss_bytes, table
from pfc_v2_reference import PFCv2Reference

from shardface.heads import PartialFC, SampledRowsOptimizer
from shardface.heads.sharding import class_shard
from shardface.losses import AdaFace, CombinedMarginLoss, CurricularFace, MagFace, SubCenterArcFace
from shardface.parallel.collectives import all_gather_flat, reduce_scatter_flat
from tests.distributed import run_distributed

B, D = 128, 512


class BareGEMMs(torch.nn.Module):
    """The three products of an exact head, bare: the time and memory limit."""

    def __init__(self, num_local: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.normal(0, 0.01, (num_local, D)))

    def step(self, emb: torch.Tensor, local: torch.Tensor | None = None) -> None:
        """The GEMMs over the global batch `emb`; given the rank's `local` rows, `emb` is first
        all-gathered from them and its gradient reduce-scattered back to them."""
        with torch.no_grad():
            if local is not None:
                all_gather_flat(emb, local)
            logits = emb @ self.weight.t()
            logits.mul_(1e-3)  # stands in for the softmax gradient, in place
            emb.grad = logits @ self.weight
            self.weight.grad = logits.t() @ emb
            if local is not None:
                local.grad = torch.empty_like(local)
                reduce_scatter_flat(local.grad, emb.grad)


MARGINS = {
    "arcface": lambda: CombinedMarginLoss(64.0, 1.0, 0.5, 0.0),
    "cosface": lambda: CombinedMarginLoss(64.0, 1.0, 0.0, 0.4),
    "adaface": lambda: AdaFace(),
    "magface": lambda: MagFace(),
    "curricularface": lambda: CurricularFace(),
    "subcenter_arcface": lambda: SubCenterArcFace(k=3),
}


def _head(method: str, num_classes: int, world: int, chunk: int, row_block: int):
    margin = MARGINS[method.split(":")[1]]() if method.startswith("margin:") else MARGINS["arcface"]()
    if method == "pfc_v2":
        return PFCv2Reference(margin, D, num_classes)
    if method in ("limit", "limit+comm", "linear_ce"):
        return BareGEMMs(
            class_shard(num_classes, world, torch.distributed.get_rank() if world > 1 else 0).size
        )
    fused = {"fused_optimizer": True} if method == "fused" else {}
    return PartialFC(margin, D, num_classes, chunk_size=chunk, row_block=row_block, validate=False, **fused)


def _step(method, head, emb, emb_global, labels) -> None:
    """One forward and backward of `method`'s head."""
    if method == "limit":  # the products over the global batch, as every rank of a head does
        head.step(emb_global)
    elif method == "limit+comm":
        head.step(emb_global, emb.detach())
    elif method == "linear_ce":
        F.linear_cross_entropy(emb, head.weight, labels, options=_linear_ce_options()).backward()
    else:
        head(emb, labels).backward()


def _case(rank, world_size, method, num_classes, chunk, row_block, iters, batch):
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    head = _head(method, num_classes, world_size, chunk, row_block)
    emb = torch.randn(batch, D, requires_grad=True)
    emb_global = torch.randn(world_size * batch, D) if method.startswith("limit") else None
    labels = torch.randint(0, num_classes, (batch,))
    opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.1, momentum=0.9) if method == "fused" else None
    weight_bytes = head.weight.numel() * 4
    times = []
    for it in range(iters + 1):
        head.weight.grad, emb.grad = None, None
        if it == 1:  # after a warm-up step: thread pools and buffers already exist
            reset_peak()
            resting = rss_bytes()
        t = time.perf_counter()
        _step(method, head, emb, emb_global, labels)
        times.append(time.perf_counter() - t)
    del opt
    # the weight plus the largest growth of the process during a step
    return statistics.median(times[1:]), peak_bytes() - resting + weight_bytes, weight_bytes


def _paired(rank, world_size, num_classes, chunk, row_block, steps, batch):
    """limit, limit+comm and ours built in the same processes and stepped in turn (the order
    rotating), so that each of ours steps has the limit's beside it on the same machine state."""
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    heads = {m: _head(m, num_classes, world_size, chunk, row_block) for m in ("limit", "limit+comm", "ours")}
    emb = torch.randn(batch, D, requires_grad=True)
    emb_global = torch.randn(world_size * batch, D)
    labels = torch.randint(0, num_classes, (batch,))
    order = list(heads)
    times = {m: [] for m in heads}
    for it in range(steps + 1):
        for m in order[it % 3 :] + order[: it % 3]:
            heads[m].weight.grad, emb.grad = None, None
            t = time.perf_counter()
            _step(m, heads[m], emb, emb_global, labels)
            if it > 0:  # the first round warms up
                times[m].append(time.perf_counter() - t)
    return times


def paired(num_classes, chunk, row_block, steps, world=2, batch=B) -> None:
    results = run_distributed(_paired, world, num_classes, chunk, row_block, steps, batch, timeout=1800)
    # a step's time is its slowest rank's (the bare limit's ranks do not wait for each other)
    t = {m: [max(r[m][i] for r in results) for i in range(steps)] for m in results[0]}
    print(
        f"\npaired, W={world} gloo ranks, 1 thread each, b={batch}/rank, D={D}, C={num_classes:,}, "
        f"chunk_size={chunk}, row_block={row_block}, {steps} steps of each in turn in the same processes"
    )
    rows = []
    for base in ("limit", "limit+comm"):
        r = sorted(o / b for o, b in zip(t["ours"], t[base]))
        q = statistics.quantiles(r, n=4)
        rows.append(
            {
                "baseline": base,
                "baseline ms": f"{statistics.median(t[base]) * 1e3:.0f}",
                "ours ms": f"{statistics.median(t['ours']) * 1e3:.0f}",
                "ours/baseline (median of steps)": f"{statistics.median(r):.3f}",
                "quartiles": f"{q[0]:.3f}-{q[2]:.3f}",
                "range": f"{r[0]:.2f}-{r[-1]:.2f}",
            }
        )
    print(table(rows, list(rows[0])))


def _linear_ce_options():
    return torch.nn.LinearCrossEntropyOptions(batch_chunk_size=64)


def measure(method, num_classes, chunk, row_block, iters, world=2, batch=B):
    results = run_distributed(_case, world, method, num_classes, chunk, row_block, iters, batch, timeout=1800)
    step = max(r[0] for r in results)
    peak = max(r[1] for r in results)
    weight = max(r[2] for r in results)
    return step, peak, 2 * weight


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--classes", type=int, nargs="+", default=[100_000, 400_000])
    p.add_argument("--chunk", type=int, default=2048)  # CPU caches; the GPU config default is 8192
    p.add_argument("--row-block", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="limit, limit+comm, ours and fused are measured in turn this many times; each ratio is "
        "the median of the rounds' ratios (a shared machine drifts between processes)",
    )
    p.add_argument("--skip-pfc", action="store_true", help="leave out the (slow) PFC v2 baseline")
    p.add_argument("--skip-w1", action="store_true", help="leave out the W=1 comparison")
    p.add_argument(
        "--paired",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: limit, limit+comm and ours stepped in turn in the same two processes, "
        "STEPS steps each, at the first --classes (no process-to-process drift)",
    )
    p.add_argument(
        "--margins",
        action="store_true",
        help="instead: each margin head's step time against plain ArcFace at the first --classes",
    )
    args = p.parse_args(argv)
    if args.margins:
        return compare_margins(args)
    if args.paired:
        return paired(args.classes[0], args.chunk, args.row_block, args.paired)
    rows = []
    for c in args.classes:
        # limit, ours and fused in turn, `rounds` times; PFC v2 (slow) once, against the median limit
        methods = ("limit", "limit+comm", "ours", "fused")
        rounds = [
            {m: measure(m, c, args.chunk, args.row_block, args.iters) for m in methods}
            for _ in range(args.rounds)
        ]
        floor = rounds[0]["limit"][2]
        limit_t = statistics.median(r["limit"][0] for r in rounds)
        row = {
            "C": f"{c:,}",
            "floor MB": f"{floor / MB:.0f}",
            "limit ms": f"{limit_t * 1e3:.0f}",
            "limit+comm ms": f"{statistics.median(r['limit+comm'][0] for r in rounds) * 1e3:.0f}",
        }
        for m in ("ours", "fused"):
            ratios = sorted(r[m][0] / r["limit"][0] for r in rounds)
            row[f"{m} ms"] = f"{statistics.median(r[m][0] for r in rounds) * 1e3:.0f}"
            row[f"{m}/limit"] = f"{statistics.median(ratios):.2f}"
            row[f"{m}/limit range"] = f"{ratios[0]:.2f}-{ratios[-1]:.2f}"
            row[f"{m} MB/floor"] = f"{statistics.median(r[m][1] for r in rounds) / floor:.2f}"
        comm = sorted(r["ours"][0] / r["limit+comm"][0] for r in rounds)
        row["ours/limit+comm"] = f"{statistics.median(comm):.2f}"
        row["ours/limit+comm range"] = f"{comm[0]:.2f}-{comm[-1]:.2f}"
        if not args.skip_pfc:
            t, peak, _ = measure("pfc_v2", c, args.chunk, args.row_block, args.iters)
            row.update(
                {
                    "pfc_v2 ms": f"{t * 1e3:.0f}",
                    "pfc_v2/limit": f"{t / limit_t:.2f}",
                    "pfc_v2 MB/floor": f"{peak / floor:.2f}",
                }
            )
        rows.append(row)
    print(
        f"W=2 gloo ranks, 1 thread each, b={B}/rank, D={D}, fp32, chunk_size={args.chunk}, "
        f"row_block={args.row_block}, default allocator, {args.rounds} rounds (median; range of the rounds' ratios)"
    )
    print(table(rows, list(rows[0])))
    if not args.skip_w1:
        c = args.classes[0]
        pairs = [
            (
                measure("ours", c, args.chunk, args.row_block, args.iters, world=1, batch=2 * B)[0],
                measure("linear_ce", c, args.chunk, args.row_block, args.iters, world=1, batch=2 * B)[0],
            )
            for _ in range(args.rounds)
        ]
        ratios = sorted(o / r for o, r in pairs)
        print(
            f"\nW=1, B={2 * B}, C={c:,}: ours {statistics.median(o for o, _ in pairs) * 1e3:.0f} ms, "
            f"F.linear_cross_entropy (batch_chunk_size=64, no margin) "
            f"{statistics.median(r for _, r in pairs) * 1e3:.0f} ms: ours/theirs {statistics.median(ratios):.2f} "
            f"(rounds {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )


def compare_margins(args) -> None:
    c = args.classes[0]
    times = {m: measure(f"margin:{m}", c, args.chunk, args.row_block, args.iters)[0] for m in MARGINS}
    print(f"W=2 gloo ranks, b={B}/rank, D={D}, C={c:,}, chunk_size={args.chunk}, row_block={args.row_block}")
    rows = [
        {"margin": m, "ms": f"{t * 1e3:.0f}", "x arcface": f"{t / times['arcface']:.2f}"}
        for m, t in times.items()
    ]
    print(table(rows, ["margin", "ms", "x arcface"]))


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Where the head's step time goes, by op, on whatever device there is; and, with --sweep, its
step time over tile (`chunk_size`) and `row_block` beside PFC v2 at the same shapes.

One rank's shapes of an 8-GPU job (benchmarks/gpu.py's HEAD_CASES): the global batch of
gpus x batch embeddings (D=512, fp32) against the rank's class shard, ArcFace s=64 m=0.5.
The profile (torch.profiler over --iters steps after --warmup) prints per step:
- the step's time (CUDA events on a GPU, the wall clock on the CPU) and the host's own time
  to issue it (on a GPU: wall clock of the steps with no synchronisation between them, so
  host time >= step time means the launches, not the kernels, set the pace);
- the time in the three GEMMs (matrix-product kernels / ops) and in everything else, by op,
  the largest first, with the number of launches;
- the passes over the shard's C x D values by op (tests/shard_passes.py; the GEMMs apart), and
  what each costs in bytes at 1M classes per rank, D = 512, fp32, where memory sets the pace.

`--graph` (CUDA only): the step eager against the same forward and backward captured once in
a CUDA graph and replayed, PFC v2 beside: how much of the step the launches cost.

`--harness`: instead, one rank of benchmarks/head.py's side-by-side run on the CPU (W = 2
ranks x b = 128 rows, 100k classes: 50,000 classes per rank, chunk_size 2048, row_block 128,
one thread), with the three bare GEMMs at the same shapes (its limit) timed in turn beside
it: the ratio that run measures, and its non-GEMM time by op, in one process.

Run from the repository root: `.venv/bin/python benchmarks/head_profile.py [--case Glint360K]`
or `.venv/bin/python benchmarks/head_profile.py --harness`.
`--smoke` shrinks the classes 500-fold (what `make test` runs, so the script cannot rot).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import common  # noqa: F401,I001  (puts the repository root on sys.path)
import torch
from common import MB, table
from gpu import HEAD_CASES, D, _base_config, _process_group, _timed

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::matmul", "aten::linear")
GEMM_KERNELS = ("gemm", "cutlass", "cublas", "sm90_xmma", "nvjet")


# benchmarks/head.py's default run, one rank of it: 2 ranks x 128 rows, 100k classes
HARNESS = {"ranks": 2, "batch": 128, "classes": 100_000, "chunk_size": 2048, "row_block": 128}
BYTES_PER_PASS = 1_000_000 * D * 4  # bytes of one pass over a 1M-class fp32 shard at D = 512


def build(case: str, method: str, device, gpus: int, batch: int, divisor: int, chunk: int, row_block: int):
    from pfc_v2_reference import PFCv2Reference

    from shardface.heads import PartialFC, SampledRowsOptimizer
    from shardface.losses import CombinedMarginLoss

    classes, rate = HEAD_CASES[case] if case != "harness" else (HARNESS["classes"] // HARNESS["ranks"], 1.0)
    classes //= divisor
    per_rank = -(-classes // gpus) if case != "harness" else classes
    torch.manual_seed(0)
    margin = CombinedMarginLoss(64.0, 1.0, 0.5, 0.0)
    if method == "pfc_v2":
        head, opt = PFCv2Reference(margin, D, int(rate * per_rank) if rate < 1 else per_rank).to(device), None
    else:
        head = PartialFC(
            margin, D, per_rank, rate, chunk_size=chunk or None, row_block=row_block, validate=False
        ).to(device)
        opt = SampledRowsOptimizer(head, torch.optim.SGD, lr=0.0)
    emb = torch.randn(gpus * batch, D, device=device, requires_grad=True)
    labels = torch.randint(0, head.weight.shape[0], (gpus * batch,), device=device)

    def step():
        head.weight.grad, emb.grad = None, None
        if opt is not None:
            opt.zero_grad()
        head(emb, labels).backward()

    step.head, step.rows, step.emb, step.labels = head, gpus * batch, emb, labels
    return step, per_rank


def bare_gemms(classes: int, rows: int, device):
    """The three products of an exact head at the same shapes, bare (benchmarks/head.py's limit)."""
    weight = torch.normal(0, 0.01, (classes, D), device=device)
    emb = torch.randn(rows, D, device=device)

    def step():
        logits = emb @ weight.t()
        logits.mul_(1e-3)  # stands in for the softmax gradient, in place
        emb.grad = logits @ weight
        weight.grad = logits.t() @ emb

    return step


def shard_passes(step) -> dict[str, float] | None:
    """Passes over the shard's rows by op in one step (tests/shard_passes.py), or None where the
    shapes would let the counter take the batch's rows for weight rows."""
    from tests.shard_passes import GEMMS, ShardPassCounter

    head = step.head
    if not hasattr(head, "plan"):
        return None
    k, tile = head.subcenters, head.plan.tile
    used = head.num_sample if head.sample_rate < 1 else head.num_local
    weight_rows = {head.num_local * k, used * k} | {min(tile, used - c0) * k for c0 in range(0, used, tile)}
    if weight_rows & {step.rows, step.rows * k, min(step.rows, D), head.plan.row_block} or D in weight_rows:
        return None
    with ShardPassCounter(D, weight_rows, head.num_local * k) as count:
        step()
    passes = count.passes
    return {
        "GEMM (all)": sum(v for op, v in passes.items() if op in GEMMS),
        **{op: v for op, v in passes.items() if op not in GEMMS},
    }


def host_ms(step, device, iters: int) -> float:
    """Host time per step to issue `iters` steps back to back (no synchronisation between)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize()
    return elapsed * 1e3 / iters


def by_op(step, device, iters: int) -> tuple[dict, dict]:
    """{op or kernel: (ms per step, launches per step)}, split into GEMM and the rest."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            step()
        if cuda:
            torch.cuda.synchronize()
    gemm, rest = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    if cuda:  # device kernels: each event is one launch
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                name = ev.name[:70]
                into = gemm if any(k in name.lower() for k in GEMM_KERNELS) else rest
                into[name][0] += ev.device_time / 1e3
                into[name][1] += 1
    else:  # CPU ops, self time (leaves of the dispatcher carry the work)
        for ev in prof.key_averages():
            if ev.self_cpu_time_total <= 0 or not ev.key.startswith("aten::"):
                continue
            into = gemm if ev.key in GEMM_OPS else rest
            into[ev.key][0] += ev.self_cpu_time_total / 1e3
            into[ev.key][1] += ev.count
    norm = lambda d: {k: (v[0] / iters, v[1] / iters) for k, v in d.items()}  # noqa: E731
    return norm(gemm), norm(rest)


def profile_case(args, device) -> None:
    step, per_rank = build(
        args.case, "ours", device, args.gpus, args.batch, args.divisor, args.chunk_size, args.row_block
    )
    times, peak = _timed(step, device, args.warmup, args.iters)
    issue = host_ms(step, device, args.iters)
    gemm, rest = by_op(step, device, args.iters)
    g_ms, r_ms = sum(v[0] for v in gemm.values()), sum(v[0] for v in rest.values())
    launches = sum(v[1] for v in gemm.values()) + sum(v[1] for v in rest.values())
    print(
        f"\n{args.case}: {per_rank:,} classes/rank, {args.gpus * args.batch} x {D}, chunk_size "
        f"{args.chunk_size}, row_block {args.row_block}"
    )
    print(
        f"step {statistics.median(times):.2f} ms, host issue {issue:.2f} ms/step, "
        f"{'kernels' if device.type == 'cuda' else 'ops'} {launches:.0f}/step; "
        f"GEMM {g_ms:.2f} ms, the rest {r_ms:.2f} ms ({r_ms / max(g_ms, 1e-9):.2f}x GEMM)"
        + (f", peak {peak / MB:.0f} MB" if peak else "")
    )
    rows = [
        {"op": k, "ms/step": f"{v[0]:.3f}", "calls/step": f"{v[1]:.0f}", "GEMM": "yes" if k in gemm else ""}
        for k, v in sorted({**gemm, **rest}.items(), key=lambda kv: -kv[1][0])[: args.top]
    ]
    print(table(rows, ["op", "ms/step", "calls/step", "GEMM"]))
    print_passes(step)


def print_passes(step) -> None:
    passes = shard_passes(step)
    if passes is None:
        return
    print(
        "passes over the shard by op (ops touching its C x D values, in units of them; gathers and scatters\n"
        "by the rows they move), and the bytes of those values at 1M classes x D=512 in fp32: what each op\n"
        "moves at least on a GPU, where memory sets the pace (an in-place op reads and writes them):"
    )
    rows = [
        {"op": op, "passes/step": f"{p:.2f}", "GB at 1M classes": f"{p * BYTES_PER_PASS / 1e9:.1f}"}
        for op, p in sorted(passes.items(), key=lambda kv: -kv[1])
    ]
    print(table(rows, ["op", "passes/step", "GB at 1M classes"]))


def harness(args, device) -> None:
    """One rank of benchmarks/head.py, with its limit (the three bare GEMMs) timed in turn."""
    torch.set_num_threads(1)
    batch = HARNESS["ranks"] * HARNESS["batch"]
    step, per_rank = build(
        "harness", "ours", device, 1, batch, args.divisor, HARNESS["chunk_size"], HARNESS["row_block"]
    )
    limit = bare_gemms(per_rank, batch, device)
    ours_t, limit_t = [], []
    for it in range(args.warmup + args.iters):  # in turn, so both see the same machine
        for fn, into in ((limit, limit_t), (step, ours_t)):
            start = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if it >= args.warmup:
                into.append((time.perf_counter() - start) * 1e3)
    ratios = sorted(o / g for o, g in zip(ours_t, limit_t))
    gemm, rest = by_op(step, device, args.iters)
    g_ms, r_ms = sum(v[0] for v in gemm.values()), sum(v[0] for v in rest.values())
    print(
        f"\nbenchmarks/head.py's one rank: {per_rank:,} classes, {batch} x {D}, chunk_size "
        f"{HARNESS['chunk_size']}, row_block {HARNESS['row_block']}, {torch.get_num_threads()} thread"
    )
    print(
        f"the three bare GEMMs {statistics.median(limit_t):.1f} ms, ours {statistics.median(ours_t):.1f} ms: "
        f"ours/limit {statistics.median(ratios):.3f} (steps in turn: {ratios[0]:.3f}-{ratios[-1]:.3f})"
    )
    print(
        f"ours by op (torch.profiler, self time): GEMM {g_ms:.2f} ms, the rest {r_ms:.2f} ms "
        f"({r_ms / max(g_ms, 1e-9):.2f}x GEMM)"
    )
    rows = [
        {"op": k, "ms/step": f"{v[0]:.3f}", "calls/step": f"{v[1]:.0f}", "GEMM": "yes" if k in gemm else ""}
        for k, v in sorted({**gemm, **rest}.items(), key=lambda kv: -kv[1][0])[: args.top]
    ]
    print(table(rows, ["op", "ms/step", "calls/step", "GEMM"]))
    print_passes(step)


def sweep(args, device) -> None:
    rows = []
    base, _ = build(args.case, "pfc_v2", device, args.gpus, args.batch, args.divisor, 0, 0)
    t, peak = _timed(base, device, args.warmup, args.iters)
    ref = statistics.median(t)
    rows.append(
        {
            "head": "pfc_v2",
            "ms": f"{ref:.2f}",
            "vs pfc_v2": "1.00",
            "peak MB": f"{peak / MB:.0f}" if peak else "n/a",
        }
    )
    del base
    for chunk in args.chunks:
        for rb in args.row_blocks:
            step, _ = build(args.case, "ours", device, args.gpus, args.batch, args.divisor, chunk, rb)
            t, peak = _timed(step, device, args.warmup, args.iters)
            ms = statistics.median(t)
            rows.append(
                {
                    "head": f"ours {chunk}/{rb}",
                    "ms": f"{ms:.2f}",
                    "vs pfc_v2": f"{ms / ref:.2f}",
                    "peak MB": f"{peak / MB:.0f}" if peak else "n/a",
                    "host ms": f"{host_ms(step, device, args.iters):.2f}",
                }
            )
            del step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print(f"\n{args.case} sweep (ours chunk_size/row_block), {args.gpus * args.batch} x {D}, fp32")
    print(table(rows, ["head", "ms", "vs pfc_v2", "peak MB", "host ms"]))


def captured(step):
    """The step's forward and backward captured in one CUDA graph (warmed up on a side stream
    first, as capture requires): replaying it issues the whole step in one launch."""
    head, emb, labels = step.head, step.emb, step.labels
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            head.weight.grad, emb.grad = None, None
            head(emb, labels).backward()
    torch.cuda.current_stream().wait_stream(side)
    head.weight.grad, emb.grad = None, None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        head(emb, labels).backward()
    return graph


def graph_case(args, device) -> bool:
    """Eager step against the same step replayed from a CUDA graph, PFC v2 beside: what the
    launches cost. The graph's embedding gradient is checked against the eager step's. False
    when a capture failed: that leaves the process's CUDA state unfit for more cases."""
    rows, ok = [], True
    for method in ("ours", "pfc_v2"):  # ours first: a capture that fails could spoil what follows
        step, per_rank = build(
            args.case, method, device, args.gpus, args.batch, args.divisor, args.chunk_size, args.row_block
        )
        eager = statistics.median(_timed(step, device, args.warmup, args.iters)[0])
        step()
        reference = step.emb.grad.clone()
        row = {
            "data set": args.case,
            "head": method,
            "eager ms": f"{eager:.2f}",
            "eager host ms": f"{host_ms(step, device, args.iters):.2f}",
        }
        try:
            graph = captured(step)
        except Exception as e:  # noqa: BLE001  (a capture that fails is the finding, not a crash)
            row["graph ms"] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            ok = False
        else:
            ms = statistics.median(_timed(graph.replay, device, args.warmup, args.iters)[0])
            sampled = method == "ours" and HEAD_CASES[args.case][1] < 1  # PFC v2's reference never samples
            err = (step.emb.grad - reference).abs().max() / reference.abs().max()
            row.update(
                {
                    "graph ms": f"{ms:.2f}",
                    "eager/graph": f"{eager / ms:.2f}",
                    "grad_emb rel. diff": "n/a (resampled)" if sampled else f"{err:.1e}",
                }
            )
            del graph
        rows.append(row)
        del step, reference
        torch.cuda.empty_cache()
    print(f"\n{args.case}: {per_rank:,} classes/rank, eager step against its CUDA graph replayed, fp32")
    print(
        table(
            rows,
            [
                "data set",
                "head",
                "eager ms",
                "eager host ms",
                "graph ms",
                "eager/graph",
                "grad_emb rel. diff",
            ],
        )
    )
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", choices=sorted(HEAD_CASES), nargs="+", default=["Glint360K"])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument(
        "--chunk_size", type=int, default=_base_config().chunk_size, help="default: configs/schema.py's"
    )
    p.add_argument(
        "--row_block", type=int, default=_base_config().row_block, help="default: configs/schema.py's"
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=20)
    p.add_argument(
        "--sweep", action="store_true", help="step time over --chunks x --row_blocks, PFC v2 beside"
    )
    p.add_argument("--chunks", type=int, nargs="+", default=[8192, 32768, 1 << 20])
    p.add_argument("--row_blocks", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument(
        "--harness",
        action="store_true",
        help="one rank of benchmarks/head.py on the CPU (one thread) beside its three bare GEMMs",
    )
    p.add_argument(
        "--graph",
        action="store_true",
        help="CUDA only: the step eager against the step replayed from a CUDA graph, PFC v2 beside",
    )
    p.add_argument("--smoke", action="store_true", help="classes / 500, 2 steps (figures mean nothing)")
    args = p.parse_args(argv)
    args.divisor = 500 if args.smoke else 1
    if args.smoke:
        args.warmup, args.iters, args.gpus, args.batch = 1, 2, 2, 8
    if args.harness:
        _process_group()
        print(f"CPU, torch {torch.__version__}")
        harness(args, torch.device("cpu"))
        return 0
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if args.graph and device.type != "cuda":
        print("--graph: CUDA graphs need a CUDA device; none here")
        return 0
    if device.type == "cuda":
        torch.cuda.set_device(device)
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    else:
        print(f"CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    _process_group()
    cases = args.case
    for case in cases:
        args.case = case
        if args.graph:
            if not graph_case(args, device) and case != cases[-1]:
                print(
                    "a failed capture spoils this process's CUDA state: run the other cases with --case, "
                    "one per process"
                )
                break
            continue
        profile_case(args, device)
        if args.sweep:
            sweep(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

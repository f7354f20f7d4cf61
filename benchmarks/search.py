"""Exact 1:N search: ours (infer.search.ExactIndex, float32 and float16 storage) against faiss-cpu's
IndexFlatIP on a gallery of --size x --dim random unit vectors, --queries queries at once, top --k.

Each engine runs in its own process (so its memory is its own): the gallery is generated and
added in chunks (never held twice), then the queries are searched --repeat times. Printed per
engine: queries per second (best repeat), memory = peak resident growth over the process's
start (gallery storage included), and the ratio to faiss. The results of the engines are
compared (top-1 ids; fp16 may differ where two scores are within its rounding).

--grid times both engines side by side in one process over galleries of 10k, 100k and 1M,
1, 10, 100 and 1000 queries, 1 thread and all, float32 and float16 storage (faiss's float16 is
IndexScalarQuantizer QT_fp16): per cell, ms per search of the whole batch for each engine (the
best of up to --repeat runs, the engines taking turns), their ratio, the faster one and the
share of result ids the two agree on. Each gallery is generated once and added to both
engines; the float16 indexes are filled from the float32 one. It ends with the rule
infer.search.FASTER in the form to paste there. --quick: the 10k gallery only.

    .venv/bin/python benchmarks/search.py                  # 1M x 512, 2 threads
    .venv/bin/python benchmarks/search.py --size 20000     # a quick check
    .venv/bin/python benchmarks/search.py --grid           # the table behind engine "auto"
    .venv/bin/python benchmarks/search.py --grid --quick   # a quick check of the grid
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import time

import numpy as np
from common import MB, peak_bytes, reset_peak, rss_bytes

CHUNK = 65536
SIZES = (10_000, 100_000, 1_000_000)
QUERIES = (1, 10, 100, 1000)


def _vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _run(engine: str, size: int, dim: int, queries: int, k: int, repeat: int, threads: int, out) -> None:
    import faiss
    import torch

    from shardface.infer.search import make_index

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    rng = np.random.default_rng(0)
    q = _vectors(rng, queries, dim)
    reset_peak()
    start_rss = rss_bytes()
    index = make_index(dim, "faiss" if engine == "faiss" else "exact", fp16=engine == "ours-fp16")
    for start in range(0, size, CHUNK):
        index.add(_vectors(rng, min(CHUNK, size - start), dim))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        scores, ids = index.search(q, k)
        times.append(time.perf_counter() - t0)
    out.put((engine, queries / min(times), (peak_bytes() - start_rss) / MB, ids[:, 0].copy()))


def _timed(search, queries: np.ndarray, k: int):
    t0 = time.perf_counter()
    result = search(queries, k)
    return time.perf_counter() - t0, result


def _cells(
    size: int,
    precision: str,
    ours,
    theirs,
    queries: dict,
    k: int,
    repeat: int,
    budget: float,
    thread_counts: tuple,
) -> list[dict]:
    """One row per (threads, queries): both engines' best time over runs taken in turns, so that
    what else the machine does falls on both alike. A run longer than `budget` seconds is not
    repeated (its first run is its time); shorter ones repeat until `budget` or `repeat` runs."""
    import faiss
    import torch

    rows = []
    for threads in thread_counts:
        torch.set_num_threads(threads)
        faiss.omp_set_num_threads(threads)
        for n, q in queries.items():
            t_ours, (s_ours, i_ours) = _timed(ours.search, q, k)
            t_faiss, (s_faiss, i_faiss) = _timed(theirs.search, q, k)
            times = {"ours": [t_ours], "faiss": [t_faiss]}
            if max(t_ours, t_faiss) < budget:  # the first runs were warm-ups: only repeats count
                times = {"ours": [], "faiss": []}
                while len(times["ours"]) < repeat and sum(times["ours"]) + sum(times["faiss"]) < budget:
                    times["ours"].append(_timed(ours.search, q, k)[0])
                    times["faiss"].append(_timed(theirs.search, q, k)[0])
            ms_ours, ms_faiss = 1e3 * min(times["ours"]), 1e3 * min(times["faiss"])
            rows.append(
                {
                    "gallery": size,
                    "queries": n,
                    "threads": threads,
                    "precision": precision,
                    "ours ms": ms_ours,
                    "faiss ms": ms_faiss,
                    "faiss / ours": ms_faiss / ms_ours,
                    "faster": "exact" if ms_ours <= ms_faiss else "faiss",
                    "same ids": float((i_ours == i_faiss).mean()),
                    "max score diff": float(np.abs(s_ours - s_faiss).max()),
                }
            )
            print(
                f"  {size} x {n} queries, {threads} threads, {precision}: ours {ms_ours:.1f} ms, "
                f"faiss {ms_faiss:.1f} ms",
                flush=True,
            )
    return rows


def grid(sizes, dim: int, k: int, repeat: int, budget: float) -> list[dict]:
    from shardface.infer.search import make_index

    every = len(os.sched_getaffinity(0))
    thread_counts = (1, every) if every > 1 else (1,)
    rows = []
    for size in sizes:
        rng = np.random.default_rng(size)
        ours, theirs = make_index(dim, "exact"), make_index(dim, "faiss")
        for start in range(0, size, CHUNK):  # generated once, never held beside the two indexes
            chunk = _vectors(rng, min(CHUNK, size - start), dim)
            ours.add(chunk)
            theirs.add(chunk)
        queries = {n: _vectors(rng, n, dim) for n in QUERIES}
        rows += _cells(size, "fp32", ours, theirs, queries, k, repeat, budget, thread_counts)
        del theirs
        ours16, theirs16 = make_index(dim, "exact", fp16=True), make_index(dim, "faiss", fp16=True)
        for block in ours.blocks:  # the same gallery, from the float32 index
            ours16.add(block.numpy())
            theirs16.add(block.numpy())
        del ours
        rows += _cells(size, "fp16", ours16, theirs16, queries, k, repeat, budget, thread_counts)
    return rows


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def print_grid(rows: list[dict], dim: int, k: int, load: tuple) -> None:
    import faiss
    import torch

    print(
        f"\n{datetime.date.today()}: {_cpu()}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}, "
        f"faiss {faiss.__version__}; {dim}-D, top {k}; load average {load[0]:.1f} before, "
        f"{os.getloadavg()[0]:.1f} after\n"
    )
    print("| gallery | queries | threads | storage | ours ms | faiss ms | faiss / ours | faster | same ids |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gallery']:,} | {r['queries']} | {r['threads']} | {r['precision']} | {r['ours ms']:.1f} | "
            f"{r['faiss ms']:.1f} | {r['faiss / ours']:.2f} | {r['faster']} | {r['same ids']:.4f} |"
        )
    print(
        "\ninfer.search.FASTER (per gallery and queries: 1 thread fp32, all fp32, 1 thread fp16, all fp16):"
    )
    print("FASTER = {")
    cells = {
        (r["gallery"], r["queries"], r["threads"] > 1, r["precision"] == "fp16"): r["faster"] for r in rows
    }
    for size in dict.fromkeys(r["gallery"] for r in rows):
        for n in QUERIES:
            picks = tuple(
                cells.get((size, n, many, fp16), cells.get((size, n, False, fp16)))
                for fp16 in (False, True)
                for many in (False, True)
            )
            quoted = ", ".join(f'"{e}"' for e in picks)
            print(f"    ({size:_}, {n}): ({quoted}),")
    print("}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=1_000_000, help="gallery vectors")
    p.add_argument("--dim", type=int, default=512, help="dimensions")
    p.add_argument("--queries", type=int, default=1000, help="queries searched at once")
    p.add_argument("--k", type=int, default=10, help="candidates per query")
    p.add_argument("--repeat", type=int, default=3, help="timed searches (the best is kept)")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and faiss")
    p.add_argument(
        "--grid",
        action="store_true",
        help="both engines over the grid of sizes, queries, threads "
        "and storage, in one process (--size, --queries and --threads are the grid's)",
    )
    p.add_argument("--quick", action="store_true", help="with --grid: the 10k gallery only")
    p.add_argument("--budget", type=float, default=2.0, help="with --grid: seconds of repeats per cell")
    args = p.parse_args()
    if args.grid:
        load = os.getloadavg()
        rows = grid(SIZES[:1] if args.quick else SIZES, args.dim, args.k, args.repeat, args.budget)
        print_grid(rows, args.dim, args.k, load)
        return
    ctx = mp.get_context("spawn")
    results = {}
    for engine in ("faiss", "ours", "ours-fp16"):
        out = ctx.Queue()
        proc = ctx.Process(
            target=_run,
            args=(engine, args.size, args.dim, args.queries, args.k, args.repeat, args.threads, out),
        )
        proc.start()
        results[engine] = out.get()
        proc.join()
    storage = args.size * args.dim * 4 / MB
    print(
        f"gallery {args.size} x {args.dim} (float32 {storage:.0f} MB), {args.queries} queries, k={args.k}, "
        f"{args.threads} threads"
    )
    print("| engine | queries/s | time / faiss time | memory MB | top-1 ids equal to faiss |")
    print("|---|---|---|---|---|")
    base_qps, base_ids = results["faiss"][1], results["faiss"][3]
    for engine, qps, mem, ids in results.values():
        print(f"| {engine} | {qps:.1f} | {base_qps / qps:.2f} | {mem:.0f} | {(ids == base_ids).mean():.4f} |")


if __name__ == "__main__":
    main()

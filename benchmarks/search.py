"""Exact 1:N search: ours (infer.search.ExactIndex, float32 and float16 storage) against faiss-cpu's
IndexFlatIP on a gallery of --size x --dim random unit vectors, --queries queries at once, top --k.

Each engine runs in its own process (so its memory is its own): the gallery is generated and
added in chunks (never held twice), then the queries are searched --repeat times. Printed per
engine: queries per second (best repeat), memory = peak resident growth over the process's
start (gallery storage included), and the ratio to faiss. The results of the engines are
compared (top-1 ids; fp16 may differ where two scores are within its rounding).

    .venv/bin/python benchmarks/search.py                  # 1M x 512, 2 threads
    .venv/bin/python benchmarks/search.py --size 20000     # a quick check
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import numpy as np
from common import MB, peak_bytes, reset_peak, rss_bytes

CHUNK = 65536


def _vectors(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    x = rng.standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _run(engine: str, size: int, dim: int, queries: int, k: int, repeat: int, threads: int, out) -> None:
    import faiss
    import torch

    from infer.search import make_index
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=1_000_000, help="gallery vectors")
    p.add_argument("--dim", type=int, default=512, help="dimensions")
    p.add_argument("--queries", type=int, default=1000, help="queries searched at once")
    p.add_argument("--k", type=int, default=10, help="candidates per query")
    p.add_argument("--repeat", type=int, default=3, help="timed searches (the best is kept)")
    p.add_argument("--threads", type=int, default=2, help="threads for torch and faiss")
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    results = {}
    for engine in ("faiss", "ours", "ours-fp16"):
        out = ctx.Queue()
        proc = ctx.Process(target=_run, args=(engine, args.size, args.dim, args.queries, args.k, args.repeat,
                                              args.threads, out))
        proc.start()
        results[engine] = out.get()
        proc.join()
    storage = args.size * args.dim * 4 / MB
    print(f"gallery {args.size} x {args.dim} (float32 {storage:.0f} MB), {args.queries} queries, k={args.k}, "
          f"{args.threads} threads")
    print("| engine | queries/s | time / faiss time | memory MB | top-1 ids equal to faiss |")
    print("|---|---|---|---|---|")
    base_qps, base_ids = results["faiss"][1], results["faiss"][3]
    for engine, qps, mem, ids in results.values():
        print(f"| {engine} | {qps:.1f} | {base_qps / qps:.2f} | {mem:.0f} | {(ids == base_ids).mean():.4f} |")


if __name__ == "__main__":
    main()

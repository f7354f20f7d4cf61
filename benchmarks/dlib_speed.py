#!/usr/bin/env python
"""Images per second of MODEL `dlib` (the torch port, 150x150 chips, one view) against dlib's
own descriptor on the same chips (`compute_face_descriptor` of a list of aligned chips: its
batched path), side by side in one run. `--threads 1` pins both to one thread (OMP for dlib's
BLAS, torch.set_num_threads for torch); the GPU, where there is one, is measured too.

    .venv/bin/python benchmarks/dlib_speed.py --threads 1 --images 64 --batch 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import common  # noqa: F401,I001
import numpy as np
import torch


def _rate(fn, images: int, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return images / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    from shardface.eval.verification import embed
    from shardface.infer.model import load_model

    chips = torch.randint(
        0, 256, (args.images, 3, 150, 150), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    embedder = load_model("dlib")
    rows = []
    for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        module = embedder.module.to(device)

        def ours():
            out = embed(chips, module, args.batch)
            if device == "cuda":
                torch.cuda.synchronize()
            return out

        rows.append((f"torch port ({device}, batch {args.batch})", _rate(ours, args.images, args.rounds)))
    try:
        import dlib

        from shardface.faces.models import model_file
        from shardface.infer.weights import DLIB_FILE

        net = dlib.face_recognition_model_v1(model_file(DLIB_FILE))
        hwc = [np.ascontiguousarray(c.permute(1, 2, 0).numpy()) for c in chips]
        rows.append(
            (
                "dlib (cpu, its batch)",
                _rate(lambda: net.compute_face_descriptor(hwc), args.images, args.rounds),
            )
        )
    except ImportError:
        rows.append(("dlib (not installed)", float("nan")))
    print(f"{args.images} chips 150x150, {args.threads} thread(s), median of {args.rounds} rounds")
    for name, rate in rows:
        print(f"{name:<40} {rate:8.1f} images/s")


if __name__ == "__main__":
    main()

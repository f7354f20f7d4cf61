#!/usr/bin/env python
"""Photos/s of scripts.align's work (decode, find the faces, warp and write each crop and the
report) on 1 and 2 worker processes (faces.workers), and where one process spends its time.

`python benchmarks/faces_workers.py FOLDER --limit 40` takes `--limit` photos spread evenly
over the sorted photos under FOLDER (every identity folder alike), and prints:
- the share of one process's time in decoding, detection, landmarks, warping, PNG encoding (and
  embedding the crops, in batches, with `--model`), measured by timing those calls in this
  process on the same photos (models loaded first);
- per worker count: the wall time of `align_into` (pool start included), the time to its first
  result (the pool's start: forks of the forkserver, which `warm_up` starts before the photos are
  read, as scripts.align starts it before it lists them), photos/s over the whole run and after the
  first result, and the ratio to one worker.
Timings on a shared machine move between runs; run it where nothing else runs for figures to
quote (the issue's are for the 6,300 CelebA photos)."""

from __future__ import annotations

import argparse
import collections
import io
import os
import tempfile
import time

import common  # noqa: F401,I001

import shardface.faces.detect as detect
from shardface.dataset.folders import walk_images
from shardface.faces.align import ARCFACE_112, align
from shardface.faces.detect import Detection, load_photo
from shardface.faces.workers import default_workers, warm_up
from shardface.scripts.align import align_into, crop_stems


def sample(folder: str, limit: int) -> list[str]:
    photos = sorted(os.path.relpath(p, folder) for p in walk_images(folder))
    if limit and limit < len(photos):
        photos = [photos[i * len(photos) // limit] for i in range(limit)]
    return photos


def stage_seconds(
    folder: str, photos: list[str], detection: Detection, model: str | None
) -> dict[str, float]:
    """Seconds per stage over `photos` in this process: the detector and the landmark
    predictor are wrapped with timers for the run (detection = detect_faces less landmarks)."""
    spent = collections.Counter()
    boxes, predictor = detect._boxes, detect.landmark_predictor

    def timed(fn, stage: str):
        def run(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[stage] += time.perf_counter() - t

        return run

    def timed_predictor(points):
        return timed(predictor(points), "landmarks")

    detect._boxes, detect.landmark_predictor = timed(boxes, "detection"), timed_predictor
    crops = []
    try:
        template = ARCFACE_112
        for photo in photos:
            t = time.perf_counter()
            img = load_photo(os.path.join(folder, photo))
            spent["decode"] += time.perf_counter() - t
            found = detection.faces(img)
            for face in found:
                t = time.perf_counter()
                crop = align(img, face.points, template)
                spent["warp"] += time.perf_counter() - t
                t = time.perf_counter()
                crop.save(io.BytesIO(), format="PNG")
                spent["png"] += time.perf_counter() - t
                crops.append(crop)
    finally:
        detect._boxes, detect.landmark_predictor = boxes, predictor
    if model and crops:
        import numpy as np
        import torch

        from shardface.infer.model import load_model

        loaded = load_model(model)
        images = torch.from_numpy(np.stack([np.asarray(c) for c in crops])).permute(0, 3, 1, 2).contiguous()
        loaded.embed_crops(images[:8], made_for=template)  # warm-up
        t = time.perf_counter()
        loaded.embed_crops(images, made_for=template)
        spent["embedding"] += time.perf_counter() - t
    return spent


def run_align(folder: str, photos: list[str], detection: Detection, workers: int) -> tuple[float, float]:
    """(seconds to the first result, seconds in all) of scripts.align's align_into."""
    first = []

    class Clock:
        def update(self, n: int = 1) -> None:
            if not first:
                first.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        align_into(folder, photos, out, detection, 112, False, Clock(), workers, names=crop_stems(photos))
        end = time.perf_counter()
    return first[0] - start, end - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", help="a folder of photos (e.g. one sub-folder per identity)")
    p.add_argument(
        "--limit", type=int, default=40, help="photos taken, spread evenly over the sorted list (0: all)"
    )
    p.add_argument("--workers", default="1,2", help="worker counts to time, comma-separated")
    p.add_argument("--detector", default="hog", help="hog or mmod")
    p.add_argument("--upsample", type=int, default=1, help="the detector's upsampling")
    p.add_argument("--model", default=None, help="also time embedding the crops with this MODEL (CPU or GPU)")
    args = p.parse_args()
    detection = Detection(args.detector, args.upsample)
    photos = sample(args.folder, args.limit)
    detect.check_available(detection.detector, detection.landmarks)
    print(
        f"{len(photos)} photos of {args.folder}; {default_workers()} cores available; detector "
        f"{args.detector}, upsample {args.upsample}"
    )

    warm_up(align_into, max(int(w) for w in args.workers.split(",")))  # as scripts.align does, at its start
    for photo in photos:  # in the page cache, for every run alike
        with open(os.path.join(args.folder, photo), "rb") as f:
            f.read()
    runs, base = [], None
    for workers in (int(w) for w in args.workers.split(",")):
        to_first, wall = run_align(args.folder, photos, detection, workers)
        steady = (len(photos) - 1) / max(wall - to_first, 1e-9)
        base = base or (wall, steady)
        runs.append(
            f"workers {workers}: {wall:.1f} s, first result after {to_first:.1f} s; {len(photos) / wall:.1f} "
            f"photos/s in all, {steady:.1f} after the first; x{base[0] / wall:.2f} in all, "
            f"x{steady / base[1]:.2f} after the first (against the first count)"
        )
    spent = stage_seconds(args.folder, photos, detection, args.model)
    total = sum(spent.values())
    print(
        "one process, share of time: "
        + ", ".join(
            f"{k} {100 * v / total:.0f}% ({1000 * v / len(photos):.0f} ms/photo)"
            for k, v in spent.most_common()
        )
    )
    print("\n".join(runs))


if __name__ == "__main__":
    main()

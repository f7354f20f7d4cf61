#!/usr/bin/env python
"""MODEL `dlib`'s same/different verdict beside face_recognition's rule, on every pair of N real
photos: `compare_faces(tolerance=0.6)`, Euclidean distance at most 0.6 between dlib's raw
descriptors of the two photos' faces.

    .venv/bin/python benchmarks/dlib_verdict.py --images LFW_FOLDER [--photos 700]

- **the rule**: dlib's own pipeline (face_recognition's: HOG with one upsampling, the 5-point
  shape predictor, `compute_face_descriptor`), the largest face of each photo;
- **ours**: `Model.compare`'s verdict, `score >= model.threshold.value` on `load_model("dlib")`'s
  embeddings of the same photos' largest faces, without the flip test (its default for `dlib`) and
  with it.

Photos: LFW's people with at least two photos, in name order, their first four photos at most,
until `--photos`; pairs: every pair of those where both pipelines found a face; same person: the
same LFW name. Printed: the agreement with the rule, impostor pairs accepted (the false-accept
rate) and genuine pairs accepted, beside the rule's; the raw descriptors' norms; and the cosine
at which a unit-vector rule agrees best with the rule on these pairs. LFW is for research use:
nothing of it is written into the repository.
"""

from __future__ import annotations

import argparse
import os

import common  # noqa: F401,I001
import numpy as np
from lfw_anchor import dlib_own

from shardface.faces.workers import default_workers, map_photos
from shardface.infer.model import load_model
from shardface.infer.thresholds import DLIB_DISTANCE


def lfw_photos(folder: str, count: int, per_person: int = 4) -> tuple[list[str], np.ndarray]:
    photos, names = [], []
    for name in sorted(os.listdir(folder)):
        files = sorted(os.listdir(os.path.join(folder, name)))
        if len(files) < 2:
            continue
        for f in files[:per_person]:
            photos.append(os.path.join(folder, name, f))
            names.append(name)
        if len(photos) >= count:
            break
    return photos[:count], np.array(names[:count])


def verdicts(same: np.ndarray, rule: np.ndarray, genuine: np.ndarray) -> str:
    agree = float(np.mean(same == rule))
    far, gar = float(np.mean(same[~genuine])), float(np.mean(same[genuine]))
    return (
        f"agreement {agree:.4%}; says same where the rule says different: {int(np.sum(same & ~rule))}, "
        f"the other way: {int(np.sum(~same & rule))}; impostors accepted {far:.4%}; genuine accepted {gar:.4%}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", required=True, help="LFW's folder: FOLDER/name/name_000n.jpg")
    p.add_argument("--photos", type=int, default=700)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument("--cache", default=None, help="an .npz for the descriptors: a second run computes none")
    args = p.parse_args()

    photos, names = lfw_photos(args.images, args.photos)
    model = load_model("dlib")
    if args.cache and os.path.exists(args.cache):  # the descriptors of an earlier run of the same photos
        saved = np.load(args.cache)
        own = [None if np.isnan(r).any() else r for r in saved["own"]]
        ours = {False: saved["single"], True: saved["flip"]}
    else:
        own = list(map_photos(dlib_own, photos, workers=args.workers))
        ours = {flip: model.embed(photos, flip=flip, missing="nan") for flip in (False, True)}
        if args.cache:
            rows = [o if o is not None else np.full(128, np.nan, np.float32) for o in own]
            np.savez(args.cache, own=np.stack(rows), single=ours[False], flip=ours[True])
    keep = (
        np.array([o is not None for o in own]) & ~np.isnan(ours[True]).any(1) & ~np.isnan(ours[False]).any(1)
    )
    raw = np.stack([o for o, k in zip(own, keep) if k]).astype(np.float64)
    names = names[keep]
    i, j = np.triu_indices(len(raw), 1)
    genuine = names[i] == names[j]
    rule = np.linalg.norm(raw[i] - raw[j], axis=1) <= DLIB_DISTANCE
    norms = np.linalg.norm(raw, axis=1)
    print(
        f"{len(photos)} photos of {len(set(names))} people ({args.images}); {len(raw)} with a face in both "
        f"pipelines; {len(i)} pairs, {int(genuine.sum())} of the same person"
    )
    print(
        f"the rule (distance <= {DLIB_DISTANCE}): impostors accepted {np.mean(rule[~genuine]):.4%}; genuine accepted {np.mean(rule[genuine]):.4%}"
    )
    print(
        f"dlib's raw descriptor norms: mean {norms.mean():.4f}, median {np.median(norms):.4f}, "
        f"5-95% {np.percentile(norms, 5):.4f}-{np.percentile(norms, 95):.4f}"
    )
    print(f"MODEL dlib's threshold: cosine {model.threshold.value:.4f} ({model.threshold.source})")
    grid = np.arange(0.88, 0.94, 0.0005)
    for flip in (False, True):
        emb = ours[flip][keep].astype(np.float64)
        cos = np.sum(emb[i] * emb[j], axis=1)
        print(f"ours, flip {flip}: {verdicts(cos >= model.threshold.value, rule, genuine)}")
        best = max(grid, key=lambda t: np.mean((cos >= t) == rule))
        print(f"  at the cosine that agrees best, {best:.4f}: {verdicts(cos >= best, rule, genuine)}")
    derived = 1 - DLIB_DISTANCE**2 / (2 * np.median(norms) ** 2)
    unit = raw / norms[:, None]
    cos = np.sum(unit[i] * unit[j], axis=1)
    print(
        f"dlib's own as unit vectors, at the median norm's cosine {derived:.4f}: {verdicts(cos >= derived, rule, genuine)}"
    )


if __name__ == "__main__":
    main()

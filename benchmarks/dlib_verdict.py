#!/usr/bin/env python
"""MODEL `dlib`'s same/different verdict beside face_recognition's rule, on every pair of real
photos of held-out people: `compare_faces(tolerance=0.6)`, Euclidean distance at most 0.6 between
dlib's raw descriptors of the two photos' faces.

    .venv/bin/python benchmarks/dlib_verdict.py --images LFW_FOLDER [--photos 1400] [--cache F.npz]

- **the rule**: dlib's own pipeline (face_recognition's: HOG with one upsampling, the 5-point
  shape predictor, `compute_face_descriptor`), the largest face of each photo;
- **ours**: `load_model("dlib")`'s embeddings of the same photos' largest faces, with the flip
  test (the default) and without, judged `cosine >= threshold` as `Model.compare` judges them.

Photos: LFW's people with at least two photos, in name order, their first four photos at most,
until `--photos`. The people are split in two halves: on the first, the cosine that agrees best
with the rule is found for each embedding (the fit); on the second, other people, every pair is
judged at the fitted cosine and at MODEL dlib's threshold. Pairs: every pair of photos where both
pipelines found a face; same person: the same LFW name. Printed per half: agreement with the rule,
impostor pairs accepted (the false-accept rate) and genuine pairs accepted, beside the rule's; and
the raw descriptors' norms. LFW is for research use: nothing of it is written into the repository.
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

GRID = np.arange(0.88, 0.95, 0.0005)


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
    return photos, np.array(names)


def descriptors(photos: list[str], model, workers: int, cache: str | None) -> dict[str, np.ndarray]:
    """Per photo: dlib's own raw descriptor, ours without and with the flip test (NaN: no face)."""
    got = dict(np.load(cache)) if cache and os.path.exists(cache) else {}
    known = dict(zip(got.get("paths", []), range(len(got.get("paths", [])))))
    todo = [p for p in photos if p not in known]
    if todo:
        own = [
            r if r is not None else np.full(128, np.nan, np.float32)
            for r in map_photos(dlib_own, todo, workers=workers)
        ]
        new = {
            "own": np.stack(own),
            "single": model.embed(todo, flip=False, missing="nan"),
            "flip": model.embed(todo, flip=True, missing="nan"),
        }
        for key in new:
            got[key] = np.concatenate([got[key], new[key]]) if key in got else new[key]
        got["paths"] = np.concatenate([got["paths"], todo]) if "paths" in got else np.array(todo)
        known = dict(zip(got["paths"], range(len(got["paths"]))))
        if cache:
            np.savez(cache, **got)
    at = [known[p] for p in photos]
    return {key: got[key][at] for key in ("own", "single", "flip")}


def verdicts(same: np.ndarray, rule: np.ndarray, genuine: np.ndarray) -> str:
    far, gar = float(np.mean(same[~genuine])), float(np.mean(same[genuine]))
    return (
        f"agreement {np.mean(same == rule):.4%} (same where the rule says different: "
        f"{int(np.sum(same & ~rule))}, the other way: {int(np.sum(~same & rule))}); impostors accepted "
        f"{far:.4%}; genuine accepted {gar:.4%}"
    )


def pairs(names: np.ndarray, rows: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, dict]:
    """(the rule's verdicts, same person, each embedding's cosines) over every pair of the rows."""
    i, j = np.triu_indices(len(names), 1)
    raw = rows["own"].astype(np.float64)
    cos = {}
    for key in ("single", "flip"):
        e = rows[key].astype(np.float64)
        cos[key] = np.sum(e[i] * e[j], axis=1)
    return np.linalg.norm(raw[i] - raw[j], axis=1) <= DLIB_DISTANCE, names[i] == names[j], cos


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", required=True, help="LFW's folder: FOLDER/name/name_000n.jpg")
    p.add_argument("--photos", type=int, default=1400)
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument(
        "--cache", default=None, help="an .npz of the descriptors: a later run computes only new ones"
    )
    args = p.parse_args()

    photos, names = lfw_photos(args.images, args.photos)
    model = load_model("dlib")
    rows = descriptors(photos, model, args.workers, args.cache)
    keep = ~np.isnan(np.concatenate(list(rows.values()), axis=1)).any(1)
    rows, names = {k: v[keep] for k, v in rows.items()}, names[keep]
    people = sorted(set(names))
    first = np.isin(names, people[: len(people) // 2])
    norms = np.linalg.norm(rows["own"], axis=1)
    print(
        f"{len(photos)} photos of {len(people)} people ({args.images}), {len(names)} with a face in both "
        f"pipelines; dlib's raw descriptor norms: median {np.median(norms):.4f}, 5-95% "
        f"{np.percentile(norms, 5):.4f}-{np.percentile(norms, 95):.4f}"
    )
    halves = {}
    for what, part in (("fit", first), ("held out", ~first)):
        rule, genuine, cos = pairs(names[part], {k: v[part] for k, v in rows.items()})
        halves[what] = rule, genuine, cos
        print(
            f"{what}: {int(part.sum())} photos of {len(set(names[part]))} people, {len(rule)} pairs "
            f"({int(genuine.sum())} genuine); the rule accepts {np.mean(rule[~genuine]):.4%} of impostors, "
            f"{np.mean(rule[genuine]):.4%} of genuine pairs"
        )
    rule, genuine, cos = halves["fit"]
    fitted = {k: float(max(GRID, key=lambda t: np.mean((cos[k] >= t) == rule))) for k in cos}
    rule, genuine, cos = halves["held out"]
    for key, label in (("flip", "with the flip test (the default)"), ("single", "without the flip test")):
        print(f"ours {label}:")
        for t, why in (
            (fitted[key], "fitted on the first half"),
            (model.threshold.value, "MODEL dlib's threshold"),
        ):
            print(f"  held out, at {t:.4f} ({why}): {verdicts(cos[key] >= t, rule, genuine)}")


if __name__ == "__main__":
    main()

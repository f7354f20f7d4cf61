#!/usr/bin/env python
"""Which detector finds CFP's faces: the share of its 5,000 frontal and 2,000 profile photos in
which each detector option finds a face (issue 55, deliverable 3).

Options (`--options`, run in the order given):
- `hog0`, `hog1`, `hog2`: dlib's HOG detector at upsample 0, 1, 2 (the default is 1);
- `mmod0`, `mmod1`: dlib's CNN (MMOD) detector at upsample 0, 1;
- `mtcnn`: facenet-pytorch's MTCNN (five points, weights in its wheel). That package pins torch
  < 2.3, so it is not a dependency here: install it apart (`pip install --no-deps --target DIR
  facenet-pytorch tqdm requests`) and pass `--mtcnn_path DIR`.

Each photo's result (faces found, best score, largest box and its five points) is kept per
option in `CFP_ROOT/cfp.shardface_detect.OPTION.npz`, saved as it goes, so a run stopped is
resumed and a second run only prints. `--photos profile|frontal|all` limits the photos an option
runs on; `--after_misses A,B` runs it only where options A and B found none (the tools' retry
chain). The table counts every option over the photos it has run on, and the chain
hog1 -> hog2 -> mmod1 (verify's `--retry_upsample 2 --retry_mmod`) over all of them.

`--accuracy SPEC,...` then scores CFP's FP protocol (all 7,000 pairs, its 10 folds) with MODEL
`dlib` on the faces an option found: SPEC is an option, or options joined by `+` (each tried
where the ones before found none). Whatever box an option gives, dlib's 5-point shape is found in
it and dlib's chip cut from that shape, as face_recognition does with a box from any detector; a
photo where nothing was found gets the pair tools' fallback face (faces.fallback).

    .venv/bin/python benchmarks/cfp_detectors.py CFP_ROOT --options hog0,hog1,hog2,mmod0
    .venv/bin/python benchmarks/cfp_detectors.py CFP_ROOT --accuracy hog1,mtcnn,hog1+hog2+mmod1
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common  # noqa: F401,I001
import numpy as np

from shardface.eval.cfp import LISTS, read_cfp, read_photo_list
from shardface.faces.detect import detect_faces, face_in_box, load_photo

DLIB = {
    "hog0": ("hog", 0),
    "hog1": ("hog", 1),
    "hog2": ("hog", 2),
    "mmod0": ("mmod", 0),
    "mmod1": ("mmod", 1),
}
OPTIONS = (*DLIB, "mtcnn")
CHAIN = ("hog1", "hog2", "mmod1")


def result_path(root: str, option: str) -> str:
    return os.path.join(root, f"cfp.shardface_detect.{option}.npz")


def empty(n: int) -> dict:
    return {
        "count": np.full(n, -1, np.int32),
        "score": np.zeros(n),
        "box": np.zeros((n, 4)),
        "points": np.zeros((n, 5, 2)),
    }


def load(root: str, option: str, photos: list[str]) -> dict:
    path = result_path(root, option)
    if not os.path.exists(path):
        return empty(len(photos))
    with np.load(path) as z:
        if list(z["photos"]) != [os.path.relpath(p, root) for p in photos]:
            raise SystemExit(f"{path}: made for other photos; delete it to measure again")
        return {k: z[k].copy() for k in ("count", "score", "box", "points")}


def save(root: str, option: str, photos: list[str], res: dict) -> None:
    path = result_path(root, option)
    np.savez(path + ".tmp.npz", photos=np.array([os.path.relpath(p, root) for p in photos]), **res)
    os.replace(path + ".tmp.npz", path)


def detector(option: str, mtcnn_path: str | None):
    """One photo -> [(score, box, points 5 x 2)], largest first."""
    if option in DLIB:
        name, upsample = DLIB[option]
        return lambda img: [(f.score, f.box, f.points) for f in detect_faces(img, name, upsample)]
    if not mtcnn_path:
        raise SystemExit(
            "mtcnn: pass --mtcnn_path DIR, a folder facenet-pytorch is installed into (--no-deps)"
        )
    sys.path.insert(0, mtcnn_path)
    from facenet_pytorch import MTCNN

    net = MTCNN(keep_all=True, device="cpu")

    def found(img):
        boxes, probs, points = net.detect(img, landmarks=True)
        if boxes is None:
            return []
        faces = [
            (float(p), tuple(map(float, b)), np.asarray(q, np.float64))
            for b, p, q in zip(boxes, probs, points)
        ]
        return sorted(faces, key=lambda f: -(f[1][2] - f[1][0]) * (f[1][3] - f[1][1]))

    return found


def run(root: str, option: str, photos: list[str], todo: np.ndarray, mtcnn_path: str | None) -> dict:
    res = load(root, option, photos)
    pending = [i for i in np.flatnonzero(todo) if res["count"][i] < 0]
    if not pending:
        return res
    find, start, last = detector(option, mtcnn_path), time.time(), time.time()
    for n, i in enumerate(pending, 1):
        faces = find(load_photo(photos[i]))
        res["count"][i] = len(faces)
        if faces:
            score, box, points = faces[0]
            res["score"][i], res["box"][i], res["points"][i] = score, box, points
        if time.time() - last > 30 or n == len(pending):
            save(root, option, photos, res)
            last, rate = time.time(), n / (time.time() - start)
            print(
                f"  {option}: {n}/{len(pending)} photos, {rate:.2f}/s, ETA {(len(pending) - n) / rate / 60:.1f} min",
                flush=True,
            )
    return res


def table(results: dict, profile: np.ndarray) -> None:
    print("\n| option | frontal found | profile found |\n|---|---|---|")
    for option, res in results.items():
        cells = []
        for part in (~profile, profile):
            ran = part & (res["count"] >= 0)
            found = int((res["count"][ran] > 0).sum())
            cells.append(
                f"{found} / {int(ran.sum())} ({found / max(1, ran.sum()):.4f})" if ran.any() else "-"
            )
        print(f"| {option} | {cells[0]} | {cells[1]} |")
    if all(o in results for o in CHAIN):
        counts = [results[o]["count"] for o in CHAIN]
        found, known = np.zeros(len(profile), bool), np.ones(len(profile), bool)
        for c in counts:  # each step runs only where the ones before found none
            known &= found | (c >= 0)
            found |= c > 0
        cells = []
        for part in (~profile, profile):
            cells.append(
                f"{int(found[part].sum())} / {int(part.sum())} ({found[part].mean():.4f})"
                if known[part].all()
                else "not run on every photo yet"
            )
        print(f"| {' -> '.join(CHAIN)} | {cells[0]} | {cells[1]} |")


def chosen_faces(spec: str, results: dict, photos: list[str], which: list[int]) -> tuple[dict, list]:
    """({k: Face} for photo `which[k]` (an index into `photos` and the results) where the options
    of `spec` (joined by +) found one, the first that did, dlib's 5-point shape found in its box;
    every photo's size)."""
    faces, sizes = {}, []
    for k, i in enumerate(which):
        pixels = np.asarray(load_photo(photos[i]))
        sizes.append((pixels.shape[1], pixels.shape[0]))
        for option in spec.split("+"):
            res = results[option]
            if res["count"][i] < 0:
                raise SystemExit(f"--accuracy {spec}: {option} has not run on {photos[i]}")
            if res["count"][i] > 0:
                faces[k] = face_in_box(pixels, tuple(float(v) for v in res["box"][i]), float(res["score"][i]))
                break
    return faces, sizes


def accuracy(root: str, spec: str, results: dict, photos: list[str]) -> str:
    from shardface.eval.pairs import score_pairs
    from shardface.faces.fallback import Fallback
    from shardface.infer.model import load_model
    from shardface.infer.stream import analyse

    pairs = read_cfp(root, "FP")
    index = {os.path.abspath(p): i for i, p in enumerate(photos)}
    mine = [index[os.path.abspath(p)] for p in pairs.photos]
    found, sizes = chosen_faces(spec, results, photos, mine)
    fallback = Fallback.of([(found[k], sizes[k]) for k in found])
    faces = [[found.get(k) or fallback.face(sizes[k])] for k in range(len(mine))]
    rows = [
        p.face.embedding for p in analyse(load_model("dlib"), pairs.photos, faces=faces, raw=True, workers=2)
    ]
    res = score_pairs(pairs, np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))
    return (
        f"| {spec} | {len(mine) - len(found)} of {len(mine)} | {res.accuracy:.4f} ± {res.std:.4f} | "
        f"{res.accuracy_flip:.4f} ± {res.std_flip:.4f} |"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", help="the CFP root (Data/, Protocol/)")
    p.add_argument(
        "--options", default="", help=f"comma-separated, of {', '.join(OPTIONS)}; none: print the table"
    )
    p.add_argument("--photos", choices=("all", "frontal", "profile"), default="all")
    p.add_argument("--after_misses", default="", help="run only where these options found no face")
    p.add_argument("--mtcnn_path", default=None)
    p.add_argument("--accuracy", default="", help="FP accuracy with MODEL dlib on these options' faces")
    args = p.parse_args()
    protocol = os.path.join(args.root, "Protocol")
    frontal, profile = (read_photo_list(protocol, LISTS[k]) for k in ("F", "P"))
    photos = frontal + profile
    is_profile = np.arange(len(photos)) >= len(frontal)
    todo = {"all": np.ones(len(photos), bool), "frontal": ~is_profile, "profile": is_profile}[args.photos]
    for option in filter(None, args.after_misses.split(",")):
        before = load(args.root, option, photos)["count"]
        if (before[todo] < 0).any():
            raise SystemExit(f"--after_misses {option}: run it first on these photos")
        todo = todo & (before == 0)
    chosen = [o for o in args.options.split(",") if o]
    for option in chosen:
        if option not in OPTIONS:
            raise SystemExit(f"--options: {option!r} is not one of {', '.join(OPTIONS)}")
    for option in chosen:
        print(f"{option}: {int(todo.sum())} photos", flush=True)
        run(args.root, option, photos, todo, args.mtcnn_path)
    results = {o: load(args.root, o, photos) for o in OPTIONS if os.path.exists(result_path(args.root, o))}
    table(results, is_profile)
    if args.accuracy:
        print(
            f"\nCFP-FP, MODEL dlib, all {len(read_cfp(args.root, 'FP').issame):,} pairs (its 10 folds)\n\n"
            "| faces from | photos faceless (fallback) | accuracy | with flip |\n|---|---|---|---|"
        )
        for spec in args.accuracy.split(","):
            missing = [o for o in spec.split("+") if o not in results]
            if missing:
                raise SystemExit(f"--accuracy {spec}: run {', '.join(missing)} first")
            print(accuracy(args.root, spec, results, photos), flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Which people of a training set are LFW people too, found by their faces: where a set's people
are numbers (CelebA's), their names cannot be checked against LFW's.

    .venv/bin/python benchmarks/lfw_overlap.py --train CELEB_ID --lfw LFW --pairs_list pairs.txt \
        [--per_person 4] [--sheet candidates.png]

Each person is one template, the normalised mean of MODEL dlib's embeddings (no flip test) of the
largest faces in their first photos (`--per_person` of a training person, a sub-folder of `--train`;
`--lfw_per_person` of an LFW person, one named in the pair list). Every training person is compared with every LFW person.
A candidate is a pair of people who are each other's nearest template, at or above `--threshold`
(default MODEL dlib's own, the cosine of dlib's same-person rule on single photos). Printed: how
many pairs of templates reach the threshold at all, the candidates, best first, each with the
number of the list's pairs its LFW person is in, and how many of the list's pairs hold a
candidate's LFW person. `--sheet` draws the first `--show` candidates' photos side by side, to
look at. LFW and CelebA are for
research use: nothing of them is written into the repository.
"""

from __future__ import annotations

import argparse
import os
from collections import Counter

import common  # noqa: F401,I001
import numpy as np
from PIL import Image
from real_faces import pair_people

from shardface.faces.workers import default_workers
from shardface.infer.model import load_model
from shardface.infer.thresholds import DLIB_THRESHOLD
from shardface.utils.progress import progress_bar


def first_photos(folder: str, per_person: int) -> list[str]:
    return [os.path.join(folder, f) for f in sorted(os.listdir(folder))[:per_person]]


def templates(model, people: dict[str, list[str]], workers: int) -> tuple[list[str], np.ndarray]:
    """(names, one unit template per name) of the people with at least one face found."""
    photos = [p for files in people.values() for p in files]
    rows = {}
    with progress_bar(len(photos), "embedding") as bar:
        for photo in model.analyse(
            photos, workers=workers, flip=False, largest_only=True, progress=lambda: bar.update(1)
        ):
            if photo.face is not None:
                rows[photo.name] = photo.face.embedding
    names, out = [], []
    for name, files in people.items():
        found = [rows[f] for f in files if f in rows]
        if found:
            mean = np.mean(found, 0)
            names.append(name)
            out.append(mean / np.linalg.norm(mean))
    return names, np.stack(out)


def sheet(candidates, train: dict, lfw: dict, path: str, side: int = 112) -> None:
    """One row per candidate: the training person's photos, then the LFW person's."""
    width = max(len(train[t]) + len(lfw[n]) for t, n, _ in candidates) + 1
    out = Image.new("RGB", (width * side, len(candidates) * side), (255, 255, 255))
    for row, (t, n, _) in enumerate(candidates):
        for col, photo in enumerate([*train[t], None, *lfw[n]]):
            if photo is not None:
                out.paste(Image.open(photo).convert("RGB").resize((side, side)), (col * side, row * side))
    out.save(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", required=True, help="the training photos, one sub-folder per person")
    p.add_argument("--lfw", required=True, help="LFW's photo folder (NAME/NAME_000N.jpg)")
    p.add_argument("--pairs_list", required=True, help="LFW's pairs.txt: its people are the ones compared")
    p.add_argument(
        "--per_person", type=int, default=4, help="photos per training person's template (default 4)"
    )
    p.add_argument(
        "--lfw_per_person", type=int, default=4, help="photos per LFW person's template (default 4)"
    )
    p.add_argument(
        "--threshold", type=float, default=DLIB_THRESHOLD, help="candidate at or above this cosine"
    )
    p.add_argument("--sheet", default=None, help="a PNG of the candidates' photos side by side")
    p.add_argument("--show", type=int, default=20, help="candidates printed and drawn (default 20)")
    p.add_argument("--cache", default=None, help="an .npz keeping the templates, for a second look")
    p.add_argument("--workers", type=int, default=default_workers())
    args = p.parse_args()
    pairs = pair_people(args.pairs_list)
    counts = Counter(name for people in pairs for name in people)  # pairs each LFW person is in
    train = {
        t: first_photos(os.path.join(args.train, t), args.per_person)
        for t in sorted(os.listdir(args.train))
        if os.path.isdir(os.path.join(args.train, t))
    }
    lfw = {n: first_photos(os.path.join(args.lfw, n), args.lfw_per_person) for n in sorted(counts)}
    if args.cache and os.path.exists(args.cache):
        got = np.load(args.cache)
        train_names, train_t, lfw_names, lfw_t = (list(got["tn"]), got["tt"], list(got["ln"]), got["lt"])
    else:
        model = load_model("dlib")
        train_names, train_t = templates(model, train, args.workers)
        lfw_names, lfw_t = templates(model, lfw, args.workers)
        if args.cache:
            np.savez(args.cache, tn=train_names, tt=train_t, ln=lfw_names, lt=lfw_t)
    print(
        f"templates: {len(train_names)} of {len(train)} training people, {len(lfw_names)} of {len(lfw)} LFW people"
    )
    cos = train_t @ lfw_t.T
    best = cos.max(1)
    for q in (50, 90, 99, 100):
        print(f"each training person's best LFW cosine, {q}th percentile: {np.percentile(best, q):.4f}")
    print(f"pairs of templates at cosine >= {args.threshold:.4f}: {int((cos >= args.threshold).sum())}")
    # a person in both sets is each other's nearest: mutual nearest neighbours at or above the threshold
    their_best = cos.argmax(0)
    hits = sorted(
        (
            (train_names[i], lfw_names[j], float(cos[i, j]))
            for i, j in enumerate(cos.argmax(1))
            if their_best[j] == i and cos[i, j] >= args.threshold
        ),
        key=lambda c: -c[2],
    )
    print(f"candidates (mutual nearest, cosine >= {args.threshold:.4f}): {len(hits)}; the first {args.show}:")
    for t, n, c in hits[: args.show]:
        print(f"  {t:>8}  {n:<32} cosine {c:.4f}  in {counts[n]} pairs")
    people = {n for _, n, _ in hits}
    touched = sum(bool(people & pair) for pair in pairs)
    print(f"pairs of the list holding a candidate's LFW person: {touched}")
    if args.sheet and hits:
        sheet(hits[: args.show], train, lfw, args.sheet)
        print(f"wrote {args.sheet}")


if __name__ == "__main__":
    main()

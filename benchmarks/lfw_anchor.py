#!/usr/bin/env python
"""The anchor: MODEL `dlib` on LFW's own protocol from the photos (or CFP's, `--pairs_list
CFP_ROOT --protocol FP|FF`), beside dlib's own pipeline on the same pairs, and the cost of the
.bin path, in one run.

    .venv/bin/python benchmarks/lfw_anchor.py --images LFW_FOLDER --pairs_list pairs.txt
    .venv/bin/python benchmarks/lfw_anchor.py --pairs_list CFP_ROOT --protocol FP

- **ours from photos**: what `scripts.verify dlib --pairs_list pairs.txt --images LFW_FOLDER
  --retry_upsample 2 --retry_mmod` scores (infer.pair_photos: every photo cut to dlib's own
  150 chip; photos where no face is found searched again, then cut at a fallback face), over
  all the pairs, and over the pairs whose photos both had a face found by the first search;
- **dlib's own**: its HOG detector (upsample 1), its 5-point shape predictor and
  `compute_face_descriptor` (face_recognition's pipeline), the largest face of each photo; a
  photo where it finds none has no descriptor, so its pairs are scored as misses (or left out);
- **the .bin path**: the same faces as insightface's 112x112 crops (what `scripts.make_bin
  --pairs_list ... --align` writes), re-framed onto dlib's chip by Model.module_for, as
  `scripts.verify dlib --bin` does: the black bands outside the 112 crop cost what they cost.

Every score is a 10-fold accuracy (each fold judged at the threshold best on the other nine) of
the single view (dlib's descriptor is single-view); flip-test figures of ours are printed beside
it. Over all the pairs the folds are the list's own (view 2's); a row over a subset of the pairs
(those with faces) splits that subset into 10 contiguous folds of its own, the same for every
row over the same subset, so such rows compare with each other. "Faceless pairs as misses" is
the subset's accuracy times the share of pairs in it (each missed pair counted wrong). Faces are cached beside the list (`--cache_dir`), so a second run detects
nothing; dlib's own pipeline runs afresh each time. LFW is for research use: nothing of it is
written into the repository.
"""

from __future__ import annotations

import argparse
import os
import time

import common  # noqa: F401,I001
import numpy as np
import torch

from shardface.eval.cfp import read_list
from shardface.eval.pairs import check_images, score_pairs
from shardface.eval.verification import NFOLDS, evaluate
from shardface.faces.align import ARCFACE_112
from shardface.faces.detect import Detection, load_photo
from shardface.faces.stream import Crop, stream
from shardface.faces.workers import default_workers, map_photos
from shardface.infer.embed import embed, l2_normalize
from shardface.infer.model import load_model
from shardface.infer.pair_photos import (
    EmbeddingCache,
    FacesCache,
    Retries,
    cache_paths,
    pair_embeddings,
    pair_faces,
)
from shardface.utils.progress import progress_bar

_DLIB = {}


def _dlib_models() -> tuple:
    """dlib's own detector, 5-point shape predictor and descriptor network, once per process."""
    if not _DLIB:
        import dlib

        from shardface.faces.models import model_file

        _DLIB["m"] = (
            dlib.get_frontal_face_detector(),
            dlib.shape_predictor(model_file("shape_predictor_5_face_landmarks.dat")),
            dlib.face_recognition_model_v1(model_file("dlib_face_recognition_resnet_model_v1.dat")),
        )
    return _DLIB["m"]


def dlib_own(path: str) -> np.ndarray | None:
    """A worker's task: dlib's own descriptor of the photo's largest face, or None."""
    detector, shape, net = _dlib_models()
    img = np.asarray(load_photo(path).convert("RGB"))
    boxes = detector(img, 1)
    if not boxes:
        return None
    box = max(boxes, key=lambda r: r.area())
    return np.asarray(net.compute_face_descriptor(img, shape(img, box)), np.float32)


def folds_accuracy(emb: np.ndarray, issame: np.ndarray) -> tuple[float, float]:
    """(mean, std) of the 10-fold accuracy of interleaved pair embeddings."""
    acc = evaluate(l2_normalize(emb), issame, NFOLDS)[2]
    return float(np.mean(acc)), float(np.std(acc))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--images", default=None, help="LFW's folder (deep-funneled or not): FOLDER/name/name_000n.jpg"
    )
    p.add_argument(
        "--pairs_list", required=True, help="LFW's pairs.txt (view 2), or a CFP root with --protocol"
    )
    p.add_argument("--protocol", default=None, choices=("FP", "FF"), help="with a CFP root: its protocol")
    p.add_argument(
        "--cache_dir",
        default=None,
        help="where the faces and embeddings are cached (default: beside the list)",
    )
    p.add_argument("--workers", type=int, default=default_workers())
    p.add_argument(
        "--skip_dlib_own", action="store_true", help="leave out dlib's own pipeline (the slow part)"
    )
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    pair_list = read_list(args.pairs_list, args.images, args.protocol)
    check_images(pair_list)
    photos, issame, rows = pair_list.photos, np.asarray(pair_list.issame), pair_list.rows()
    print(f"{len(pair_list.pairs)} pairs of {len(photos)} photos ({args.pairs_list}); {args.workers} workers")
    model = load_model("dlib", detection=Detection())
    faces_cache, emb_cache = cache_paths(args.pairs_list, model.fingerprint, args.cache_dir)
    cache = FacesCache(faces_cache)

    t = time.perf_counter()
    # the first search alone
    first = pair_faces(photos, model.detection, Retries(), cache, workers=args.workers)
    faces = pair_faces(photos, model.detection, Retries(upsample=2, mmod=True), cache, workers=args.workers)
    found_s = time.perf_counter() - t
    print("\n".join(faces.report(pair_list.pairs)[:4]))
    t = time.perf_counter()
    ours = pair_embeddings(model, photos, faces, EmbeddingCache(emb_cache, model))
    embed_s = time.perf_counter() - t
    r = score_pairs(pair_list, ours.emb, ours.emb_flip)
    first_found = np.array([p not in set(first.fallbacks) for p in photos])[rows].reshape(-1, 2).all(1)

    lines = [("ours from photos, all pairs", len(issame), r.accuracy, r.std, f"{r.accuracy_flip:.4f}")]
    sub = np.repeat(first_found, 2)
    lines.append(
        (
            "ours, pairs with faces (first search)",
            int(first_found.sum()),
            *folds_accuracy(ours.emb[rows][sub], issame[first_found]),
            "-",
        )
    )

    # the .bin path: the same faces as 112 crops, re-framed onto the chip
    crops = torch.stack(
        [
            torch.from_numpy(np.array(photo.cuts[0])).permute(2, 0, 1)
            for photo in stream(photos, faces=[[faces.faces[p]] for p in photos], cut=Crop(ARCFACE_112))
        ]
    )
    reframed = embed(crops, model.module_for(ARCFACE_112), 64)
    lines.append(
        (".bin path (112 crops re-framed)", len(issame), *folds_accuracy(reframed[rows], issame), "-")
    )

    if not args.skip_dlib_own:
        t = time.perf_counter()
        progress = progress_bar(len(photos), "dlib's own pipeline")
        own = list(map_photos(dlib_own, photos, workers=args.workers, progress=progress.update))
        own_s = time.perf_counter() - t
        has = np.array([d is not None for d in own])
        own_emb = np.stack([d if d is not None else np.zeros(128, np.float32) for d in own])
        both = has[rows].reshape(-1, 2).all(1)
        print(
            f"dlib's own pipeline: no face in {int((~has).sum())} of {len(photos)} photos "
            f"({int((~both).sum())} pairs); {len(photos) / own_s:.1f} photos/s"
        )
        sub = np.repeat(both, 2)
        acc_both = folds_accuracy(own_emb[rows][sub], issame[both])
        lines.append(("dlib's own, pairs with faces", int(both.sum()), *acc_both, "-"))
        # the faceless pairs counted as misses (their share of the pairs taken off)
        lines.append(
            (
                "dlib's own, faceless pairs as misses",
                len(issame),
                acc_both[0] * float(both.mean()),
                float("nan"),
                "-",
            )
        )
        lines.append(
            (
                "ours, the same pairs as dlib's own",
                int(both.sum()),
                *folds_accuracy(ours.emb[rows][sub], issame[both]),
                "-",
            )
        )
    print(
        f"faces found in {found_s:.0f} s, embedded in {embed_s:.0f} s"
        + ("" if args.skip_dlib_own else f"; dlib's own pipeline {own_s:.0f} s")
    )
    print(f"{'MODEL dlib':<40} {'pairs':>6} {'acc':>7} {'std':>7} {'acc-flip':>8}")
    for name, n, acc, std, flip in lines:
        print(f"{name:<40} {n:>6} {acc:7.4f} {std:7.4f} {flip:>8}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Cosine similarity of two face images under a trained model, and same/different at a threshold.
`python -m scripts.compare MODEL a.jpg b.jpg [--threshold T | --threshold-from val.bin]`.

Embeddings as scripts.embed makes them (flip test, L2-normalised). --threshold-from runs the
verification set (a .bin, e.g. from scripts.make_bin) and takes the cosine threshold that
separates its pairs best, printing it and its accuracy on those same pairs (the best-threshold
accuracy, fitted to them: usually above the 10-fold accuracy scripts.verify reports).
Without either, the MODEL's own threshold decides (infer/thresholds.py: dlib's distance 0.6; a
trained run's, at a stated FAR on its validation set, saved by training and carried by export_onnx);
the threshold used and where it came from are printed.
With --align the two images are photos: the largest face of each is aligned to the model's
template (no face: refused); a photo with several faces is named, with its count."""

from __future__ import annotations

import sys

from shardface import Threshold, fit_threshold
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_align_options,
    add_model_options,
    face_detection,
    model_from,
    workers_from,
)


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("image_a", help="the first face image (aligned: 112x112; dlib 150x150 chips)")
    p.add_argument("image_b", help="the second face image")
    how = p.add_mutually_exclusive_group()
    how.add_argument(
        "--threshold",
        type=float,
        default=None,
        help="cosine similarity at or above which the two are the same person, in [-1, 1] "
        "(default: the MODEL's own; dlib: its distance 0.6)",
    )
    how.add_argument(
        "--threshold_from",
        default=None,
        metavar="BIN",
        help="a verification .bin: use the threshold that separates its pairs best",
    )
    p.add_argument(
        "--resize",
        action="store_true",
        help="resize images that are not the model's crop size (not alignment)",
    )
    add_align_options(p, "the two images", strict=False)  # a photo without a face is always refused
    args = p.parse_args(argv)
    # a threshold that is no cosine: refused at start
    threshold = Threshold.given(args.threshold) if args.threshold is not None else None
    model = model_from(args, face_detection(args))
    if args.threshold_from:
        threshold = fit_threshold(
            model, args.threshold_from, batch_size=args.batch_size, flag="--threshold-from"
        )
    verdict = model.compare(
        args.image_a,
        args.image_b,
        align=args.align,
        threshold=threshold,
        workers=workers_from(args) if args.align and args.workers else 1,  # two photos: no pool unless asked
        resize=args.resize,
    )
    if verdict.several:
        print(verdict.several)
    print(f"cosine similarity {verdict.score:.4f}")
    if verdict.same is None:
        print(
            f"{args.model} has no known threshold: pass --threshold T or --threshold-from VAL.bin to decide "
            f"same or different"
        )
    else:
        print(f"threshold {verdict.threshold:.4f}: {verdict.source}")
        print(f"{'same' if verdict.same else 'different'} person (threshold {verdict.threshold:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Generate the demo's drawn-faces set: train.rec/.idx/property + a verification .bin of
pairs from identities that are not in the training set. `python -m scripts.make_drawn_faces`."""

from __future__ import annotations

import os
import sys
import time
from multiprocessing import Pool

import numpy as np

from shardface.dataset.drawn_faces import identity_images
from shardface.dataset.pack import write_insightface_rec
from shardface.eval.verification import write_bin
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.utils.progress import progress_bar

VAL_NAME = "drawn_faces_val"  # the .bin beside the training set; configs/demo.py's val_targets


def _images(args):
    return identity_images(*args)


def verification_pairs(images: list[list[bytes]], num_pairs: int, seed: int):
    """Half same-identity, half different-identity pairs, interleaved as in LFW's .bin."""
    rng = np.random.default_rng(seed)
    bins, issame = [], []
    for i in range(num_pairs):
        same = i % 2 == 0
        a = int(rng.integers(len(images)))
        b = a if same else int((a + rng.integers(1, len(images))) % len(images))
        ia = int(rng.integers(len(images[a])))
        ib = (
            int((ia + rng.integers(1, len(images[b]))) % len(images[b]))
            if same
            else int(rng.integers(len(images[b])))
        )
        bins += [images[a][ia], images[b][ib]]
        issame.append(same)
    return bins, issame


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument(
        "--output", default="data/drawn_faces", help="directory to write (default data/drawn_faces)"
    )
    p.add_argument("--num_ids", type=int, default=400, help="training identities (default 400)")
    p.add_argument("--per_id", type=int, default=20, help="training images per identity (default 20)")
    p.add_argument(
        "--val_ids",
        type=int,
        default=100,
        help="held-out identities for the verification pairs (default 100)",
    )
    p.add_argument("--val_per_id", type=int, default=10, help="images per held-out identity (default 10)")
    p.add_argument(
        "--val_pairs",
        type=int,
        default=1000,
        help="verification pairs, half of them same-identity (default 1000)",
    )
    p.add_seed(0, "drawing seed (default 0)")
    p.add_argument(
        "--workers", type=int, default=os.cpu_count() or 1, help="drawing processes (default: one per CPU)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing set at --output")
    args = p.parse_args(argv)

    start = time.time()
    total = args.num_ids * args.per_id
    with Pool(args.workers) as pool, progress_bar(total, "train images") as progress:
        train = pool.imap(_images, [(i, args.per_id, args.seed) for i in range(args.num_ids)], chunksize=4)
        write_insightface_rec(args.output, train, total, args.num_ids, progress, overwrite=args.overwrite)
        # held-out identities: ids after the training ones, never written to train.rec
        val = pool.map(_images, [(args.num_ids + i, args.val_per_id, args.seed) for i in range(args.val_ids)])
    bins, issame = verification_pairs(val, args.val_pairs, args.seed)
    write_bin(os.path.join(args.output, f"{VAL_NAME}.bin"), bins, issame)
    print(
        f"wrote {total} images of {args.num_ids} identities and {args.val_pairs} verification pairs "
        f"of {args.val_ids} unseen identities to {args.output} in {time.time() - start:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

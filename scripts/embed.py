#!/usr/bin/env python
"""Embeddings of images and folders of images (recursively) with a trained model.
`python -m scripts.embed MODEL INPUTS... --out emb.npy`.

Each row is the embedding of an image plus that of its mirror image, L2-normalised (the flip
test of verification), float32; row i belongs to line i of the file list written beside the
array (emb.txt for emb.npy). MODEL: a run directory, a checkpoint directory, a model.pt
(ShardFace's, or arcface_torch's with --network), an exported .onnx (onnxruntime) or `dlib`
(dlib's face descriptor: 150x150 dlib chips; --no_flip gives its single-view descriptors)."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

import numpy as np

from dataset import DataError
from eval.embedder import embed_files, image_files, load_embedder
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from utils.checkpoint import CheckpointError


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="run output, checkpoint dir, model.pt (ShardFace or arcface_torch), .onnx or dlib")
    p.add_argument("inputs", nargs="+", help="image files and folders")
    p.add_argument("--out", required=True, help="the .npy file to write; the file list goes beside it (.txt)")
    p.add_argument("--network", default=None, help="backbone name for an arcface_torch model.pt "
                                                   "(default: from the training config)")
    p.add_argument("--batch_size", type=int, default=64, help="images per forward pass")
    p.add_argument("--no_ema", action="store_true", help="the raw weights, not the EMA")
    p.add_argument("--resize", action="store_true",
                   help="resize images that are not the model's crop size (112x112; dlib 150x150) instead of "
                        "refusing them (resizing is not alignment; see README 'Your own images')")
    p.add_argument("--no_flip", action="store_true",
                   help="each image's own embedding, without its mirror image's (dlib's descriptor is single-view)")
    args = p.parse_args(argv)
    out = args.out if args.out.endswith(".npy") else args.out + ".npy"
    listing = out[:-len(".npy")] + ".txt"
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"{out_dir}: output directory not found")
    try:
        paths = image_files(args.inputs)
        embedder = load_embedder(args.model, args.network, ema=not args.no_ema)
        embeddings = embed_files(paths, embedder, args.batch_size, args.resize, flip=not args.no_flip)
    except (DataError, CheckpointError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from None
    np.save(out, embeddings)
    with open(listing, "w") as f:
        f.writelines(f"{path}\n" for path in paths)
    print(f"wrote {out} ({embeddings.shape[0]} x {embeddings.shape[1]}) and {listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

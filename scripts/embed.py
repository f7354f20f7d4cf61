#!/usr/bin/env python
"""Embeddings of images and folders of images (recursively) with a trained model.
`python -m scripts.embed MODEL INPUTS... --out emb.npy`.

Each row is the embedding of an image plus that of its mirror image, L2-normalised (the flip
test of verification), float32; row i belongs to line i of the file list written beside the
array (emb.txt for emb.npy). MODEL: a run directory, a checkpoint directory, a model.pt
(ShardFace's, or arcface_torch's with --network) or an exported .onnx (onnxruntime)."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

import numpy as np

from dataset import DataError
from eval.embedder import embed_files, image_files, load_model
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from utils.checkpoint import CheckpointError


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="run output, checkpoint dir, model.pt (ShardFace or arcface_torch) or .onnx")
    p.add_argument("inputs", nargs="+", help="image files and folders")
    p.add_argument("--out", required=True, help="the .npy file to write; the file list goes beside it (.txt)")
    p.add_argument("--network", default=None, help="backbone name for an arcface_torch model.pt "
                                                   "(default: from the training config)")
    p.add_argument("--batch_size", type=int, default=64, help="images per forward pass")
    p.add_argument("--no_ema", action="store_true", help="the raw weights, not the EMA")
    p.add_argument("--resize", action="store_true",
                   help="resize images that are not 112x112 instead of refusing them (resizing is not "
                        "alignment; see README 'Your own images')")
    args = p.parse_args(argv)
    out = args.out if args.out.endswith(".npy") else args.out + ".npy"
    listing = out[:-len(".npy")] + ".txt"
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"{out_dir}: output directory not found")
    try:
        paths = image_files(args.inputs)
        model = load_model(args.model, args.network, ema=not args.no_ema)
        embeddings = embed_files(paths, model, args.batch_size, args.resize)
    except (DataError, CheckpointError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from None
    np.save(out, embeddings)
    with open(listing, "w") as f:
        f.writelines(f"{path}\n" for path in paths)
    print(f"wrote {out} ({embeddings.shape[0]} x {embeddings.shape[1]}) and {listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

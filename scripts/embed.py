#!/usr/bin/env python
"""Embeddings of images and folders of images (recursively) with a trained model.
`python -m scripts.embed MODEL INPUTS... --out emb.npy`.

Each row is the embedding of an image plus that of its mirror image, L2-normalised (the flip
test of verification), float32; row i belongs to line i of the file list written beside the
array (emb.txt for emb.npy). MODEL: a run directory, a checkpoint directory, a model.pt
(ShardFace's, or arcface_torch's with --network) or an exported .onnx (onnxruntime). With
--align the inputs are photos: each photo's largest face is aligned to the model's template, and
photos without a face are left out of both files and named (refused with --strict)."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import os
import sys

import numpy as np

from dataset import DataError
from eval.embedder import embed_files, embed_uint8, image_files, load_embedder
from faces.photos import find_faces, photo_crops, usable
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from scripts.face_options import add_align_options, detection_from
from utils.checkpoint import CheckpointError
from utils.progress import Progress


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
    add_align_options(p, "the inputs")
    args = p.parse_args(argv)
    out = args.out if args.out.endswith(".npy") else args.out + ".npy"
    listing = out[:-len(".npy")] + ".txt"
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise SystemExit(f"{out_dir}: output directory not found")
    try:
        paths = image_files(args.inputs)
        detection = detection_from(args) if args.align else None
        embedder = load_embedder(args.model, args.network, ema=not args.no_ema)
        if args.align:
            faces = usable(find_faces(paths, detection, Progress(len(paths), "finding faces").update), args.strict)
            paths = [path for path in paths if path in faces]
            embeddings = embed_uint8(photo_crops(paths, faces, embedder.template), embedder.module, args.batch_size)
        else:
            embeddings = embed_files(paths, embedder.module, args.batch_size, args.resize)
    except (DataError, CheckpointError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from None
    np.save(out, embeddings)
    with open(listing, "w") as f:
        f.writelines(f"{path}\n" for path in paths)
    print(f"wrote {out} ({embeddings.shape[0]} x {embeddings.shape[1]}) and {listing}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

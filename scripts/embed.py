#!/usr/bin/env python
"""Embeddings of images and folders of images (recursively) with a trained model.
`python -m scripts.embed MODEL INPUTS... --out emb.npy`.

Each row is the embedding of an image plus that of its mirror image, L2-normalised (the flip
test of verification), float32; row i belongs to line i of the file list written beside the
array (emb.txt for emb.npy, UTF-8), which is published after the array: an emb.npy without its
emb.txt is an interrupted run. An existing pair is replaced only with --overwrite. MODEL: a run
directory, a checkpoint directory, a model.pt (ShardFace's, or arcface_torch's with --network),
an exported .onnx (onnxruntime) or `dlib` (dlib's face descriptor: 150x150 dlib chips; --no_flip
gives its single-view descriptors). With --align the inputs are photos: each photo's largest face
is aligned to the model's template, and photos without a face are left out of both files and
named (refused with --strict).

Under torchrun (`torchrun --nnodes N --nproc_per_node K -m scripts.embed MODEL INPUTS --out emb.npy`)
each rank embeds a contiguous share of the sorted file list, and rank 0 writes the pair that one
process writes (dataset/shares.py: the ranks agree on the job first; a rank that fails ends them all)."""

from __future__ import annotations

import logging
import os
import sys

import numpy as np

from shardface.dataset import DataError
from shardface.dataset.folders import image_files
from shardface.dataset.geometry import check_files
from shardface.dataset.shares import share_of, tool_ranks
from shardface.errors import OutputError
from shardface.faces.stream import Found, usable
from shardface.infer.model import model_files
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_align_options,
    add_model_options,
    face_detection,
    model_from,
    workers_from,
)
from shardface.utils.atomic import publishing_set
from shardface.utils.outputs import check_output_file, refuse_inputs
from shardface.utils.progress import progress_bar

logger = logging.getLogger("shardface")


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    add_model_options(p)
    p.add_argument("inputs", nargs="+", help="image files and folders")
    p.add_argument("--out", required=True, help="the .npy file to write; the file list goes beside it (.txt)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT.npy and its .txt")
    p.add_argument(
        "--resize",
        action="store_true",
        help="resize images that are not the model's crop size (112x112; dlib 150x150) instead of "
        "refusing them (resizing is not alignment; see docs/photos.md)",
    )
    p.add_argument(
        "--no_flip",
        action="store_true",
        help="each image's own embedding, without its mirror image's (dlib's descriptor is single-view)",
    )
    add_align_options(p, "the inputs")
    args = p.parse_args(argv)
    if os.path.isdir(args.out):
        raise OutputError(f"--out {args.out} is a directory; name a file")
    out = args.out if args.out.endswith(".npy") else args.out + ".npy"
    listing = out[: -len(".npy")] + ".txt"
    for path in (out, listing):
        check_output_file(path, overwrite=args.overwrite, what="--out")
    paths = image_files(args.inputs)
    broken = next((p for p in paths if "\n" in p or "\r" in p), None)
    if broken is not None:  # it would break the one-path-per-line listing
        raise DataError(
            f"{broken!r}: a file name with a line break cannot be listed one per line in {listing}; rename it"
        )
    refuse_inputs([out, listing], [*paths, *model_files(args.model)])
    ranks = tool_ranks()  # under torchrun: each rank embeds its share, rank 0 writes
    ranks.agree(paths, args.model, args.align, args.no_flip, args.resize, root="", what="images")
    detection = face_detection(args)
    model = model_from(args, detection)
    if not args.align:  # every header first: crops of another size are refused before any work
        check_files(paths, args.resize, size=tuple(model.template.size))
    share = share_of(len(paths), ranks.rank, ranks.world)
    shares = ranks.outcome(lambda: _embedded(args, model, paths[share.start : share.end], ranks))
    found = Found({name: faces for faces, _, _ in shares for name, faces in faces.items()}, detection)
    if args.align:
        usable(found, args.strict)  # photos without a face: named, or refused with --strict
        if found.several_faces():
            logger.warning("%s", found.several_faces())
    if ranks.rank != 0:
        print(f"rank {ranks.rank} of {ranks.world}: its share of the {len(paths)} images is embedded")
        return 0
    paths = [name for _, _, kept in shares for name in kept]
    rows = [row for _, embedded, _ in shares for row in embedded]
    embeddings = np.stack(rows) if rows else np.zeros((0, model.dim), np.float32)
    # one set, the listing published last: an emb.npy without its emb.txt is an interrupted run
    with publishing_set([out, listing]) as (tmp_out, tmp_listing):
        with open(tmp_out, "wb") as f:
            np.save(f, embeddings)
        with open(tmp_listing, "w", encoding="utf-8", errors="surrogateescape") as f:
            f.writelines(f"{path}\n" for path in paths)
    print(f"wrote {out} ({embeddings.shape[0]} x {embeddings.shape[1]}) and {listing}")
    return 0


def _embedded(args, model, paths: list[str], ranks) -> tuple[dict, list, list]:
    """This rank's share: (each image's faces, the rows of those with a face, their names), in order."""
    faces, rows, kept = {}, [], []
    shown = ranks.rank == 0 and (args.align or len(paths) > args.batch_size)  # a few batches: unannounced
    label = "finding and embedding faces" if args.align else "embedding"
    if ranks.world > 1:
        label += f" (rank 0's share of {ranks.world})"
    with progress_bar(len(paths), label, shown=shown) as bar:
        for photo in model.analyse(
            paths,
            workers=workers_from(args) if args.align else 1,
            flip=not args.no_flip,
            largest_only=True,
            align=args.align,
            batch_size=args.batch_size,
            progress=bar.update,
            resize=args.resize,
        ):
            faces[photo.name] = photo.faces
            if photo.face is not None:  # faces found on every core, each batch embedded as it comes back
                rows.append(photo.face.embedding)
                kept.append(photo.name)
    return faces, rows, kept


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""Pack an image folder (one sub-folder per identity) or a list file (`path<TAB>label` per
line) into train.rec, train.idx and property in the insightface layout.
`python -m scripts.pack_rec IMAGE_FOLDER OUT_DIR [--resize | --align]`.

Every image is checked first (its header): a missing or unreadable file, or images that are not
112x112 without --resize, stop the pack before anything is written. Every image is decoded as it
is packed: one that does not decode (a truncated JPEG) stops the pack, naming it, and an earlier
set stays as it was. An image is stored as its file's bytes; with --resize an image of another
size is stored resized, as PNG. With --align the images are photos: each photo's largest face is
stored aligned to 112x112, as PNG (photos without a face are left out and named, or refused with
--strict; further faces are counted). Under torchrun with --align, each rank finds the faces of
its share of the photos and rank 0 packs them all: the same bytes as one process."""

from __future__ import annotations

import os
import sys
from collections import defaultdict

from shardface.dataset import DataError, DataLayoutError, list_identity_folders
from shardface.dataset.folders import regular_file
from shardface.dataset.geometry import check_files
from shardface.dataset.images import jpeg_decoder, stored_bytes
from shardface.dataset.pack import write_insightface_rec
from shardface.dataset.shares import tool_ranks
from shardface.errors import ConfigError
from shardface.faces.stream import align_groups, aligned_pngs
from shardface.infer.ranked import find_faces_ranked
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import add_align_options, face_detection, workers_from
from shardface.utils.outputs import check_output_dir, check_output_file, refuse_inputs
from shardface.utils.progress import progress_bar


def collect(source: str) -> list[list[str]]:
    """Image paths grouped by label 0..C-1."""
    if os.path.isdir(source):
        return list_identity_folders(source)[1]
    if not regular_file(source):
        raise DataLayoutError(
            f"{source}: not an image folder or a list file"
            f"{'' if not os.path.exists(source) else ' (not a regular file)'}"
        )
    by_label = defaultdict(list)
    base = os.path.dirname(source)
    with open(source) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                path, label = line.rstrip("\n").split("\t")[:2]
                by_label[int(label)].append(os.path.join(base, path))
            except ValueError:
                raise DataError(f"{source}:{lineno}: expected 'path<TAB>label'") from None
    labels = sorted(by_label)
    if labels != list(range(len(labels))):
        raise DataError(f"{source}: labels must be 0..C-1 without gaps")
    if not labels:
        raise DataError(f"{source}: no 'path<TAB>label' lines")
    return [by_label[label] for label in labels]


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    p.add_argument("source", help="image folder or list file")
    p.add_argument("output", help="directory for train.rec, train.idx, property")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing set (the old one stays until the new one is complete)",
    )
    p.add_argument(
        "--resize",
        action="store_true",
        help="resize images that are not 112x112 (bilinear) instead of refusing them. Models "
        "expect aligned crops (insightface's five-point template): resizing is not "
        "alignment, so align first where you can (docs/photos.md)",
    )
    add_align_options(p, "the images")
    args = p.parse_args(argv)
    jpeg_decoder()  # a torchvision of another build: one line now, before any output
    ranks = tool_ranks()  # under torchrun with --align: each rank finds its share's faces, rank 0 packs
    if ranks.world > 1 and not args.align:
        raise ConfigError(
            f"torchrun's {ranks.world} ranks: only --align's face finding is shared among machines; "
            "without --align pack in one process"
        )
    outputs = [os.path.join(args.output, n) for n in ("train.rec", "train.idx", "property")]
    check_output_dir(args.output)
    if os.path.isdir(args.output):
        for path in outputs:
            check_output_file(path, overwrite=args.overwrite)
    groups = collect(args.source)
    total = sum(len(g) for g in groups)
    refuse_inputs(outputs, [args.source, *(path for g in groups for path in g)])
    if args.align:
        names = list_identity_folders(args.source)[0] if os.path.isdir(args.source) else None
        detection = face_detection(args)
        what = "finding faces" + (f" (rank 0's share of {ranks.world})" if ranks.world > 1 else "")
        with progress_bar(total, what, shown=ranks.rank == 0) as bar:
            ranked = find_faces_ranked(
                [p for g in groups for p in g], detection, args.output, ranks, bar.update, workers_from(args)
            )
        if ranked is None:
            print(
                f"rank {ranks.rank} of {ranks.world}: the faces of its share are found; rank 0 packs {args.output}"
            )
            return 0
        found, parts = ranked
        groups, faces = align_groups(groups, detection, args.strict, names=names, found=found)
        total = sum(len(g) for g in groups)
        pngs = aligned_pngs([p for g in groups for p in g], faces, workers=workers_from(args))

        def stored(path: str) -> bytes:  # the stream's next crop: the photos come in the groups' order
            return next(pngs)
    else:
        parts = None
        with progress_bar(total, "checking image headers") as bar:  # a DataError: one line, after it
            check_files((path for g in groups for path in g), args.resize, progress=bar.update)

        def stored(path: str) -> bytes:  # decodes it: a truncated image stops the pack, naming it
            return stored_bytes(path, args.resize)

    with progress_bar(total, "packing") as bar:
        write_insightface_rec(
            args.output,
            ([stored(p) for p in g] for g in groups),
            total,
            len(groups),
            bar,
            overwrite=args.overwrite,
        )
    if parts is not None:  # the ranks' faces, kept until the output is published
        parts.remove()
    print(f"packed {total} images of {len(groups)} identities into {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

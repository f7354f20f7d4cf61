#!/usr/bin/env python
"""Find the faces in a folder of photos and write each as an aligned crop (insightface's 112x112
five-point template), keeping the folders: `python -m scripts.align SRC DST`.

SRC/alice/p1.jpg gives DST/alice/p1.png, the photo's largest face, and DST/alice/p1.face2.png,
p1.face3.png, ... for its other faces, by decreasing size (--largest writes only the first).
DST/align_report.csv (CSV, one row per face; a photo without a face is one row with faces 0 and
the other columns empty) lists every photo: faces found, face number (1 = largest), crop file,
detector score, box x0,y0,x1,y1 and the five points (left eye, right eye, nose tip, left and
right mouth corner; x,y in the photo's pixels). Photos without a face are counted and named at
the end. DST is written beside itself under a temporary name and appears complete or not at all.

The photos are shared by --workers processes (default: every core this process may use); the
output is the same, byte for byte, whatever their number. Many machines: under torchrun
(`torchrun --nnodes N --nproc_per_node K -m scripts.align SRC DST`, DST's folder shared), each rank
aligns its share of the sorted photos into DST.parts-<key>/rank-R-of-W, and rank 0 joins the parts
into DST, the same files one process writes (dataset/shares.py)."""

from __future__ import annotations

import csv
import os
import re
import sys
from collections import Counter

from tqdm import tqdm

from shardface.dataset import DataError, DataLayoutError
from shardface.dataset.folders import walk_images
from shardface.dataset.geometry import check_files
from shardface.dataset.images import IMAGE_EXTENSIONS
from shardface.dataset.shares import Part, Parts, Ranks, list_key, share_of, tool_ranks
from shardface.errors import ConfigError, OutputError
from shardface.faces.align import ARCFACE_112
from shardface.faces.detect import Detection, check_available
from shardface.faces.stream import Crop, no_face_message, stream
from shardface.faces.workers import warm_up
from shardface.parallel.user_errors import exits_on_user_error
from shardface.scripts.cli import ArgumentParser
from shardface.scripts.options import (
    add_detection_options,
    add_workers_option,
    detection_from,
    workers_from,
)
from shardface.utils.atomic import publishing_dir
from shardface.utils.outputs import check_output_dir
from shardface.utils.progress import progress_bar

REPORT = "align_report.csv"
MAX_SIZE = 1024  # crop side: 112 for insightface's networks, 150 for dlib's
_FACE_N = re.compile(r"\.face\d+$")
POINTS = ("left_eye", "right_eye", "nose", "mouth_left", "mouth_right")
COLUMNS = ["photo", "faces", "face", "crop", "score", "x0", "y0", "x1", "y1"] + [
    f"{p}_{c}" for p in POINTS for c in "xy"
]


def photos_under(src: str) -> list[str]:
    """Image files under `src`, recursively, as sorted paths relative to it."""
    found = sorted(os.path.relpath(f, src) for f in walk_images(src))  # as training and the gallery walk
    if not found:
        raise DataError(f"{src}: no photos ({', '.join(IMAGE_EXTENSIONS)})")
    return found


def crop_stems(photos: list[str]) -> dict[str, str]:
    """Relative photo path -> relative crop path without extension, unique by construction: the
    photo's name without its extension (p1.jpg -> p1, whose faces give p1.png, p1.face2.png,
    ...), or with it (p1.jpg -> p1.jpg) where the short one could meet another crop's name: a
    name shared in the folder (p1.jpg, p1.png), one that another photo's full name equals
    (a.jpg.png beside a.jpg) or one ending like a further face's (k.face2.jpg beside k.jpg).
    A full name ends in an image extension, so it never ends like `.faceN` and never equals a
    short name that was kept."""
    stems = {p: os.path.splitext(p)[0] for p in photos}
    shared, full = Counter(stems.values()), set(photos)
    return {p: (p if shared[s] > 1 or s in full or _FACE_N.search(s) else s) for p, s in stems.items()}


def inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def report_row(photo: str, count: int, number: int | None, crop: str, face=None) -> list:
    if face is None:
        return [photo, count] + [""] * (len(COLUMNS) - 2)
    return (
        [photo, count, number, crop, f"{face.score:.4f}"]
        + [f"{v:.1f}" for v in face.box]
        + [f"{v:.2f}" for v in face.points.ravel()]
    )


def align_into(
    src: str,
    photos: list[str],
    out: str,
    detection: Detection,
    side: int,
    largest_only: bool,
    progress: tqdm,
    workers: int = 1,
    names: dict[str, str] | None = None,
) -> tuple[int, list[str]]:
    """Crops and the report of every photo into the folder `out`, found and cut by `workers`
    processes (faces.stream: the same files whatever their number); -> (crops written, photos
    without a face). `names`: the crop stems of the whole list (crop_stems), where `photos` is
    one rank's share of it."""
    stems, written, without = names or crop_stems(photos), 0, []
    cut = Crop(ARCFACE_112.scaled(side), png=True)
    found = stream(
        [os.path.join(src, p) for p in photos],
        detection,
        cut,
        workers,
        largest_only,
        progress=progress.update,
    )
    with open(os.path.join(out, REPORT), "w", newline="", encoding="utf-8", errors="surrogateescape") as f:
        report = csv.writer(f)
        report.writerow(COLUMNS)
        for rel, photo in zip(photos, found):
            if not photo.faces:
                report.writerow(report_row(rel, 0, None, ""))
                without.append(photo.name)
            for number, face in enumerate(photo.faces, 1):
                crop = (
                    ""
                    if largest_only and number > 1
                    else stems[rel] + (".png" if number == 1 else f".face{number}.png")
                )
                if crop:
                    os.makedirs(os.path.dirname(os.path.join(out, crop)) or out, exist_ok=True)
                    with open(os.path.join(out, crop), "wb") as png:
                        png.write(photo.cuts[number - 1])
                    written += 1
                report.writerow(report_row(rel, len(photo.faces), number, crop, face))
    return written, without


def check_names(photos: list[str], stems: dict[str, str], largest_only: bool) -> None:
    """Before any work: every crop's file name fits the file system's 255 bytes (a photo's further
    faces add `.faceN`)."""
    tail = ".png" if largest_only else ".face999.png"
    for photo in photos:
        name = os.path.basename(stems[photo]) + tail
        if len(os.fsencode(name)) > 255:
            raise DataError(
                f"{photo}: its crops' file names ({name!r}) would be over 255 bytes; rename the photo"
            )


def align_ranked(
    src: str,
    photos: list[str],
    dst: str,
    detection: Detection,
    side: int,
    largest_only: bool,
    workers: int,
    ranks: Ranks,
) -> tuple[int, list[str]] | None:
    """Each rank aligns its share of `photos` into its part beside `dst` (kept where a run of this
    job left it complete); rank 0 publishes their join as `dst`, what one process writes, and only
    then removes the parts (dataset.shares). -> (crops written, photos without a face) on rank 0,
    None on the others."""
    rank, world = ranks.rank, ranks.world
    ranks.agree(photos, detection, side, largest_only, root=src)
    parts = Parts(dst, list_key(photos, detection, side, largest_only, root=src), world)
    mine = share_of(len(photos), rank, world)
    share = photos[mine.start : mine.end]

    def fill(part: Part) -> None:
        label = f"aligning (rank 0's share of {world})"
        with progress_bar(len(share), label, shown=rank == 0) as bar:
            crops, without = align_into(
                src, share, part.folder, detection, side, largest_only, bar, workers, names=crop_stems(photos)
            )
        part.summary.update(crops=crops, without=[os.path.relpath(p, src) for p in without])

    manifests = ranks.outcome(lambda: parts.make(rank, photos, fill, root=src))
    if rank != 0:
        return None
    with publishing_dir(dst) as tmp:
        summary = parts.join(tmp, manifests, photos, REPORT)
    parts.remove()
    return summary["crops"], [os.path.join(src, p) for p in summary["without"]]


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="folder of photos (sub-folders, e.g. one per person, are kept)")
    p.add_argument(
        "output",
        help="folder to write the crops and align_report.csv to (must not exist, "
        "or pass --overwrite; not inside SOURCE)",
    )
    add_detection_options(p)
    p.add_argument("--size", type=int, default=112, help="crop side in pixels (the 112x112 template scaled)")
    p.add_argument(
        "--largest",
        action="store_true",
        help="write only each photo's largest face (identity folders for training: other faces "
        "in a photo are usually other people); the report still lists every face",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing OUTPUT (the old one stays until the new one is complete)",
    )
    add_workers_option(p)
    args = p.parse_args(argv)
    ranks = tool_ranks()  # under torchrun: each rank aligns its share into a part, rank 0 joins them
    workers = workers_from(args)
    src, dst = args.source, args.output.rstrip(os.sep) or args.output
    if not os.path.isdir(src):
        raise DataLayoutError(f"{src}: photo folder not found")
    if inside(dst, src):
        raise OutputError(
            f"{dst} is inside {src}: write the crops elsewhere (they would be taken for photos)"
        )
    if inside(src, dst):
        raise OutputError(f"{src} is inside {dst}: --overwrite would delete the photos")
    check_output_dir(dst)
    if os.path.exists(dst) and not args.overwrite:
        raise OutputError(f"{dst} exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise OutputError(f"output {dst}: the directory {parent} does not exist; create it first")
    if not 16 <= args.size <= MAX_SIZE:
        raise ConfigError(
            f"--size {args.size}: from 16 to {MAX_SIZE} pixels (a crop is size x size x 3 bytes in memory)"
        )
    detection = detection_from(args)
    warm_up(stream, workers)  # the workers' imports, while the photos are listed and checked
    check_available(detection.detector, detection.landmarks)  # a missing model file: one line, at start
    photos = photos_under(src)
    check_names(photos, crop_stems(photos), args.largest)
    check_files((os.path.join(src, ph) for ph in photos), resize=True)  # unreadable files, before any output
    if ranks.world > 1:
        done = align_ranked(src, photos, dst, detection, args.size, args.largest, workers, ranks)
        if done is None:
            print(
                f"rank {ranks.rank} of {ranks.world}: its share of the {len(photos)} photos is aligned; "
                f"rank 0 writes {dst}"
            )
            return 0
        written, without = done
    else:
        # utils.atomic: staged beside DST, swapped in when complete
        with publishing_dir(dst) as tmp, progress_bar(len(photos), "aligning") as bar:
            written, without = align_into(src, photos, tmp, detection, args.size, args.largest, bar, workers)
    print(
        f"wrote {written} crops of {len(photos) - len(without)} photos with faces into {dst}; "
        f"report: {os.path.join(dst, REPORT)}"
    )
    if without:
        print(no_face_message(without, len(photos), detection))
    return 0


if __name__ == "__main__":
    sys.exit(main())

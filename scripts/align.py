#!/usr/bin/env python
"""Find the faces in a folder of photos and write each as an aligned crop (insightface's 112x112
five-point template), keeping the folders: `python -m scripts.align SRC DST`.

SRC/alice/p1.jpg gives DST/alice/p1.png, the photo's largest face, and DST/alice/p1.face2.png,
p1.face3.png, ... for its other faces, by decreasing size (--largest writes only the first).
DST/align_report.csv (CSV, one row per face; a photo without a face is one row with faces 0 and
the other columns empty) lists every photo: faces found, face number (1 = largest), crop file,
detector score, box x0,y0,x1,y1 and the five points (left eye, right eye, nose tip, left and
right mouth corner; x,y in the photo's pixels). Photos without a face are counted and named at
the end. DST is written beside itself under a temporary name and appears complete or not at all."""
from __future__ import annotations

if not __package__:  # run as a file (python scripts/x.py): import as `python -m scripts.x` does
    import os
    import sys
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import csv
import os
import re
import sys
from collections import Counter

from configs.errors import ConfigError
from dataset import DataError, DataLayoutError
from dataset.folders import walk_images
from dataset.geometry import check_files
from dataset.images import IMAGE_EXTENSIONS
from faces.align import ARCFACE_112, align
from faces.detect import check_available
from faces.photos import Detection, load_photo, no_face_message
from parallel.user_errors import exits_on_user_error
from scripts.cli import ArgumentParser
from scripts.options import add_detection_options, detection_from
from utils.atomic import OutputError, check_output_dir, publishing_dir
from utils.progress import Progress

REPORT = "align_report.csv"
_FACE_N = re.compile(r"\.face\d+$")
POINTS = ("left_eye", "right_eye", "nose", "mouth_left", "mouth_right")
COLUMNS = ["photo", "faces", "face", "crop", "score", "x0", "y0", "x1", "y1"] + \
          [f"{p}_{c}" for p in POINTS for c in "xy"]


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
    return [photo, count, number, crop, f"{face.score:.4f}"] + [f"{v:.1f}" for v in face.box] + \
        [f"{v:.2f}" for v in face.points.ravel()]


def align_into(src: str, photos: list[str], out: str, detection: Detection, side: int, largest_only: bool,
               progress: Progress) -> tuple[int, list[str]]:
    """Crops and the report of every photo into the folder `out`; -> (crops written, photos
    without a face)."""
    template = ARCFACE_112.scaled(side)
    stems, written, without, crops = crop_stems(photos), 0, [], set()
    with open(os.path.join(out, REPORT), "w", newline="") as f:
        report = csv.writer(f)
        report.writerow(COLUMNS)
        for photo in photos:
            path = os.path.join(src, photo)
            img = load_photo(path)
            faces = detection.faces(img)
            if not faces:
                without.append(path)
                report.writerow(report_row(photo, 0, None, ""))
            for number, face in enumerate(faces, 1):
                if largest_only and number > 1:
                    crop = ""
                else:
                    crop = stems[photo] + (".png" if number == 1 else f".face{number}.png")
                    if crop in crops:  # crop_stems makes names unique: this would be its bug, not data
                        raise RuntimeError(f"align: two faces named {crop}")
                    crops.add(crop)
                    os.makedirs(os.path.dirname(os.path.join(out, crop)) or out, exist_ok=True)
                    align(img, face.points, template).save(os.path.join(out, crop))
                    written += 1
                report.writerow(report_row(photo, len(faces), number, crop, face))
            progress.update()
    return written, without


@exits_on_user_error
def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="folder of photos (sub-folders, e.g. one per person, are kept)")
    p.add_argument("output", help="folder to write the crops and align_report.csv to (must not exist, "
                                  "or pass --overwrite; not inside SOURCE)")
    add_detection_options(p)
    p.add_argument("--size", type=int, default=112, help="crop side in pixels (the 112x112 template scaled)")
    p.add_argument("--largest", action="store_true",
                   help="write only each photo's largest face (identity folders for training: other faces "
                        "in a photo are usually other people); the report still lists every face")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing OUTPUT (the old one stays until the new one is complete)")
    args = p.parse_args(argv)
    src, dst = args.source, args.output.rstrip(os.sep) or args.output
    if not os.path.isdir(src):
        raise DataLayoutError(f"{src}: photo folder not found")
    if inside(dst, src):
        raise OutputError(f"{dst} is inside {src}: write the crops elsewhere (they would be taken for photos)")
    if inside(src, dst):
        raise OutputError(f"{src} is inside {dst}: --overwrite would delete the photos")
    check_output_dir(dst)
    if os.path.exists(dst) and not args.overwrite:
        raise OutputError(f"{dst} exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise OutputError(f"{parent}: output directory not found")
    if args.size < 16:
        raise ConfigError(f"--size {args.size}: crops need at least 16 pixels")
    detection = detection_from(args)
    check_available(detection.detector, detection.landmarks)  # a missing model file: one line, at start
    photos = photos_under(src)
    check_files((os.path.join(src, ph) for ph in photos), resize=True)  # unreadable files, before any output
    with publishing_dir(dst) as tmp:  # utils.atomic: staged beside DST, swapped in when complete
        written, without = align_into(src, photos, tmp, detection, args.size, args.largest,
                                      Progress(len(photos), "aligning"))
    print(f"wrote {written} crops of {len(photos) - len(without)} photos with faces into {dst}; "
          f"report: {os.path.join(dst, REPORT)}")
    if without:
        print(no_face_message(without, len(photos), detection))
    return 0


if __name__ == "__main__":
    sys.exit(main())

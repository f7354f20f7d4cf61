"""The 112x112 check at start: image folders by their headers, RecordIO sets by `property` and
a sample of records. A set of another size is refused, naming files, unless the user resizes."""

from __future__ import annotations

import logging
import os
import random
from typing import Callable, Iterable

from shardface.dataset.errors import ImageDecodeError, ImageSizeError
from shardface.dataset.folders import regular_file
from shardface.dataset.images import FACE_SIZE, image_size

logger = logging.getLogger("shardface")

SHOWN = 3  # offending files named in a message
RESIZE_HINT = (
    "for photos, pass --align to find and align the faces (pack_rec, make_bin, embed, compare; "
    "`--align true` to train.py on an image folder; or scripts.align first) onto the network's "
    "five-point template (insightface's 112x112; dlib's 150x150 chip for MODEL dlib), or --resize "
    "to resize them (`--resize true` to train.py): resizing is not alignment (docs/photos.md)"
)


def size_refusal(
    bad: list[tuple[str, tuple[int, int]]], count: int, checked: str, wanted: tuple[int, int] = FACE_SIZE
) -> ImageSizeError:
    """One message: the first few (name, (h, w)), how many of what was checked, and the fix."""
    shown = ", ".join(f"{name} ({w}x{h})" for name, (h, w) in bad[:SHOWN])
    more = f" and {count - SHOWN} more" if count > SHOWN else ""
    return ImageSizeError(
        f"{count} {'image is' if count == 1 else 'images are'} not "
        f"{wanted[1]}x{wanted[0]} ({checked}): {shown}{more}; {RESIZE_HINT}"
    )


def check_files(
    paths: Iterable[str],
    resize: bool,
    skip_bad_images: bool = False,
    progress: Callable[[], None] | None = None,
    size: tuple[int, int] = FACE_SIZE,
) -> list[str]:
    """-> the paths to use. Reads every file's header: an unreadable, missing or not regular file is an
    ImageDecodeError naming it (with `skip_bad_images`, it is left out with a warning); images
    that are not `size` (h, w; 112x112 unless a network wants another crop) are refused
    together unless `resize`."""
    paths = list(paths)
    usable, bad, unreadable = [], [], []
    for path in paths:
        try:
            if os.path.exists(path) and not regular_file(path):  # a FIFO would block the read forever
                raise ImageDecodeError(
                    f"{path}: not a regular file (a folder, FIFO, socket or device); "
                    f"only image files are read"
                )
            image = image_size(path, path)
        except ImageDecodeError as exc:
            if not skip_bad_images:
                raise
            unreadable.append(str(exc))
            continue
        finally:
            if progress is not None:
                progress()
        usable.append(path)
        if image != size:
            bad.append((path, image))
    if unreadable:
        logger.warning(
            "skipping %d unreadable image files (skip_bad_images), the first: %s",
            len(unreadable),
            unreadable[0],
        )
    if bad and not resize:
        raise size_refusal(bad, len(bad), f"read the headers of all {len(paths)} files", size)
    return usable


def sample_keys(keys: list[int], n_random: int = 10, seed: int = 0) -> list[int]:
    """The first and last three keys and `n_random` others (fixed by `seed`)."""
    ends = keys[:3] + keys[-3:]
    rest = keys[3:-3]
    picked = random.Random(seed).sample(rest, min(n_random, len(rest))) if rest else []
    return list(dict.fromkeys(ends + sorted(picked)))


def check_records(
    read_payload: Callable[[int], bytes],
    keys: list[int],
    rec_path: str,
    property_path: str,
    property_hw: tuple[int, int],
    resize: bool,
    skip_bad_images: bool = False,
) -> None:
    """`property`'s height and width, and a sample of records' headers, must say 112x112
    (unless `resize`); records must agree with `property` either way. A sampled record that
    cannot be read is an ImageDecodeError, or left out of the sample with `skip_bad_images`."""
    if tuple(property_hw) != FACE_SIZE and not resize:
        h, w = property_hw
        raise ImageSizeError(
            f"{property_path}: images are {w}x{h}, not {FACE_SIZE[1]}x{FACE_SIZE[0]}; {RESIZE_HINT}"
        )
    sample = sample_keys(keys)
    bad = []
    for key in sample:
        where = f"key {key}"
        try:
            size = image_size(read_payload(key), f"{rec_path} {where}")
        except ImageDecodeError:
            if skip_bad_images:
                continue
            raise
        if size != tuple(property_hw):
            bad.append((where, size))
    if bad:
        ph, pw = property_hw
        raise ImageSizeError(
            f"{property_path} says {pw}x{ph}, but {len(bad)} of {len(sample)} sampled records "
            f"(first, last and random keys) differ: "
            + ", ".join(f"{n} ({w}x{h})" for n, (h, w) in bad[:SHOWN])
            + "; repack the set (python -m scripts.pack_rec, --resize if needed)"
        )

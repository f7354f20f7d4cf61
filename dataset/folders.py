"""Image folders: one sub-folder per identity, as torchvision's ImageFolder; or, for label-free
training, every image under a folder."""
from __future__ import annotations

import os
import stat

from dataset.errors import DataLayoutError
from dataset.images import IMAGE_EXTENSIONS


def regular_file(path: str) -> bool:
    """Whether `path` is a regular file (or a link to one). Only those are opened: a FIFO or a
    device named like an image would block the reader or never end."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def not_regular(paths: list[str]) -> DataLayoutError | None:
    """The error naming the first of `paths` that exists and is not a regular file, or None."""
    odd = [p for p in paths if os.path.exists(p) and not regular_file(p)]  # a missing one: 'not found' later
    if not odd:
        return None
    more = f" ({len(odd)} such entries)" if len(odd) > 1 else ""
    return DataLayoutError(f"{odd[0]}: not a regular file (a folder, FIFO, socket or device named like an "
                           f"image){more}; only image files are read: move it out")


def list_identity_folders(root: str) -> tuple[list[str], list[list[str]]]:
    """(identity names, image paths of each): sorted sub-folder names are labels 0..C-1.
    A sub-folder without images is an error (it would be a class no sample belongs to)."""
    if not os.path.isdir(root):
        raise DataLayoutError(f"{root}: image folder not found")
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    if not names:
        raise DataLayoutError(f"{root}: no identity sub-folders")
    groups = [[os.path.join(root, n, f) for f in sorted(os.listdir(os.path.join(root, n)))
               if f.lower().endswith(IMAGE_EXTENSIONS)] for n in names]
    odd = not_regular([p for g in groups for p in g])
    if odd is not None:
        raise odd
    empty = [n for n, g in zip(names, groups) if not g]
    if empty:
        raise DataLayoutError(f"{os.path.join(root, empty[0])}: identity folder without images "
                              f"({len(empty)} such folders; extensions {', '.join(IMAGE_EXTENSIONS)})")
    return names, groups


def list_images(root: str) -> list[str]:
    """Every image under `root`, at any depth, for label-free training (README 'Distillation').
    The order: a folder's own images (sorted), then each sub-folder's (sorted names), depth
    first; for a folder of identity sub-folders this is `list_identity_folders`' order, so one
    teacher file serves both readings of it."""
    if not os.path.isdir(root):
        raise DataLayoutError(f"{root}: image folder not found")
    paths = []
    for folder, subfolders, files in os.walk(root):
        subfolders.sort()  # os.walk descends in this list's order
        paths += [os.path.join(folder, f) for f in sorted(files) if f.lower().endswith(IMAGE_EXTENSIONS)]
    odd = not_regular(paths)
    if odd is not None:
        raise odd
    if not paths:
        raise DataLayoutError(f"{root}: no images at any depth (extensions {', '.join(IMAGE_EXTENSIONS)})")
    return paths

"""Image folders with one sub-folder per identity, as torchvision's ImageFolder."""
from __future__ import annotations

import os

from dataset.errors import DataLayoutError
from dataset.images import IMAGE_EXTENSIONS


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
    empty = [n for n, g in zip(names, groups) if not g]
    if empty:
        raise DataLayoutError(f"{os.path.join(root, empty[0])}: identity folder without images "
                              f"({len(empty)} such folders; extensions {', '.join(IMAGE_EXTENSIONS)})")
    return names, groups

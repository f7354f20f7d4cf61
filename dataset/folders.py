"""Image folders: one sub-folder per identity, as torchvision's ImageFolder; or, for label-free
training, every image under a folder.

Every tool walks folders one way (`walk_images`, `identity_folders`): symlinked folders are
followed (each real folder once, so a link back up the tree is no loop), and hidden folders
(names starting with `.`: .git, the gallery's cache parts) are skipped; a hidden folder that
holds images is named in one warning, never left out without a word."""

from __future__ import annotations

import logging
import os
import stat

from shardface.dataset.errors import DataLayoutError
from shardface.dataset.images import IMAGE_EXTENSIONS

logger = logging.getLogger("shardface")
SHOWN = 3  # folders named in a warning


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
    return DataLayoutError(
        f"{odd[0]}: not a regular file (a folder, FIFO, socket or device named like an "
        f"image){more}; only image files are read: move it out"
    )


def hidden(name: str) -> bool:
    return name.startswith(".")


def _has_image(folder: str) -> bool:
    return any(
        f.lower().endswith(IMAGE_EXTENSIONS)
        for _, _, files in os.walk(folder, followlinks=True)
        for f in files
    )


def warn_hidden(folders: list[str]) -> None:
    """One warning naming the hidden folders among `folders` that hold images (skipped)."""
    with_images = [f for f in folders if _has_image(f)]
    if with_images:
        more = f" and {len(with_images) - SHOWN} more" if len(with_images) > SHOWN else ""
        logger.warning(
            "skipped %d hidden folder(s) holding images (names starting with '.'): %s%s; rename them "
            "to include them",
            len(with_images),
            ", ".join(with_images[:SHOWN]),
            more,
        )


def walk_images(root: str, warn: bool = True) -> list[str]:
    """Every image file under the folder `root`, at any depth: a folder's own images (sorted),
    then each sub-folder's (sorted names), depth first. Symlinked folders are followed, each
    real folder once and none that holds `root` (a link up the tree); hidden folders are
    skipped, those holding images named (`warn_hidden`)."""
    paths, skipped, seen = [], [], set()
    top = os.path.realpath(root)
    pending = [root]
    while pending:
        folder = pending.pop()
        real = os.path.realpath(folder)
        if real in seen or top.startswith(
            real.rstrip(os.sep) + os.sep
        ):  # walked already, or a link up the tree
            continue
        seen.add(real)
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
        subfolders = []
        for entry in entries:
            if entry.is_dir():  # a link to a folder too
                (skipped if hidden(entry.name) else subfolders).append(entry.path)
            elif entry.name.lower().endswith(IMAGE_EXTENSIONS):
                paths.append(entry.path)
        pending.extend(reversed(subfolders))  # depth first, in name order
    if warn:
        warn_hidden(skipped)
    return paths


def identity_folders(root: str) -> list[str]:
    """The names of `root`'s identity sub-folders, sorted (links to folders too); hidden ones are
    skipped, those holding images named (`warn_hidden`)."""
    names = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    warn_hidden([os.path.join(root, d) for d in names if hidden(d)])
    return [d for d in names if not hidden(d)]


def list_identity_folders(root: str) -> tuple[list[str], list[list[str]]]:
    """(identity names, image paths of each): sorted sub-folder names are labels 0..C-1.
    A sub-folder without images is an error (it would be a class no sample belongs to)."""
    if not os.path.isdir(root):
        raise DataLayoutError(f"{root}: image folder not found")
    names = identity_folders(root)
    if not names:
        raise DataLayoutError(f"{root}: no identity sub-folders")
    groups = [
        [
            os.path.join(root, n, f)
            for f in sorted(os.listdir(os.path.join(root, n)))
            if f.lower().endswith(IMAGE_EXTENSIONS)
        ]
        for n in names
    ]
    odd = not_regular([p for g in groups for p in g])
    if odd is not None:
        raise odd
    empty = [n for n, g in zip(names, groups) if not g]
    if empty:
        raise DataLayoutError(
            f"{os.path.join(root, empty[0])}: identity folder without images "
            f"({len(empty)} such folders; extensions {', '.join(IMAGE_EXTENSIONS)})"
        )
    return names, groups


def list_images(root: str) -> list[str]:
    """Every image under `root`, at any depth, for label-free training (docs/distillation.md).
    The order: a folder's own images (sorted), then each sub-folder's (sorted names), depth
    first; for a folder of identity sub-folders this is `list_identity_folders`' order, so one
    teacher file serves both readings of it."""
    if not os.path.isdir(root):
        raise DataLayoutError(f"{root}: image folder not found")
    paths = walk_images(root)
    odd = not_regular(paths)
    if odd is not None:
        raise odd
    if not paths:
        raise DataLayoutError(f"{root}: no images at any depth (extensions {', '.join(IMAGE_EXTENSIONS)})")
    return paths


def image_files(inputs: list[str]) -> list[str]:
    """Image files and the images under folders (recursively, sorted), in the order given."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(walk_images(item))  # links followed, hidden folders skipped (named)
            if not found:
                raise DataLayoutError(f"{item}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            odd = not_regular(found)  # a FIFO named like an image would block the read forever
            if odd is not None:
                raise odd
            files.extend(found)
        elif regular_file(item):
            files.append(item)
        elif os.path.exists(item):
            raise DataLayoutError(
                f"{item}: not a regular file (a FIFO, socket or device); only image files are read"
            )
        else:
            raise DataLayoutError(f"{item}: no such image file or folder")
    return files

"""Write a training set in the insightface RecordIO layout."""
from __future__ import annotations

import os
from typing import Iterable

from dataset.recordio import IRHeader, RecordWriter, pack


def write_insightface_rec(out_dir: str, identities: Iterable[list[bytes]], num_images: int,
                          num_classes: int, progress=None, overwrite: bool = False) -> None:
    """`identities` yields, for labels 0, 1, ..., the list of encoded 112x112 images of that
    identity.

    Layout: key 0 is a header whose labels are (N + 1, N + 1 + C); images are keys 1..N with
    their class as label; keys N+1 .. N+C are per-identity records whose labels give the
    identity's image key range; `property` holds `num_classes,112,112`.

    The files are written under temporary names beside the final ones and renamed only once
    all are complete: a pack that fails partway (an unreadable image, a full disk) leaves an
    earlier set in `out_dir` as it was.
    """
    paths = [os.path.join(out_dir, n) for n in ("train.rec", "train.idx", "property")]
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass --overwrite to replace it")
    os.makedirs(out_dir, exist_ok=True)
    temps = [os.path.join(out_dir, f".{os.path.basename(p)}.partial-{os.getpid()}") for p in paths]
    try:
        _write(temps, identities, num_images, num_classes, progress)
        for tmp in temps:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        for tmp, path in zip(temps, paths):
            os.replace(tmp, path)
    finally:
        for tmp in temps:
            if os.path.exists(tmp):
                os.remove(tmp)


def _write(paths: list[str], identities, num_images: int, num_classes: int, progress) -> None:
    ranges, key = [], 1
    with RecordWriter(paths[1], paths[0]) as writer:
        writer.write(0, pack(IRHeader(0, [num_images + 1, num_images + 1 + num_classes], 0, 0), b""))
        for label, images in enumerate(identities):
            start = key
            for data in images:
                writer.write(key, pack(IRHeader(0, float(label), key, 0), data))
                key += 1
                if progress is not None:
                    progress.update()
            ranges.append((start, key))
        if key != num_images + 1 or len(ranges) != num_classes:
            raise ValueError(f"expected {num_images} images of {num_classes} identities, "
                             f"got {key - 1} of {len(ranges)}")
        for label, (start, end) in enumerate(ranges):
            writer.write(num_images + 1 + label, pack(IRHeader(0, [start, end], 0, 0), b""))
    with open(paths[2], "w") as f:
        f.write(f"{num_classes},112,112\n")

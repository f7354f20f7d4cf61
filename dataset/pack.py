"""Write a training set in the insightface RecordIO layout."""

from __future__ import annotations

import os
from typing import Iterable

from shardface.dataset.recordio import IRHeader, RecordWriter, pack
from shardface.errors import OutputError
from shardface.utils.atomic import publishing_set, recover


def rec_set(out_dir: str) -> list[str]:
    """The files of a packed set, its key (train.idx, what every reader opens first) last."""
    return [os.path.join(out_dir, n) for n in ("property", "train.rec", "train.idx")]


def recover_rec_set(out_dir: str) -> bool:
    """Put back the earlier set where a pack killed mid-swap left no train.idx (utils.atomic's
    journal); True when it did."""
    return recover(rec_set(out_dir))


def write_insightface_rec(
    out_dir: str,
    identities: Iterable[list[bytes]],
    num_images: int,
    num_classes: int,
    progress=None,
    overwrite: bool = False,
) -> None:
    """`identities` yields, for labels 0, 1, ..., the list of encoded 112x112 images of that
    identity.

    Layout: key 0 is a header whose labels are (N + 1, N + 1 + C); images are keys 1..N with
    their class as label; keys N+1 .. N+C are per-identity records whose labels give the
    identity's image key range; `property` holds `num_classes,112,112`.

    The three files are published as one set by `utils.atomic.publishing_set`, train.idx
    (what every reader opens first) last: a pack that fails or is killed before the swap leaves
    an earlier set in `out_dir` as it was; one killed during the swap leaves no train.idx (no
    reader takes a mixed set for a good one) and the journal of the earlier set, which the next
    pack or reader puts back (`recover_rec_set`).
    """
    paths = rec_set(out_dir)
    existing = [p for p in paths if os.path.exists(p)]
    if existing and not overwrite:
        raise OutputError(f"{existing[0]} exists; pass --overwrite to replace it")
    os.makedirs(out_dir, exist_ok=True)
    with publishing_set(paths) as (prop, rec, idx):
        _write([rec, idx, prop], identities, num_images, num_classes, progress)


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
            raise ValueError(
                f"expected {num_images} images of {num_classes} identities, got {key - 1} of {len(ranges)}"
            )
        for label, (start, end) in enumerate(ranges):
            writer.write(num_images + 1 + label, pack(IRHeader(0, [start, end], 0, 0), b""))
    with open(paths[2], "w") as f:
        f.write(f"{num_classes},112,112\n")

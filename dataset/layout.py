"""Which keys of a `.rec` are training images: the insightface layout or the im2rec one.

insightface: key 0 is a header record that holds no image; its two labels (a, b) say the
images are keys 1 .. a-1 and the identity records keys a .. b-1 (each labelled with its
identity's image key range), and `property` holds `b - a,112,112`. im2rec: every key is an
image, and its records may carry packed labels (flag > 0) as well. So record 0's flag alone
cannot tell them apart: a packed-label im2rec image read as a header hides every image past
its class number. The layout is decided by whether record 0 holds an image and whether its
labels describe this index and property file; what fits both, or neither, is refused.
"""

from __future__ import annotations

import bisect
import logging

import numpy as np

from shardface.dataset.errors import RecordIOError
from shardface.dataset.recordio import IndexedRecordReader, unpack

logger = logging.getLogger("shardface")
_REPACK = "re-pack the images with `python -m scripts.pack_rec` (insightface layout)"


def _labels(header) -> list[float]:
    return [] if header.flag == 0 else [float(v) for v in np.asarray(header.label).ravel()]


def _header_mismatch(
    reader: IndexedRecordReader,
    labels: list[float],
    first: int,
    declared_classes: int | None,
    property_path: str,
) -> str | None:
    """Why record `first` with `labels` is not an insightface header of this index, or None."""
    keys = reader.keys
    if first != 0:
        return f"a header is key 0, but the index starts at key {first}"
    if len(labels) < 2 or not all(v.is_integer() for v in labels[:2]) or not 1 < labels[0] < labels[1]:
        return f"its labels {labels} are not an image/identity key range (a, b) with 1 < a < b"
    a, b = int(labels[0]), int(labels[1])
    images_all_there = bisect.bisect_left(keys, a) == a  # keys are unique and start at 0
    identities = len(keys) - a
    if not images_all_there or identities not in (0, b - a) or keys[-1] != a + identities - 1:
        return (
            f"it puts images at keys 1..{a - 1} and identity records at keys {a}..{b - 1}, "
            f"but the index holds {len(keys)} keys from {keys[0]} to {keys[-1]}"
        )
    if declared_classes is not None and declared_classes != b - a:
        return f"it counts {b - a} identities, {property_path} says {declared_classes} classes"
    if identities:  # the identity records' labels are image key ranges, from 1 up to a
        head, _ = unpack(reader.read(a), f"{reader.rec_path} key {a}")
        tail, _ = unpack(reader.read(b - 1), f"{reader.rec_path} key {b - 1}")
        head_range, tail_range = _labels(head), _labels(tail)
        if len(head_range) < 2 or len(tail_range) < 2 or head_range[0] != 1 or tail_range[1] != a:
            return (
                f"its identity records (keys {a} and {b - 1}) have labels {head_range} and {tail_range}, "
                f"not image key ranges from 1 to {a}"
            )
    return None


def image_keys(reader: IndexedRecordReader, property_path: str, declared_classes: int | None) -> list[int]:
    """The keys of the training images in `reader`, by the rules in this module's docstring.
    `declared_classes` is the class count `property_path` holds (None when there is none)."""
    first = reader.keys[0]
    header, payload = unpack(reader.read(first), f"{reader.rec_path} key {first}")
    if header.flag == 0:  # an insightface header always carries its two labels
        return list(reader.keys)
    labels = _labels(header)
    mismatch = _header_mismatch(reader, labels, first, declared_classes, property_path)
    holds_image = len(payload) > 0
    if holds_image and mismatch is not None:
        logger.info(
            "%s: im2rec layout (key %d holds an image; as a header %s): all %d keys are images",
            reader.rec_path,
            first,
            mismatch,
            len(reader.keys),
        )
        return list(reader.keys)
    if holds_image:
        raise RecordIOError(
            f"{reader.rec_path}: ambiguous layout: key 0 holds an image, and its labels {labels[:2]} also read as "
            f"an insightface header that fits {reader.idx_path} and {property_path}; {_REPACK}"
        )
    if mismatch is not None:
        raise RecordIOError(
            f"{reader.rec_path}: key {first} is a header record (labels {labels}, no image) that does not match "
            f"{reader.idx_path}: {mismatch}; the files do not belong together or one is truncated: restore "
            f"the set's own .idx and property, or {_REPACK}"
        )
    return list(range(1, int(labels[0])))


def class_count(
    reader: IndexedRecordReader, keys: list[int], property_path: str, declared_classes: int | None
) -> tuple[int | None, str]:
    """(the set's own class count, where it came from): `property` when there is one, else an
    insightface header's identity range (b - a; record 0 is not among the image `keys`), as
    arcface_torch reads such a set; (None, "") for an im2rec set without `property`, whose
    count only the config can give."""
    if declared_classes is not None:
        return declared_classes, property_path
    first = reader.keys[0]
    if keys and keys[0] != first:  # image_keys took record `first` for an insightface header
        labels = _labels(unpack(reader.read(first), f"{reader.rec_path} key {first}")[0])
        return int(labels[1]) - int(labels[0]), f"{reader.rec_path} header (key {first}; no {property_path})"
    return None, ""

"""A cheap identity of a training set's order, saved with each checkpoint.

A resumed run continues at a position in the epoch's permutation of `len(dataset)` indices;
that position names the same samples only while index i names the same sample. These hashes
cover what fixes that mapping, cheaply. RecordIO: the image count, the .rec and .idx sizes,
the first and last index entries and the bytes of the first and last few records (O(1) even
for WebFace42M's 42M keys: the .rec is not read through). Folders: for every image in order,
its relative path as `identity/file`, its size and its first and last `_BLOCK` bytes, so the
same names holding other people's photos differ (two small reads per file, which the check at
start has just read: about 2 s per 100k images on 2 cores). Neither depends on where the set lies:
a moved copy resumes where it stopped. A teacher file (distill/teacher.py) records it too.
"""

from __future__ import annotations

import hashlib
import os

from shardface.dataset.errors import DataLayoutError

_ENDS = 64  # index entries hashed at each end of a RecordIO set
_READ = 4  # records hashed at each end
_BLOCK = 4096  # bytes hashed at each end of a folder's image (most 112x112 crops: the whole file)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode("utf-8", "surrogateescape"))
        h.update(b"\0")
    return h.hexdigest()[:16]


def recordio_fingerprint(reader, keys: list[int]) -> str:
    """`reader`: the set's IndexedRecordReader; `keys`: its image keys in dataset order."""
    ends = keys[:_ENDS] + keys[-_ENDS:]
    h = hashlib.sha256()
    for key in keys[:_READ] + keys[-_READ:]:  # equal sizes everywhere still differ in these bytes
        h.update(reader.read(key))
    return _digest(
        "recordio",
        str(len(keys)),
        str(reader.size),
        str(os.path.getsize(reader.idx_path)),
        " ".join(f"{k}:{reader.index[k]}" for k in ends),
        h.hexdigest(),
    )


def file_ends(fd: int, size: int, block: int) -> bytes:
    """The first `block` bytes of the open file `fd` of `size` bytes and, past them, its last
    `block` (the whole of a file up to two blocks long): what content keys hash."""
    head = os.pread(fd, block, 0)
    return head + (os.pread(fd, block, max(block, size - block)) if size > block else b"")


def folder_fingerprint(paths: list[str]) -> str:
    """`paths`: every image (`root/identity/file`), in dataset order."""
    h = hashlib.sha256()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                h.update(f"{'/'.join(path.split(os.sep)[-2:])}\0{size}\0".encode("utf-8", "surrogateescape"))
                h.update(file_ends(fd, size, _BLOCK))
            finally:
                os.close(fd)
        except OSError as exc:
            raise DataLayoutError(f"{path}: cannot read image ({exc.strerror})") from None
    return _digest("folders", str(len(paths)), h.hexdigest())


def synthetic_fingerprint(length: int, num_classes: int) -> str:
    return _digest("synthetic", str(length), str(num_classes))

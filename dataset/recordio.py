"""MXNet RecordIO (`.rec` + `.idx`) read and written with numpy and the standard library.

Record layout (dmlc-core): uint32 magic 0xced7230a, uint32 lrecord (upper 3 bits: part
flag, lower 29: length), payload, zero padding to 4 bytes. A payload containing the magic
word at a 4-byte aligned position is written as parts (flag 1 first, 2 middle, 3 last) with
that word removed; reading re-joins the parts and puts the magic word back.
Image payloads start with the header struct `IfQQ` (flag, label, id, id2); when flag > 0,
`flag` float32 labels follow the header and replace `label`.
"""

from __future__ import annotations

import codecs
import os
import struct
from typing import NamedTuple

import numpy as np

from shardface.dataset.errors import RecordIOError

MAGIC = 0xCED7230A
_MAGIC_BYTES = struct.pack("<I", MAGIC)
_HEADER = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1


class IRHeader(NamedTuple):
    flag: int
    label: float | np.ndarray
    id: int
    id2: int


def pack(header: IRHeader, payload: bytes) -> bytes:
    """Header (and extra float labels) followed by `payload`, as mxnet.recordio.pack."""
    label = header.label
    if isinstance(label, (int, float, np.floating, np.integer)):
        return _HEADER.pack(0, float(label), header.id, header.id2) + payload
    labels = np.asarray(label, dtype=np.float32).ravel()
    return _HEADER.pack(labels.size, 0.0, header.id, header.id2) + labels.tobytes() + payload


def unpack(record: bytes, where: str = "record") -> tuple[IRHeader, bytes]:
    if len(record) < _HEADER.size:
        raise RecordIOError(f"{where}: {len(record)} bytes, shorter than the {_HEADER.size}-byte header")
    flag, label, id1, id2 = _HEADER.unpack_from(record)
    body = memoryview(record)[_HEADER.size :]
    if flag > 0:
        if len(body) < 4 * flag:
            raise RecordIOError(f"{where}: header announces {flag} labels, record too short")
        label = np.frombuffer(body[: 4 * flag], dtype=np.float32).copy()
        body = body[4 * flag :]
    return IRHeader(flag, label, id1, id2), bytes(body)


def _frame(flag: int, data) -> bytes:
    n = len(data)
    pad = (-n) % 4
    return _MAGIC_BYTES + struct.pack("<I", (flag << 29) | n) + bytes(data) + b"\0" * pad


def encode_record(payload: bytes) -> bytes:
    """The bytes MXNet writes for one record, split into parts around aligned magic words."""
    if len(payload) >= 1 << 29:
        raise RecordIOError(f"record of {len(payload)} bytes exceeds the 2^29 limit")
    arr = np.frombuffer(payload[: len(payload) // 4 * 4], dtype="<u4")
    cuts = (np.nonzero(arr == MAGIC)[0] * 4).tolist()
    if not cuts:
        return _frame(0, payload)
    out, start = [], 0
    for i, cut in enumerate(cuts):
        out.append(_frame(1 if i == 0 else 2, payload[start:cut]))
        start = cut + 4
    out.append(_frame(3, payload[start:]))
    return b"".join(out)


class RecordWriter:
    """Append records to `<prefix>.rec` and their offsets to `<prefix>.idx`."""

    def __init__(self, idx_path: str, rec_path: str):
        self.idx_path, self.rec_path = idx_path, rec_path
        self._rec = open(rec_path, "wb")
        self._idx = open(idx_path, "w")

    def write(self, key: int, payload: bytes) -> None:
        self._idx.write(f"{key}\t{self._rec.tell()}\n")
        self._rec.write(encode_record(payload))

    def close(self) -> None:
        self._rec.close()
        self._idx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_index(idx_path: str, rec_size: int | None = None) -> dict[int, int]:
    if not os.path.isfile(idx_path):
        raise RecordIOError(f"{idx_path}: index file not found")
    index: dict[int, int] = {}
    seen: dict[int, int] = {}  # offset -> key
    with open(idx_path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == 1 and raw.startswith(codecs.BOM_UTF8):  # an editor's byte-order mark, not a key
                raw = raw[len(codecs.BOM_UTF8) :]
            try:
                line = raw.decode("ascii")
            except UnicodeDecodeError:
                raise RecordIOError(
                    f"{idx_path}:{lineno}: not a text index (expected lines 'key<TAB>offset', "
                    f"found binary bytes {raw[:16]!r}); is it the .rec, or damaged?"
                ) from None
            if not line.strip():
                continue
            parts = line.split("\t")
            try:
                key, offset = int(parts[0]), int(parts[1])
            except (ValueError, IndexError):
                raise RecordIOError(f"{idx_path}:{lineno}: expected 'key<TAB>offset', got {line!r}") from None
            if rec_size is not None and not 0 <= offset <= rec_size - 8:
                raise RecordIOError(
                    f"{idx_path}: key {key} points at offset {offset}, "
                    f"past the end of the .rec ({rec_size} bytes)"
                )
            if key in index or offset in seen:
                what = (
                    f"key {key} appears twice"
                    if key in index
                    else f"keys {seen[offset]} and {key} point at the same offset {offset}"
                )
                raise RecordIOError(f"{idx_path}:{lineno}: {what}: the same image would be trained twice")
            index[key] = offset
            seen[offset] = key
    return index


class IndexedRecordReader:
    """Random access to records by key. The file is opened lazily and re-opened after a fork,
    so each DataLoader worker reads through its own descriptor. A record is fetched with one
    `pread` of the bytes up to the next indexed offset, then its parts are parsed in memory."""

    def __init__(self, idx_path: str, rec_path: str):
        if not os.path.isfile(rec_path):
            raise RecordIOError(f"{rec_path}: record file not found")
        self.idx_path, self.rec_path = idx_path, rec_path
        self.size = os.path.getsize(rec_path)
        self.index = read_index(idx_path, self.size)
        self.keys = sorted(self.index)
        starts = sorted(set(self.index.values())) + [self.size]
        following = dict(zip(starts[:-1], starts[1:]))
        self.span = {key: following[offset] - offset for key, offset in self.index.items()}
        self._fd, self._pid = None, None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_fd"], state["_pid"] = None, None
        return state

    def _descriptor(self) -> int:
        if self._fd is None or self._pid != os.getpid():
            self._fd = os.open(self.rec_path, os.O_RDONLY)
            self._pid = os.getpid()
        return self._fd

    def read_at(self, offset: int, key=None, span: int | None = None) -> bytes:
        where = f"{self.rec_path} (key {key}, offset {offset})"
        buf = os.pread(self._descriptor(), span or 8, offset)
        if len(buf) >= 8:  # the common case: one part, wholly read
            magic, lrec = struct.unpack_from("<II", buf)
            length = lrec & _LENGTH_MASK
            if magic == MAGIC and lrec >> 29 == 0 and 8 + length <= len(buf):
                return buf[8 : 8 + length]
        parts, pos = [], 0
        while True:
            if pos + 8 > len(buf):  # the record runs past what was read: read on
                more = os.pread(self._descriptor(), 8, offset + pos)
                if len(more) < 8:
                    raise RecordIOError(f"{where}: file truncated inside a record header at {offset + pos}")
                buf = buf[:pos] + more
            magic, lrec = struct.unpack_from("<II", buf, pos)
            if magic != MAGIC:
                raise RecordIOError(
                    f"{where}: bad magic 0x{magic:08x} at byte {offset + pos}, expected 0x{MAGIC:08x}"
                )
            flag, length = lrec >> 29, lrec & _LENGTH_MASK
            end = pos + 8 + length
            if end > len(buf):
                buf = buf[: pos + 8] + os.pread(self._descriptor(), length, offset + pos + 8)
                if end > len(buf):
                    raise RecordIOError(f"{where}: record truncated ({len(buf) - pos - 8} of {length} bytes)")
            parts.append(buf[pos + 8 : end])
            pos = end + (-length) % 4
            if flag in (0, 3):
                break
            if flag not in (1, 2):
                raise RecordIOError(f"{where}: invalid part flag {flag}")
        return parts[0] if len(parts) == 1 else _MAGIC_BYTES.join(parts)

    def read(self, key: int) -> bytes:
        try:
            offset = self.index[key]
        except KeyError:
            raise RecordIOError(f"{self.idx_path}: no key {key}") from None
        return self.read_at(offset, key, self.span[key])

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

"""RecordIO writer <-> reader round trips and each bad input named in the error."""

import os
import struct

import numpy as np
import pytest

from shardface.dataset.recordio import (
    MAGIC,
    IndexedRecordReader,
    IRHeader,
    RecordIOError,
    RecordWriter,
    encode_record,
    pack,
    unpack,
)

MAGIC_BYTES = struct.pack("<I", MAGIC)


def _write(tmp_path, payloads):
    idx, rec = str(tmp_path / "t.idx"), str(tmp_path / "t.rec")
    with RecordWriter(idx, rec) as w:
        for key, data in payloads.items():
            w.write(key, data)
    return IndexedRecordReader(idx, rec)


def test_single_and_multipart_records_round_trip(tmp_path):
    payloads = {
        0: b"",
        1: b"abc",  # needs padding
        2: b"x" * 8 + MAGIC_BYTES + b"y" * 5,  # one aligned magic word: 2 parts
        3: MAGIC_BYTES + b"z" * 4 + MAGIC_BYTES + MAGIC_BYTES + b"end",  # first/middle/last parts
        4: b"q" + MAGIC_BYTES + b"unaligned",  # unaligned magic: no split
    }
    reader = _write(tmp_path, payloads)
    for key, data in payloads.items():
        assert reader.read(key) == data
    assert encode_record(payloads[2]).count(MAGIC_BYTES) == 2
    assert len(encode_record(payloads[3])) % 4 == 0


def test_multipart_flags_match_dmlc_layout():
    rec = encode_record(b"abcd" + MAGIC_BYTES + b"ef")
    first = struct.unpack("<II", rec[:8])
    assert first == (MAGIC, (1 << 29) | 4)
    second = struct.unpack("<II", rec[12:20])
    assert second == (MAGIC, (3 << 29) | 2)


def test_header_with_extra_labels_round_trips():
    data = pack(IRHeader(0, [3.0, 7.5, 9.0], 11, 12), b"payload")
    header, body = unpack(data)
    assert header.flag == 3 and header.id == 11 and header.id2 == 12
    np.testing.assert_array_equal(header.label, np.array([3.0, 7.5, 9.0], dtype=np.float32))
    assert body == b"payload"
    header, body = unpack(pack(IRHeader(0, 42.0, 1, 0), b"img"))
    assert header.flag == 0 and header.label == 42.0 and body == b"img"


def test_wrong_magic_names_file_and_key(tmp_path):
    reader = _write(tmp_path, {0: b"aaaa", 1: b"bbbb"})
    with open(reader.rec_path, "r+b") as f:
        f.seek(reader.index[1])
        f.write(b"\0\0\0\0")
    reader = IndexedRecordReader(reader.idx_path, reader.rec_path)
    with pytest.raises(RecordIOError, match=r"t\.rec \(key 1.*bad magic"):
        reader.read(1)


def test_truncated_file_names_key(tmp_path):
    reader = _write(tmp_path, {0: b"a" * 100, 1: b"b" * 100})
    size = os.path.getsize(reader.rec_path)
    with open(reader.rec_path, "r+b") as f:
        f.truncate(size - 50)
    reader = IndexedRecordReader(reader.idx_path, reader.rec_path)
    assert reader.read(0) == b"a" * 100
    with pytest.raises(RecordIOError, match=r"key 1.*truncated"):
        reader.read(1)


def test_idx_offset_past_end_is_rejected(tmp_path):
    reader = _write(tmp_path, {0: b"aaaa"})
    with open(reader.idx_path, "a") as f:
        f.write("7\t999999\n")
    with pytest.raises(RecordIOError, match=r"t\.idx: key 7 points at offset 999999"):
        IndexedRecordReader(reader.idx_path, reader.rec_path)


def test_missing_idx_is_named(tmp_path):
    reader = _write(tmp_path, {0: b"aaaa"})
    os.remove(reader.idx_path)
    with pytest.raises(RecordIOError, match=r"t\.idx: index file not found"):
        IndexedRecordReader(reader.idx_path, reader.rec_path)


def test_idx_with_two_keys_at_one_offset_is_rejected(tmp_path):
    reader = _write(tmp_path, {0: b"aaaa", 1: b"bbbb"})
    with open(reader.idx_path, "a") as f:
        f.write(f"2\t{reader.index[1]}\n")
    with pytest.raises(RecordIOError, match=r"t\.idx:3: keys 1 and 2 point at the same offset"):
        IndexedRecordReader(reader.idx_path, reader.rec_path)


def test_binary_idx_is_refused_naming_the_file_not_a_unicode_error(tmp_path):
    reader = _write(tmp_path, {0: b"\xff\xfe" * 50, 1: b"bbbb"})
    with open(reader.rec_path, "rb") as src, open(reader.idx_path, "wb") as dst:
        dst.write(src.read())  # the .rec given as the index: binary bytes, not UTF-8
    with pytest.raises(RecordIOError, match=r"t\.idx:\d+: not a text index") as caught:
        IndexedRecordReader(reader.idx_path, reader.rec_path)
    assert "\n" not in str(caught.value)


def test_idx_with_a_utf8_bom_reads_its_first_key(tmp_path):
    """An index saved by an editor starts with a byte-order mark: it is not part of key 0."""
    reader = _write(tmp_path, {0: b"aaaa", 1: b"bbbb"})
    with open(reader.idx_path, "rb") as f:
        text = f.read()
    with open(reader.idx_path, "wb") as f:
        f.write(b"\xef\xbb\xbf" + text)
    again = IndexedRecordReader(reader.idx_path, reader.rec_path)
    assert again.read(0) == b"aaaa" and again.read(1) == b"bbbb"

"""The teacher file of distillation (`.teacher`), written and read here only: `write_teacher_file`
(scripts.teach) and `TeacherFile` (training).

The bytes MAGIC, a uint32 little-endian header length, a UTF-8 JSON header, zero padding to a
multiple of 64 bytes, then `data_size` rows of `dim` float16: row i is the L2-normalised sum of
the teacher's embeddings of record i and of its mirror image, so one row serves both the flips
training draws. The header (`format` FORMAT) names the data set (path, size, fingerprint of its
images' names and content: dataset/fingerprint.py), how its images were read (`transform`:
align, its detector, resize) and the teacher (name, fingerprint, template): a file made from
other data, or from the same data read otherwise, is refused by name, and so is a file of an
older format (its fingerprint covered names only). Rows are read by record index, so shuffling,
resume and any world size read the right ones. Every row is a unit vector (to UNIT_TOLERANCE, the
float16 rounding of a unit row is far inside it): a file with rows that are not finite, or not
unit (all zero, or of norm 1e-4, whose targets would be constant or whose mean would centre
nothing), is refused when it is opened, naming the file and the first rows, and scripts.teach
refuses a teacher whose embedding of a record gives such a row; the same read gives the rows'
mean (distill_center)."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import torch
from torch.utils.data import DataLoader

from shardface.errors import ConfigError, ModelError
from shardface.utils.atomic import publishing
from shardface.utils.progress import progress_bar

MAGIC = b"SHARDFACE-TEACHER\n"
ALIGN = 64
FORMAT = 2  # 1: the data fingerprint covered image names only, and no transform was recorded
_SCAN_BYTES = 64 << 20  # rows checked per read when a file is opened
_FP16_EXPONENT = 0x7C00  # all exponent bits set: inf or NaN
UNIT_TOLERANCE = 1e-2  # |norm - 1| a row may have: float16 rounds a unit row's norm by < 1e-3


def data_transform(cfg) -> dict:
    """How a run (or scripts.teach) reads its images, as a teacher file records it: a file
    made from resized images does not serve a run on aligned faces of the same photos."""
    return {
        "align": bool(cfg.align),
        "align_detector": cfg.align_detector if cfg.align else None,
        "resize": bool(cfg.resize),
    }


def _described(transform: dict) -> str:
    if transform.get("align"):
        return f"align true (detector {transform.get('align_detector')})"
    return f"align false, resize {str(bool(transform.get('resize'))).lower()}"


def is_teacher_file(path: str) -> bool:
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def header_bytes(header: dict) -> bytes:
    """MAGIC, length, JSON and padding: the bytes before the first row."""
    body = json.dumps(header, sort_keys=True).encode()
    head = MAGIC + struct.pack("<I", len(body)) + body
    return head + b"\0" * (-len(head) % ALIGN)


def read_header(path: str) -> tuple[dict, int]:
    """(header, offset of the first row)."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ConfigError(f"{path}: not a teacher file of scripts.teach")
        length = f.read(4)
        if len(length) < 4:
            raise ConfigError(f"{path}: teacher file cut inside its header; run scripts.teach again")
        (n,) = struct.unpack("<I", length)
        body = f.read(n)
    if len(body) < n:
        raise ConfigError(
            f"{path}: teacher file cut inside its header ({len(body)} of its {n} bytes); "
            f"run scripts.teach again"
        )
    try:
        header = json.loads(body.decode())
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: teacher file with an unreadable header; run scripts.teach again")
    offset = len(MAGIC) + 4 + n
    return header, offset + (-offset % ALIGN)


class TeacherFile:
    """Precomputed targets read by record index (see the module docstring). Opening it checks
    the format and that every row is finite; `check_data` refuses a file made from another data
    set, or from the same one read otherwise, naming both."""

    def __init__(self, path: str):
        self.path = path
        self.header, offset = read_header(path)
        made = self.header.get("format")
        if made != FORMAT:
            why = (
                "made by an older scripts.teach, whose data fingerprint covers image names only and not "
                "their content or preprocessing"
                if isinstance(made, int) and made < FORMAT
                else f"of an unknown format (this version reads {FORMAT})"
            )
            raise ConfigError(
                f"{path}: teacher file format {made}, {why}: remake it with `python -m scripts.teach`"
            )
        try:
            self.size, self.dim = int(self.header["data_size"]), int(self.header["dim"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: teacher file header lacks data_size or dim") from None
        if self.size < 1 or self.dim < 1:
            raise ConfigError(
                f"{path}: teacher file header says {self.size} x {self.dim} rows; run scripts.teach again"
            )
        expected = offset + self.size * self.dim * 2
        if os.path.getsize(path) != expected:
            raise ConfigError(
                f"{path}: teacher file is {os.path.getsize(path)} bytes, its header says {expected} "
                f"({self.size} x {self.dim} float16): truncated or damaged; run scripts.teach again"
            )
        self.offset = offset
        self.rows = self._map()
        self._check_rows()

    def _map(self) -> np.memmap:
        return np.memmap(self.path, dtype="<f2", mode="r", offset=self.offset, shape=(self.size, self.dim))

    def __getstate__(self) -> dict:  # a worker started by spawn maps the file itself, not a pickled copy
        return {k: v for k, v in self.__dict__.items() if k != "rows"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.rows = self._map()

    def row(self, index: int) -> torch.Tensor:
        """Record `index`'s row, D float32: read in a DataLoader worker (the loader's
        `teacher_rows`), so a batch's rows arrive with its images, pinned, and the training
        thread makes no random reads and no copy from pageable memory."""
        return torch.from_numpy(self.rows[int(index)].astype(np.float32))

    @property
    def teacher_rows(self):
        return self.row

    def read(self, indices) -> torch.Tensor:
        """b x D float32 rows of the records `indices`, on the CPU (what the loader's batches hold)."""
        return torch.stack([self.row(i) for i in np.asarray(indices, dtype=np.int64).reshape(-1)])

    def _check_rows(self) -> None:
        """At start, every row is finite and a unit vector: one sequential read of the file (about
        1.5 s per GB on 2 cores) finds a bad row before the run is accepted, rather than hours in as
        a NaN loss that looks like divergence, or as targets that teach nothing (zero rows: one
        constant target; rows of norm 1e-4: a mean near zero, so centring them does nothing). An fp16
        value is inf or NaN when its exponent bits are all set."""
        bits = self.rows.view("<u2")
        step = max(1, _SCAN_BYTES // (2 * max(self.dim, 1)))
        bad = {
            "finite": _Named(),
            "unit": _Named(),
        }  # the first 10 bad rows of each kind are named, all counted
        total = np.zeros(self.dim, np.float64)  # the same read gives the rows' mean (distill_center)
        for start in range(0, self.size, step):
            chunk = np.asarray(bits[start : start + step])
            finite = ~((chunk & _FP16_EXPONENT) == _FP16_EXPONENT).any(axis=1)
            values = chunk.view("<f2").astype(np.float32)
            norms = np.sqrt(np.einsum("ij,ij->i", values, values, dtype=np.float64))
            bad["finite"].add(np.flatnonzero(~finite) + start)
            off = np.flatnonzero(finite & ~(np.abs(norms - 1.0) <= UNIT_TOLERANCE))
            bad["unit"].add(off + start, norms[off])
            if not bad["finite"].count:
                total += values.sum(0, dtype=np.float64)
        self.mean = (total / self.size).astype(np.float32)
        if bad["finite"].count:
            raise ConfigError(
                f"{self.path}: {bad['finite'].count} of {self.size} teacher rows are not finite (NaN or "
                f"inf): rows {bad['finite'].names()}; the file is damaged or its teacher's "
                f"output was unusable: run scripts.teach again"
            )
        if bad["unit"].count:
            raise ConfigError(
                f"{self.path}: {bad['unit'].count} of {self.size} teacher rows are not unit vectors "
                f"(norm 1 within {UNIT_TOLERANCE:g}, as scripts.teach writes them): rows "
                f"{bad['unit'].names()}, the first of norm {bad['unit'].first_value:.3g}; zero or "
                f"near-zero rows give constant targets: the file is damaged, not scripts.teach's, or "
                f"its teacher's output was unusable: run scripts.teach again"
            )

    @property
    def name(self) -> str:
        return f"{self.path} (teacher {self.header.get('teacher')})"

    @property
    def fingerprint(self) -> str:
        """The fingerprint of the teacher that made the rows ("" in a header without one)."""
        return str(self.header.get("teacher_fingerprint") or "")

    def check_data(self, data: str, size: int, fingerprint: str, transform: dict) -> None:
        """The run's data (`data` path, record count, fingerprint, `data_transform`) is the one
        this file was made from, read the same way."""
        if self.header.get("transform") != transform:
            raise ConfigError(
                f"teacher file {self.path} was made from {self.header.get('data')} read with "
                f"{_described(self.header.get('transform') or {})}; this run reads {data} with "
                f"{_described(transform)}: run scripts.teach with the run's settings "
                f"(--align, --align_detector, --resize)"
            )
        made = (self.header.get("data_fingerprint"), self.header.get("data_size"))
        if made != (fingerprint, size):
            raise ConfigError(
                f"teacher file {self.path} belongs to other data: it was made from "
                f"{self.header.get('data')} ({made[1]} records, fingerprint {made[0]}); this run's data "
                f"{data} has {size} records, fingerprint {fingerprint}: run scripts.teach on {data}"
            )

    def targets(self, images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The batch's rows (b x D, read by the loader: `row`, `read`) on the batch's device."""
        return rows.to(images.device, non_blocking=True)


class _Named:
    """Bad rows found by a scan: the first 10 kept to name (with the first one's value), all counted."""

    def __init__(self):
        self.first: list[int] = []
        self.first_value: float | None = None
        self.count = 0

    def add(self, rows: np.ndarray, values: np.ndarray | None = None) -> None:
        if len(rows) and self.first_value is None and values is not None:
            self.first_value = float(values[0])
        self.count += len(rows)
        self.first += rows[: max(0, 10 - len(self.first))].tolist()

    def names(self) -> str:
        return ", ".join(map(str, self.first)) + (", ..." if self.count > len(self.first) else "")


@torch.no_grad()
def write_teacher_file(
    teacher, data, header: dict, out: str, batch_size: int = 64, num_workers: int = 2
) -> None:
    """Every record's row, written to a temporary file beside `out`, then published. A record
    whose row is not finite, or not a unit vector (the teacher's embeddings of the record and its
    mirror image sum to zero, or to a norm too small to normalise), stops it, naming the record:
    the file is never written."""
    header = {
        **header,
        "format": FORMAT,
        "data_size": len(data),
        "dim": teacher.dim,
        "teacher": teacher.name,
        "teacher_fingerprint": teacher.model.fingerprint,
        "template": teacher.model.template.name,
        "rows": "L2-normalised embedding of the record plus its mirror image's, float16",
    }
    done = 0
    shown = len(data) > batch_size
    # utils.atomic: staged, fsynced, replaced
    with (
        publishing(out) as tmp,
        open(tmp, "wb") as f,
        progress_bar(len(data), "teaching", shown=shown) as bar,
    ):
        f.write(header_bytes(header))
        for images, _ in DataLoader(data, batch_size=batch_size, num_workers=num_workers):
            both = teacher.targets(images, None) + teacher.targets(images.flip(3), None)
            rows = torch.nn.functional.normalize(both, dim=1).cpu().numpy().astype("<f2")
            bad = np.flatnonzero(~np.isfinite(rows).all(axis=1))
            if len(bad):
                raise ModelError(
                    f"teacher {teacher.name}: its embedding of record {done + int(bad[0])} of "
                    f"{header['data']} is not finite (NaN or inf); the teacher's output is unusable"
                )
            norms = np.linalg.norm(rows.astype(np.float32), axis=1)
            bad = np.flatnonzero(~(np.abs(norms - 1.0) <= UNIT_TOLERANCE))
            if len(bad):
                raise ModelError(
                    f"teacher {teacher.name}: its embedding of record {done + int(bad[0])} of "
                    f"{header['data']} (plus its mirror image's) has norm "
                    f"{float(both[bad[0]].norm()):.3g}, no direction to normalise; the teacher's "
                    f"output is unusable"
                )
            f.write(rows.tobytes())
            done += len(images)
            bar.update(len(images))

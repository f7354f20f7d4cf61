"""The teacher of distillation (issue #29): a MODEL run beside the student, or a file of its
embeddings made beforehand by `python -m scripts.teach`.

Both give `targets(images, rows)`: b x D_t float32 embeddings of the rank's batch, on the
batch's device, no gradient. `images` are the student's [-1, 1] crops (made for
ARCFACE_112, the training data's template); `rows` are a teacher file's rows of their records,
read by the DataLoader's workers (`TeacherFile.row`, the loader's `teacher_rows`) and arriving
with the batch, pinned; None for a teacher run on the fly.

Teacher file (`.teacher`): the bytes MAGIC, a uint32 little-endian header length, a UTF-8 JSON
header, zero padding to a multiple of 64 bytes, then `data_size` rows of `dim` float16: row i
is the L2-normalised sum of the teacher's embeddings of record i and of its mirror image, so
one row serves both the flips training draws. The header (`format` FORMAT) names the data set
(path, size, fingerprint of its images' names and content: dataset/fingerprint.py), how its
images were read (`transform`: align, its detector, resize) and the teacher (name, fingerprint,
template): a file made from other data, or from the same data read otherwise, is refused by
name, and so is a file of an older format (its fingerprint covered names only). Rows are read
by record index, so shuffling, resume and any world size read the right ones. A file with
rows that are not finite is refused when it is opened (`TeacherFile`), naming them.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from configs.errors import ConfigError
from dataset import normalize_images
from eval.embedder import Embedder, OnnxBackbone, load_embedder
from faces.align import ARCFACE_112, Template
from parallel.dist import get_rank, get_world_size

MAGIC = b"SHARDFACE-TEACHER\n"
ALIGN = 64
FORMAT = 2  # 1: the data fingerprint covered image names only, and no transform was recorded
_SCAN_BYTES = 64 << 20  # rows checked per read when a file is opened
_FP16_EXPONENT = 0x7C00  # all exponent bits set: inf or NaN


def data_transform(cfg) -> dict:
    """How a run (or scripts.teach) reads its images, as a teacher file records it: a file
    made from resized images does not serve a run on aligned faces of the same photos."""
    return {"align": bool(cfg.align), "align_detector": cfg.align_detector if cfg.align else None,
            "resize": bool(cfg.resize)}


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
        raise ConfigError(f"{path}: teacher file cut inside its header ({len(body)} of its {n} bytes); "
                          f"run scripts.teach again")
    try:
        header = json.loads(body.decode())
    except ValueError:
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{path}: teacher file with an unreadable header; run scripts.teach again")
    offset = len(MAGIC) + 4 + n
    return header, offset + (-offset % ALIGN)


_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
_AUTOCAST_CASTS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.PReLU)  # weights autocast casts per call
_SAME_TARGETS = {"rtol": 1e-3, "atol": 1e-4}  # the teacher's forms (run, model.pt, ONNX) agree to atol 1e-4


def _autocast(device: torch.device, precision: str | None):
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_LOW[precision])


class OnlineTeacher:
    """A frozen Embedder run on each rank's local batch, under the run's precision
    (`precision` "fp16", "bf16" or None for fp32). Crops made for the training data's template
    are re-framed onto the teacher's (`Embedder.from_crops`), so a 150x150 dlib teacher and a
    112x112 student meet on the same faces."""

    teacher_rows = None  # nothing for the loader to read

    def __init__(self, embedder: Embedder, device: torch.device, precision: str | None = None,
                 made_for: Template = ARCFACE_112):
        self.embedder, self.device, self.precision, self.made_for = embedder, torch.device(device), precision, made_for
        module = embedder.module.eval()
        onnx = isinstance(module, OnnxBackbone)
        if not onnx:  # onnxruntime places its own (a GPU run refuses it: load_teacher)
            module.to(self.device)
        for p in module.parameters():
            p.requires_grad_(False)
        self.dim = self._probe()
        self.cast_once = self._cast_weights_once() if precision is not None and not onnx else 0

    def _cast_weights_once(self) -> int:
        """Under autocast a frozen teacher's conv, linear and PReLU weights are cast to the 16-bit
        type at every call, every step (no grad, so autocast keeps no cache). Cast them once instead:
        those of the layers that run under autocast (a layer the network keeps in fp32 is left),
        kept only when the teacher's targets of a probe batch stay within `_SAME_TARGETS` of
        autocast's own (the same rounding, so they agree; checked on the rank's device).
        Returns how many layers were cast (0: autocast casts them per step, as before)."""
        module, dtype = self.embedder.module, _LOW[self.precision]
        seen, hooks = [], []
        for layer in module.modules():
            if isinstance(layer, _AUTOCAST_CASTS) and all(p.dtype == torch.float32 for p in layer.parameters(False)):
                hooks.append(layer.register_forward_pre_hook(
                    lambda m, args: seen.append(m) if torch.is_autocast_enabled(self.device.type) else None))
        g = torch.Generator().manual_seed(39)
        probe = (torch.rand(4, 3, *self.made_for.size, generator=g) * 2 - 1).to(self.device)
        try:
            before = self.targets(probe, None)
        finally:
            for h in hooks:
                h.remove()
        layers = list({id(m): m for m in seen}.values())
        kept = [(p, p.data) for layer in layers for p in layer.parameters(False)]
        for p, data in kept:
            p.data = data.to(dtype)
        try:
            after = self.targets(probe, None)
            same = bool(torch.isfinite(after).all()) and torch.allclose(after, before, **_SAME_TARGETS)
        except RuntimeError:  # a layer fed fp32 outside autocast after all
            same = False
        if not same:
            for p, data in kept:
                p.data = data
            return 0
        return len(layers)

    @property
    def name(self) -> str:
        return self.embedder.name

    def _probe(self) -> int:
        """At start: the teacher takes its template's input and returns N x D. One clear error
        otherwise, not a failure inside the first step."""
        h, w = self.embedder.template.size
        blank = torch.zeros(2, 3, *self.made_for.size, device=self.device)
        try:
            out = self.targets(blank, None)
        except Exception as exc:  # any network's own shape error
            raise ConfigError(f"config teacher {self.name}: the teacher does not take its {h}x{w} input "
                              f"({self.embedder.template.name}): {str(exc).splitlines()[0]}") from None
        if out.dim() != 2 or out.shape[0] != 2 or out.shape[1] < 1:
            raise ConfigError(f"config teacher {self.name}: returns shape {tuple(out.shape)} for 2 crops, "
                              f"expected 2 x D embeddings")
        return int(out.shape[1])

    @torch.no_grad()
    def targets(self, images: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        x = self.embedder.from_crops(images, made_for=self.made_for)
        with _autocast(x.device, self.precision):
            out = self.embedder.module(x)
        return out.float().to(images.device)


class TeacherFile:
    """Precomputed targets read by record index (see the module docstring). Opening it checks
    the format and that every row is finite; `check_data` refuses a file made from another data
    set, or from the same one read otherwise, naming both."""

    def __init__(self, path: str):
        self.path = path
        self.header, offset = read_header(path)
        made = self.header.get("format")
        if made != FORMAT:
            why = ("made by an older scripts.teach, whose data fingerprint covers image names only and not "
                   "their content or preprocessing" if isinstance(made, int) and made < FORMAT
                   else f"of an unknown format (this version reads {FORMAT})")
            raise ConfigError(f"{path}: teacher file format {made}, {why}: remake it with `python -m scripts.teach`")
        try:
            self.size, self.dim = int(self.header["data_size"]), int(self.header["dim"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}: teacher file header lacks data_size or dim") from None
        if self.size < 1 or self.dim < 1:
            raise ConfigError(f"{path}: teacher file header says {self.size} x {self.dim} rows; "
                              f"run scripts.teach again")
        expected = offset + self.size * self.dim * 2
        if os.path.getsize(path) != expected:
            raise ConfigError(f"{path}: teacher file is {os.path.getsize(path)} bytes, its header says {expected} "
                              f"({self.size} x {self.dim} float16): truncated or damaged; run scripts.teach again")
        self.offset = offset
        self.rows = self._map()
        self._refuse_non_finite_rows()

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

    def _refuse_non_finite_rows(self) -> None:
        """At start, every row is finite: one sequential read of the file (about 1.5 s per GB on
        2 cores) finds a bad row before the run is accepted, rather than hours in as a NaN loss
        that looks like divergence. An fp16 value is inf or NaN when its exponent bits are all set."""
        bits = self.rows.view("<u2")
        step = max(1, _SCAN_BYTES // (2 * max(self.dim, 1)))
        first, count = [], 0  # the first 10 bad rows are named, all are counted
        total = np.zeros(self.dim, np.float64)  # the same read gives the rows' mean (distill_center)
        for start in range(0, self.size, step):
            chunk = np.asarray(bits[start:start + step])
            rows = np.flatnonzero(((chunk & _FP16_EXPONENT) == _FP16_EXPONENT).any(axis=1))
            count += len(rows)
            first += (rows + start)[:max(0, 10 - len(first))].tolist()
            if not count:
                total += chunk.view("<f2").astype(np.float64).sum(0)
        self.mean = (total / self.size).astype(np.float32)
        if count:
            more = ", ..." if count > len(first) else ""
            raise ConfigError(f"{self.path}: {count} of {self.size} teacher rows are not finite (NaN or "
                              f"inf): rows {', '.join(map(str, first))}{more}; the file is damaged or its teacher's "
                              f"output was unusable: run scripts.teach again")

    @property
    def name(self) -> str:
        return f"{self.path} (teacher {self.header.get('teacher')})"

    def check_data(self, data: str, size: int, fingerprint: str, transform: dict) -> None:
        """The run's data (`data` path, record count, fingerprint, `data_transform`) is the one
        this file was made from, read the same way."""
        if self.header.get("transform") != transform:
            raise ConfigError(f"teacher file {self.path} was made from {self.header.get('data')} read with "
                              f"{_described(self.header.get('transform') or {})}; this run reads {data} with "
                              f"{_described(transform)}: run scripts.teach with the run's settings "
                              f"(--align, --align_detector, --resize)")
        made = (self.header.get("data_fingerprint"), self.header.get("data_size"))
        if made != (fingerprint, size):
            raise ConfigError(f"teacher file {self.path} belongs to other data: it was made from "
                              f"{self.header.get('data')} ({made[1]} records, fingerprint {made[0]}); this run's data "
                              f"{data} has {size} records, fingerprint {fingerprint}: run scripts.teach on {data}")

    def targets(self, images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The batch's rows (b x D, read by the loader: `row`, `read`) on the batch's device."""
        return rows.to(images.device, non_blocking=True)


def teacher_statistics(teacher, dataset, samples: int, device: torch.device,
                       group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's mean unit target over the training data, a sample of its unit targets),
    on `device`: a teacher file's mean over all its rows (read when it was opened); an
    on-the-fly teacher's over `samples` records spread evenly over `dataset`, each rank
    embedding its 1/W of them (one all-reduce; the sample returned is the rank's own)."""
    n = len(dataset)
    index = np.unique(np.linspace(0, n - 1, max(1, min(n, samples))).round().astype(np.int64))
    if isinstance(teacher, TeacherFile):
        rows = torch.from_numpy(np.asarray(teacher.rows[index], dtype=np.float32))
        return torch.from_numpy(teacher.mean).to(device), torch.nn.functional.normalize(rows, dim=1).to(device)
    world, rank = get_world_size(group), get_rank(group)
    share = torch.utils.data.Subset(dataset, index[rank::world].tolist())
    total = torch.zeros(teacher.dim, dtype=torch.float64, device=device)
    sample = []
    for images, *_ in torch.utils.data.DataLoader(share, batch_size=64, num_workers=0):
        images = images.to(device)
        if images.dtype == torch.uint8:  # the training set's uint8 crops, normalised as the loop does
            images = normalize_images(images)
        unit = torch.nn.functional.normalize(teacher.targets(images, None).float(), dim=1)
        total += unit.double().sum(0)
        sample.append(unit)
    if world > 1:
        dist.all_reduce(total, group=group)
    return (total / len(index)).float(), torch.cat(sample) if sample else torch.zeros(0, teacher.dim, device=device)


def load_teacher(teacher: str, network: str | None, device: torch.device, precision: str | None = None):
    """The teacher a config names: a teacher file, or any MODEL the tools take, on the rank's
    `device`. An `.onnx` model runs in onnxruntime on the host: it serves a CPU run, but on a GPU
    each step would copy the rank's batch to the host, waiting for the device (and
    onnxruntime-gpu would open every rank's session on GPU 0), so there it is refused at start
    in favour of its teacher file."""
    if is_teacher_file(teacher):
        return TeacherFile(teacher)
    device = torch.device(device)
    if teacher.lower().endswith(".onnx") and device.type != "cpu":
        raise ConfigError(f"config teacher {teacher}: an .onnx teacher runs in onnxruntime on the host, not on "
                          f"{device}; make its teacher file once with `python -m scripts.teach {teacher} DATA "
                          f"OUT.teacher` (DATA: the run's rec) and train with --teacher OUT.teacher")
    return OnlineTeacher(load_embedder(teacher, network, device=device), device, precision)

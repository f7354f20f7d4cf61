"""The teacher of distillation: a MODEL run beside the student, or a file of its
embeddings made beforehand by `python -m scripts.teach` (distill/teacher_file.py).

Both give `targets(images, rows)`: b x D_t float32 embeddings of the rank's batch, on the
batch's device, no gradient. `images` are the student's [-1, 1] crops (made for
ARCFACE_112, the training data's template); `rows` are a teacher file's rows of their records,
read by the DataLoader's workers (`TeacherFile.row`, the loader's `teacher_rows`) and arriving
with the batch, pinned; None for a teacher run on the fly.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from shardface.dataset import normalize_images
from shardface.distill.teacher_file import TeacherFile, is_teacher_file
from shardface.errors import ConfigError
from shardface.faces.align import ARCFACE_112, Template
from shardface.infer.model import Model, load_model
from shardface.infer.onnx import OnnxBackbone
from shardface.parallel.dist import get_rank, get_world_size

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}
_AUTOCAST_CASTS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.PReLU)  # weights autocast casts per call
_SAME_TARGETS = {"rtol": 1e-3, "atol": 1e-4}  # the teacher's forms (run, model.pt, ONNX) agree to atol 1e-4


def _autocast(device: torch.device, precision: str | None):
    if precision is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_LOW[precision])


class OnlineTeacher:
    """A frozen Model run on each rank's local batch, under the run's precision
    (`precision` "fp16", "bf16" or None for fp32). Crops made for the training data's template
    are re-framed onto the teacher's (`Model.reframe`), so a 150x150 dlib teacher and a
    112x112 student meet on the same faces."""

    teacher_rows = None  # nothing for the loader to read

    def __init__(
        self,
        model: Model,
        device: torch.device,
        precision: str | None = None,
        made_for: Template = ARCFACE_112,
    ):
        self.model = model
        self.device = torch.device(device)
        self.precision = precision
        self.made_for = made_for
        module = model.module.eval()
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
        module, dtype = self.model.module, _LOW[self.precision]
        seen, hooks = [], []
        for layer in module.modules():
            if isinstance(layer, _AUTOCAST_CASTS) and all(
                p.dtype == torch.float32 for p in layer.parameters(False)
            ):
                hooks.append(
                    layer.register_forward_pre_hook(
                        lambda m, args: (
                            seen.append(m) if torch.is_autocast_enabled(self.device.type) else None
                        )
                    )
                )
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
        return self.model.name

    @property
    def fingerprint(self) -> str:
        """Its weights' (infer.model.Model.fingerprint): what its targets are made of."""
        return self.model.fingerprint

    def _probe(self) -> int:
        """At start: the teacher takes its template's input and returns N x D. One clear error
        otherwise, not a failure inside the first step."""
        h, w = self.model.template.size
        blank = torch.zeros(2, 3, *self.made_for.size, device=self.device)
        try:
            out = self.targets(blank, None)
        except Exception as exc:  # any network's own shape error
            raise ConfigError(
                f"config teacher {self.name}: the teacher does not take its {h}x{w} input "
                f"({self.model.template.name}): {str(exc).splitlines()[0]}"
            ) from None
        if out.dim() != 2 or out.shape[0] != 2 or out.shape[1] < 1:
            raise ConfigError(
                f"config teacher {self.name}: returns shape {tuple(out.shape)} for 2 crops, "
                f"expected 2 x D embeddings"
            )
        return int(out.shape[1])

    @torch.no_grad()
    def targets(self, images: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        x = self.model.reframe(images, made_for=self.made_for)
        with _autocast(x.device, self.precision):
            out = self.model.module(x)
        return out.float().to(images.device)


def teacher_statistics(
    teacher, dataset, samples: int, device: torch.device, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the teacher's mean unit target over the training data, a sample of its unit targets),
    on `device`: a teacher file's mean over all its rows (read when it was opened); an
    on-the-fly teacher's over `samples` records spread evenly over `dataset`, each rank
    embedding its 1/W of them (one all-reduce; the sample returned is the rank's own)."""
    n = len(dataset)
    index = np.unique(np.linspace(0, n - 1, max(1, min(n, samples))).round().astype(np.int64))
    if isinstance(teacher, TeacherFile):
        rows = torch.from_numpy(np.asarray(teacher.rows[index], dtype=np.float32))
        return torch.from_numpy(teacher.mean).to(device), torch.nn.functional.normalize(rows, dim=1).to(
            device
        )
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
    return (total / len(index)).float(), torch.cat(sample) if sample else torch.zeros(
        0, teacher.dim, device=device
    )


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
        raise ConfigError(
            f"config teacher {teacher}: an .onnx teacher runs in onnxruntime on the host, not on "
            f"{device}; make its teacher file once with `python -m scripts.teach {teacher} DATA "
            f"OUT.teacher` (DATA: the run's rec) and train with --teacher OUT.teacher"
        )
    return OnlineTeacher(load_model(teacher, network, device=device), device, precision)

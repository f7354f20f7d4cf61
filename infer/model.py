"""A trained face model, ready to use: `load_model(MODEL)` resolves any form of one once (a run or
checkpoint directory, a `model.pt` of ShardFace or of arcface_torch with `network`, an `.onnx`, or
`dlib`) into a `Model` that knows its crop and its own threshold (`.threshold`, or None), finds
faces, embeds photos and compares them (usage: infer/__init__; the stream under them all:
`model.analyse`, infer.stream). Every method is safe to call from several threads at once (a web
server's pool): dlib's detector, which is not, runs under a lock (faces.detect).

Every Model's module takes N x 3 x h x w float RGB in [-1, 1] ((x - 127.5) / 127.5, as arcface_torch)
at its template's h x w: a network that wants other scaling converts inside its module, so tools,
training's evaluation, ONNX export and a distillation teacher all feed it alike. Crops made for
another template (the 112x112 `.bin` sets, a student's batch) are re-framed by `Model.reframe`.

MODEL `dlib` is dlib's face descriptor (infer.weights): 128-D on dlib's 150x150 chip, cut exactly as
dlib cuts it (faces.dlib_chip), so its embeddings are face_recognition's `face_encodings`."""

from __future__ import annotations

import functools
import hashlib
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont
from torch import nn

from shardface.backbones.dlib_resnet import DlibResNet
from shardface.checkpoint.state import weights_fingerprint
from shardface.dataset.errors import DataError
from shardface.dataset.geometry import check_files
from shardface.faces.align import ARCFACE_112, Template, similarity_transform
from shardface.faces.detect import Detection, Face
from shardface.faces.dlib_chip import DLIB_150
from shardface.faces.models import model_file
from shardface.faces.stream import Found, Photo, no_face_message, open_image
from shardface.infer.embed import l2_normalize, module_device
from shardface.infer.onnx import OnnxBackbone
from shardface.infer.stream import analyse, embed_crops
from shardface.infer.thresholds import DLIB_OWN, Threshold, chosen_threshold, run_threshold
from shardface.infer.weights import DLIB, DLIB_FILE, dlib_state, load_backbone

MODEL_HELP = "run output, checkpoint dir, model.pt (ShardFace or arcface_torch), .onnx or dlib"
PRECISIONS = ("fp32", "fp16", "bf16")
# Model.draw's colours: a face named or plainly found; one matching nobody
FOUND = (0, 220, 90)
NOBODY = (255, 170, 0)


def tool_device() -> torch.device:
    """Where a one-process tool runs a model: the current GPU, else the CPU (a training rank passes its own)."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def model_kind(spec: str) -> str:
    """What a MODEL argument names, decided here once: "dlib", "onnx" (an .onnx file) or "weights" (the rest)."""
    if spec == DLIB:
        return "dlib"
    return "onnx" if spec.lower().endswith(".onnx") else "weights"


def model_files(spec: str) -> list[str]:
    """The files of the MODEL `spec`, which no output may be: what loading it reads (a weights file and
    the config.json beside it; a checkpoint's files), and for a run its config.json, latest and model.pt."""
    if model_kind(spec) == "dlib":
        return [model_file(DLIB_FILE)]
    if not os.path.isdir(spec):
        return [spec, os.path.join(os.path.dirname(os.path.abspath(spec)), "config.json")]
    from shardface.checkpoint.folders import find_checkpoint

    ckpt = find_checkpoint(spec) or spec
    run = [os.path.join(spec, f) for f in ("config.json", "latest", "model.pt")]
    return run + ([os.path.join(ckpt, f) for f in os.listdir(ckpt)] if os.path.isdir(ckpt) else [])


@dataclass(frozen=True)
class Comparison:
    """Two faces compared: the cosine of their embeddings and the verdict at `threshold` (None: none
    known), with where the threshold came from (`source`) and, for photos, the line naming those
    that hold several faces, of which the largest was compared (`several`, else None)."""

    score: float
    same: bool | None
    threshold: float | None
    source: str | None = None
    several: str | None = None

    def __str__(self) -> str:
        if self.same is None:
            return f"cosine {self.score:.4f}: no threshold known for this model, so no verdict"
        verdict = "same" if self.same else "different"
        return f"cosine {self.score:.4f}: {verdict} person (threshold {self.threshold:.4f})"


@dataclass
class Model:
    """A frozen face-embedding network, the crop it wants, and what derived files record of it."""

    module: nn.Module  # eval mode; N x 3 x h x w float in [-1, 1] -> N x D
    template: Template  # the crop geometry (size and five-point positions) it was trained on
    name: str  # the MODEL it was loaded from, for messages and derived files
    fingerprint: str  # a hash of its weights (or ONNX file): derived files record it
    threshold: Threshold | None = None  # its own verdict threshold (infer/thresholds.py), if it has one
    ema: bool = True  # the EMA weights were asked for (False: --no_ema); derived files record it
    kind: str = "weights"  # model_kind(name): "dlib", "onnx" or "weights"
    detection: Detection = Detection()  # how `faces` and `embed` find faces in photos
    precision: str = "fp32"  # on a GPU, "fp16" or "bf16" embeds under autocast (infer.embed)
    # reframe's warps per (template, device, dtype), made once: each made anew would wait on a host copy
    _thetas: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        """Where its input goes: its weights' device (the CPU for the ONNX form)."""
        return module_device(self.module)

    @property
    def crop_name(self) -> str:
        """The crop this model's photos are cut to, as derived files record it."""
        t = self.template
        return ("dlib's own chip" if self.kind == "dlib" else t.name) + f" {t.size[1]}x{t.size[0]}"

    @functools.cached_property
    def dim(self) -> int:
        """The embedding's width (one blank crop embedded, once)."""
        return int(self.embed_crops(torch.zeros(1, 3, *self.template.size, dtype=torch.uint8)).shape[1])

    def reframe(self, images: torch.Tensor, made_for: Template = ARCFACE_112) -> torch.Tensor:
        """uint8 (or [-1, 1] float) N x 3 x H x W crops aligned to `made_for` -> float in [-1, 1] on this
        model's template and device: a similarity warp between the templates (none when they agree)."""
        images = images.to(self.device)
        x = images.float().sub(127.5).div(127.5) if images.dtype == torch.uint8 else images.float()
        if self._is_own(made_for):
            return x
        key = (made_for.size, np.asarray(made_for.points, np.float64).tobytes(), x.device, x.dtype)
        if (
            key not in self._thetas
        ):  # 1 x 2 x 3: output pixel -> input pixel, in affine_grid's [-1, 1] coordinates
            m = similarity_transform(self.template.points, made_for.points)
            (h_out, w_out), (h_in, w_in) = self.template.size, made_for.size
            to_px = np.array([[w_out / 2, 0, w_out / 2 - 0.5], [0, h_out / 2, h_out / 2 - 0.5], [0, 0, 1]])
            to_grid = np.array([[2 / w_in, 0, 1 / w_in - 1], [0, 2 / h_in, 1 / h_in - 1], [0, 0, 1]])
            theta = (to_grid @ np.vstack([m, [0, 0, 1]]) @ to_px)[:2]
            self._thetas[key] = torch.as_tensor(theta, dtype=x.dtype, device=x.device)[None]
        grid = torch.nn.functional.affine_grid(
            self._thetas[key].expand(len(x), 2, 3), [len(x), 3, *self.template.size], align_corners=False
        )
        # outside the crop is black, as alignment leaves it: -1 in [-1, 1]
        return (
            torch.nn.functional.grid_sample(
                x + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False
            )
            - 1
        )

    def module_for(self, made_for: Template = ARCFACE_112) -> nn.Module:
        """A module taking [-1, 1] crops aligned to `made_for` (the .bin sets' 112x112, IJB's):
        this model's module behind `reframe` (the module itself when the templates agree)."""
        return self.module if self._is_own(made_for) else _Reframed(self, made_for)

    def _is_own(self, made_for: Template) -> bool:
        return made_for.size == self.template.size and np.allclose(made_for.points, self.template.points)

    # the Python API: the face stream's two entries (infer.stream), and thin layers on them
    def analyse(self, photos, **options) -> Iterator[Photo]:
        """Each photo with its faces and their embeddings, in order: infer.stream.analyse's keyword
        options (workers, flip, largest_only, align, batch_size, progress, faces, resize, raw)."""
        return analyse(self, photos, **options)

    def embed_crops(self, crops: torch.Tensor, **options) -> np.ndarray:
        """N x D unit rows of ready-made crops (the .bin sets', a teacher's batch) aligned to
        `made_for` (default this model's template): infer.stream.embed_crops' keyword options."""
        return embed_crops(self, crops, **options)

    def faces(self, photo, *, flip: bool = True) -> list[Face]:
        """Every face of one photo, largest first, each with its embedding."""
        (found,) = self.analyse([photo], flip=flip)
        return found.faces

    def embed(
        self, photos, *, align: bool = True, flip: bool = True, batch_size: int = 64, missing: str = "raise"
    ) -> np.ndarray:
        """N x D float32 unit rows, one per photo: with `align`, its largest face; without, the photo taken
        as a crop aligned for this model. A photo without a face is a DataError naming it (`missing="raise"`)
        or a row of NaN (`missing="nan"`). One photo (not in a list) gives one row of D. `flip` adds the
        mirror image's embedding (the flip test; dlib's own descriptor is single-view: flip=False)."""
        if missing not in ("raise", "nan"):
            raise ValueError(f"missing={missing!r}: 'raise' or 'nan'")
        if isinstance(photos, bytes):
            raise DataError("bytes: not a photo (a path, a PIL image or an array, or a list of them)")
        single = isinstance(photos, (str, os.PathLike, Image.Image)) or (
            isinstance(photos, np.ndarray) and photos.ndim in (2, 3) and photos.dtype == np.uint8
        )
        rows = []
        photos = [photos] if single else list(photos)
        for photo in self.analyse(photos, flip=flip, largest_only=True, align=align, batch_size=batch_size):
            if photo.face is None and missing == "raise":
                raise DataError(f"{photo.name}: no face found")
            rows.append(
                photo.face.embedding if photo.face is not None else np.full(self.dim, np.nan, np.float32)
            )
        out = np.stack(rows) if rows else np.zeros((0, self.dim), np.float32)
        return out[0] if single else out

    def compare(
        self,
        a,
        b,
        *,
        align: bool = True,
        flip: bool = True,
        threshold: float | Threshold | None = None,
        workers: int = 1,
        resize: bool = False,
    ) -> Comparison:
        """The cosine of `a` and `b` judged at `threshold` (a cosine, a `Threshold`; default the
        model's own), as face_recognition's `compare_faces` judges encodings. Each is a photo (its
        largest face; without `align` a crop for this model, or of any size with `resize`), a
        `Face` this model embedded, or one of its embeddings (D floats). The photos' faces are
        found on `workers` processes. A photo without a face is a DataError naming each such
        photo; a crop file of another size, or that is no image, is refused before any is read
        whole. An embedding of another width is refused; one of another model of the same width
        cannot be told apart."""
        threshold = chosen_threshold(threshold, self.threshold)
        emb = [self._embedding_of(x) for x in (a, b)]
        photos = [x for x, e in zip((a, b), emb) if e is None]
        files = [x for x in photos if isinstance(x, (str, os.PathLike))]
        if files and not align:
            check_files(files, resize, size=tuple(self.template.size))
        found = list(
            self.analyse(photos, workers=workers, flip=flip, largest_only=True, align=align, resize=resize)
        )
        without = [photo.name for photo in found if photo.face is None]
        if without:
            raise DataError(
                f"{no_face_message(without, len(found), self.detection)}: compare needs a face in each"
            )
        faces = iter(photo.face.embedding for photo in found)
        a, b = (
            l2_normalize(np.asarray(e if e is not None else next(faces), np.float64)[None])[0] for e in emb
        )
        score = float(a @ b)
        return Comparison(
            score,
            None if threshold is None else score >= threshold.value,
            None if threshold is None else threshold.value,
            None if threshold is None else threshold.source,
            Found({photo.name: photo.faces for photo in found}).several_faces(),
        )

    def _embedding_of(self, x) -> np.ndarray | None:
        """`x`'s embedding where it is a Face or an embedding; None for a photo."""
        if isinstance(x, Face):
            if x.embedding is None:
                raise DataError(
                    "a face without an embedding: take faces from this model's faces() or analyse()"
                )
            x = x.embedding
        elif not (isinstance(x, np.ndarray) and x.ndim == 1 and np.issubdtype(x.dtype, np.floating)):
            return None
        if len(x) != self.dim:
            raise DataError(f"an embedding of {len(x)} values: {self.name}'s have {self.dim}")
        return np.asarray(x, np.float64)

    def draw(self, photo, found: list) -> Image.Image:
        """A copy of the photo with each of `found` drawn (box and five points): faces, or matches
        (`Gallery.identify`) labelled with name (or "unknown", in another colour) and score."""
        image = open_image(photo).copy()
        pen = ImageDraw.Draw(image)
        side = max(12, round(min(image.size) / 40))
        font, width = ImageFont.load_default(size=side), max(2, side // 6)
        for item in found:
            face, named = getattr(item, "face", item), getattr(item, "name", "")
            colour = NOBODY if named is None else FOUND
            pen.rectangle(face.box, outline=colour, width=width)
            for x, y in face.points:
                if math.isfinite(x) and math.isfinite(y):  # a crop taken whole (align=False) has no points
                    pen.ellipse((x - width, y - width, x + width, y + width), fill=colour)
            if hasattr(item, "name"):
                x0, y0 = face.box[:2]
                label = f"{named or 'unknown'} {item.score:.2f}"
                left, top, right, bottom = pen.textbbox((x0, y0), label, font=font)
                lift = bottom - top + 2 * width
                pen.rectangle((left - width, top - lift, right + width, bottom - lift + width), fill=colour)
                pen.text((x0, y0 - lift), label, fill=(0, 0, 0), font=font)
        return image


class _Reframed(nn.Module):
    def __init__(self, model: Model, made_for: Template):
        super().__init__()
        self.model, self.made_for, self.inner = model, made_for, model.module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.model.reframe(x, self.made_for))


def load_module(
    spec: str, network: str | None = None, ema: bool = True, device: torch.device | None = None
) -> nn.Module:
    """The eval-mode network of a MODEL: an `.onnx` through onnxruntime; `dlib`'s (150x150 chip) or
    trained weights (infer.weights.load_backbone) on `device` (default `tool_device()`)."""
    kind = model_kind(spec)
    if kind == "onnx":
        return OnnxBackbone(spec).eval()
    if kind == "dlib":  # the registered dlib_resnet takes 112x112 crops
        module = DlibResNet(input_size=DLIB_150.size[0])
        module.load_state_dict(dlib_state())
    else:
        module = load_backbone(spec, network, ema=ema)  # weights that are not finite are refused there
    return module.eval().to(device if device is not None else tool_device())


def load_model(
    spec: str,
    network: str | None = None,
    ema: bool = True,
    device: torch.device | None = None,
    detection: Detection = Detection(),
    precision: str = "fp32",
) -> Model:
    """The Model of a MODEL argument on `device` (default `tool_device()`; an `.onnx` runs where onnxruntime
    places it), finding faces with `detection`, embedding at `precision` (fp16, bf16: autocast on a GPU only)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: one of {', '.join(PRECISIONS)}")
    kind = model_kind(spec)
    module = load_module(spec, network, ema, device)
    if kind == "dlib":  # one set of weights, no EMA to choose
        template = DLIB_150
        fingerprint = fingerprint_file(model_file(DLIB_FILE))
        threshold = DLIB_OWN
        ema = True
    elif kind == "onnx":
        template, fingerprint, threshold = module.template, fingerprint_file(spec), module.threshold
    else:  # the hash files derived from these weights record (checkpoint.state.weights_fingerprint)
        fingerprint = weights_fingerprint(module.state_dict())
        template, threshold = ARCFACE_112, run_threshold(spec, ema, fingerprint)
    return Model(module, template, spec, fingerprint, threshold, ema, kind, detection, precision)


def as_model(module: nn.Module | Model) -> Model:
    """A bare module (as `load_module` returns) is taken for a 112x112 insightface-crop network."""
    if isinstance(module, Model):
        return module
    return Model(module, ARCFACE_112, "the model", "")


def fingerprint_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]

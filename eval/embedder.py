"""The one MODEL loader: an Embedder from any form of a trained model (a run or checkpoint
directory, a `model.pt` of ShardFace or arcface_torch with `network`, an exported `.onnx`), which
carries the crop geometry its network wants; and the embeddings of image files with
verification's flip test, L2-normalised.

Every Embedder's module takes N x 3 x h x w float RGB in [-1, 1] ((x - 127.5) / 127.5, as
arcface_torch), h x w being its template's size: a network that wants other pixel scaling
converts inside its module, so training's evaluation, ONNX export and a distillation teacher
all feed it alike. Crops made for another template (the 112x112 `.bin` sets, a student's batch)
are re-framed onto the Embedder's template by `Embedder.from_crops`.

MODEL `dlib` is dlib's face descriptor (face-recognition-models' .dat, read by
faces.dlib_format into backbones.dlib_resnet): 128-D on dlib's 150x150 chip (faces.dlib_chip)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from backbones.dlib_resnet import DlibResNet
from dataset.errors import DataLayoutError
from dataset.folders import not_regular, regular_file, walk_images
from dataset.geometry import check_files
from dataset.images import IMAGE_EXTENSIONS, decode_chw
from eval.thresholds import THRESHOLD_FILE, THRESHOLD_KEY, Threshold, ThresholdError, model_threshold, saved_threshold
from eval.verification import embed, l2_normalize
from eval.weights import DLIB, DLIB_FILE, dlib_state, load_backbone
from faces.align import ARCFACE_112, Template, similarity_transform
from faces.dlib_chip import DLIB_150
from faces.models import model_file
from faces.photos import Face, aligned_chw
from utils.checkpoint import CheckpointError
from utils.progress import Progress


TEMPLATE_KEY = "shardface.template"  # ONNX metadata: the crop template the model takes (JSON)


def template_json(template: Template) -> str:
    return json.dumps({"name": template.name, "size": list(template.size),
                       "points": np.asarray(template.points).tolist()})


class OnnxBackbone(nn.Module):
    """An exported model (scripts/export_onnx.py: input `data`, N x 3 x h x w float32 RGB in
    [-1, 1]) run by onnxruntime behind the module interface the evaluation code takes. Its crop
    template is the one its metadata records (`TEMPLATE_KEY`); a model without it is taken for
    insightface's 112x112 crop, and must be 112x112. It holds no weights of its own; an empty
    parameter tells callers which device to feed. Refused at load, naming what is wrong: weights
    that are not finite, an output that is not N x D. A model exported with a fixed batch size is
    fed batches of that size."""

    def __init__(self, path: str):
        super().__init__()
        import onnxruntime as ort  # only the ONNX form needs it
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: ONNX model not found")
        wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
        providers = [p for p in wanted if p in ort.get_available_providers()]
        options = ort.SessionOptions()
        # torch's thread count (torchrun gives each of W ranks its share), not a pool of every core per process
        options.intra_op_num_threads = torch.get_num_threads()
        try:
            self.session = ort.InferenceSession(path, sess_options=options, providers=providers)
        except Exception as exc:  # onnxruntime raises its own types for every bad file
            raise CheckpointError(f"{path}: not a readable ONNX model ({str(exc).splitlines()[0]})") from None
        metadata = self.session.get_modelmeta().custom_metadata_map
        self.template = self._template(path, metadata.get(TEMPLATE_KEY))
        self.threshold = self._threshold(path, metadata.get(THRESHOLD_KEY))
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or list(inputs[0].shape[1:]) != [3, *self.template.size]:
            raise CheckpointError(f"{path}: expected one input of shape N x 3 x {self.template.size[0]} x "
                                  f"{self.template.size[1]} (as scripts.export_onnx writes), got "
                                  f"{[(i.name, i.shape) for i in inputs]}")
        if len(outputs[0].shape) != 2:
            raise CheckpointError(f"{path}: its output '{outputs[0].name}' has shape {outputs[0].shape}, not "
                                  f"N x D (one embedding per image); export the embedding, not a feature map")
        _refuse_non_finite_onnx(path)
        self.input_name = inputs[0].name
        batch = inputs[0].shape[0]
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.path = path
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    @staticmethod
    def _template(path: str, recorded: str | None) -> Template:
        if recorded is None:
            return ARCFACE_112
        try:
            t = json.loads(recorded)
            template = Template(str(t["name"]), (int(t["size"][0]), int(t["size"][1])),
                                np.asarray(t["points"], np.float64).reshape(5, 2))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise CheckpointError(f"{path}: unreadable {TEMPLATE_KEY} metadata ({exc})") from None
        if min(template.size) < 1 or not np.isfinite(template.points).all():
            raise CheckpointError(f"{path}: {TEMPLATE_KEY} metadata names no usable crop: {recorded}")
        return template

    @staticmethod
    def _threshold(path: str, recorded: str | None) -> Threshold | None:
        if recorded is None:
            return None
        try:
            record = json.loads(recorded)
        except ValueError as exc:
            raise CheckpointError(f"{path}: unreadable {THRESHOLD_KEY} metadata ({exc})") from None
        return saved_threshold(record, f"{path} metadata")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.detach().float().cpu().numpy()
        n = len(x)
        step = self.fixed_batch or max(n, 1)
        parts = []
        for start in range(0, n, step):
            chunk = x[start:start + step]
            if len(chunk) < step:  # a fixed batch size: pad the last chunk, keep its rows only
                chunk = np.concatenate([chunk, np.zeros((step - len(chunk), *chunk.shape[1:]), chunk.dtype)])
            parts.append(self.session.run(None, {self.input_name: chunk})[0][:min(step, n - start)])
        out = np.concatenate(parts) if parts else np.zeros((0, 0), np.float32)
        if out.ndim != 2 or out.shape[0] != n:
            raise CheckpointError(f"{self.path}: output of shape {out.shape} for {n} images; expected {n} x D")
        return torch.from_numpy(out).to(images.device)


def _refuse_non_finite_onnx(path: str) -> None:
    import onnx
    from onnx import numpy_helper
    try:
        graph = onnx.load(path).graph
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable ONNX model ({str(exc).splitlines()[0]})") from None
    for init in graph.initializer:
        w = numpy_helper.to_array(init)
        if np.issubdtype(w.dtype, np.floating) and not np.isfinite(w).all():
            raise CheckpointError(f"{path}: weight '{init.name}' has {int((~np.isfinite(w)).sum())} non-finite "
                                  f"(NaN or inf) values of {w.size}; the model is unusable")


def refuse_non_finite_embeddings(emb: np.ndarray, where: str) -> np.ndarray:
    """`emb`, or a CheckpointError naming the model and the first row that is NaN or inf (a
    cosine of NaN compares as neither same nor different)."""
    bad = ~np.isfinite(emb).all(axis=1) if emb.ndim == 2 else ~np.isfinite(emb)
    if bad.any():
        raise CheckpointError(f"{where}: {int(bad.sum())} of {len(bad)} embeddings are not finite (NaN or inf), "
                              f"the first row {int(np.argmax(bad))}; the model's output is unusable")
    return emb


def tool_device() -> torch.device:
    """Where a one-process tool runs a model: the current GPU, else the CPU. A training rank
    passes its own device instead."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_model(path: str, network: str | None = None, ema: bool = True,
               device: torch.device | None = None) -> nn.Module:
    """An eval-mode model whose forward takes N x 3 x h x w floats in [-1, 1] (112 x 112 but for
    an `.onnx` that records another template): an `.onnx` through onnxruntime, anything else
    through eval.weights.load_backbone, on `device` (default `tool_device()`)."""
    if path.lower().endswith(".onnx"):
        model = OnnxBackbone(path).eval()
    else:
        model = load_backbone(path, network, ema=ema)  # weights that are not finite are refused there
        model = model.to(device if device is not None else tool_device())
    model.source_path = path  # named when its embeddings are not finite
    return model


def model_files(path: str) -> list[str]:
    """The files of the model at `path` (an output must never be one of them): what loading it
    reads (a weights file and the config.json beside it; a checkpoint's files), and for a run
    output also the run's own config.json, latest and exported model.pt."""
    if path == DLIB:
        return [model_file(DLIB_FILE)]
    if not os.path.isdir(path):
        return [path, os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")]
    from utils.checkpoint import find_checkpoint
    ckpt = find_checkpoint(path) or path
    run = [os.path.join(path, f) for f in ("config.json", "latest", "model.pt")]
    return run + ([os.path.join(ckpt, f) for f in os.listdir(ckpt)] if os.path.isdir(ckpt) else [])


@dataclass
class Embedder:
    """A frozen embedding network and the crop it wants."""
    module: nn.Module       # eval mode; N x 3 x h x w float in [-1, 1] -> N x D
    template: Template      # the crop geometry (size and five-point positions) it was trained on
    name: str               # what was loaded, for messages and derived files
    fingerprint: str        # a hash of its weights (or ONNX file): derived files record it
    threshold: Threshold | None = None  # its own verdict threshold (eval/thresholds.py), if it has one
    ema: bool = True        # the EMA weights were asked for (False: --no_ema); derived files record it
    # from_crops' warps, made once per (template, device, dtype): rebuilt each step, each would be
    # a copy from host memory that waits for the device
    _thetas: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def device(self) -> torch.device:
        return next(self.module.parameters()).device

    def from_crops(self, images: torch.Tensor, made_for: Template = ARCFACE_112) -> torch.Tensor:
        """uint8 (or [-1, 1] float) N x 3 x H x W crops aligned to `made_for` -> float in [-1, 1]
        on this Embedder's template and device (a similarity warp between the two templates;
        the identity when they are the same)."""
        images = images.to(self.device)
        x = images.float().sub(127.5).div(127.5) if images.dtype == torch.uint8 else images.float()
        if made_for.size == self.template.size and np.allclose(made_for.points, self.template.points):
            return x
        grid = torch.nn.functional.affine_grid(self._theta(made_for, x.device, x.dtype).expand(len(x), 2, 3),
                                               [len(x), 3, *self.template.size], align_corners=False)
        # outside the crop is black, as alignment leaves it: -1 in [-1, 1]
        return torch.nn.functional.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros",
                                               align_corners=False) - 1

    def _theta(self, made_for: Template, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """1 x 2 x 3: output pixel -> input pixel, in the normalised [-1, 1] grid coordinates of
        affine_grid, on `device`; made on the first call for each (template, device, dtype)."""
        key = (made_for.size, np.asarray(made_for.points, np.float64).tobytes(), device, dtype)
        if key not in self._thetas:
            m = similarity_transform(self.template.points, made_for.points)
            (h_out, w_out), (h_in, w_in) = self.template.size, made_for.size
            to_px = np.array([[w_out / 2, 0, w_out / 2 - 0.5], [0, h_out / 2, h_out / 2 - 0.5], [0, 0, 1]])
            to_grid = np.array([[2 / w_in, 0, 1 / w_in - 1], [0, 2 / h_in, 1 / h_in - 1], [0, 0, 1]])
            theta = (to_grid @ np.vstack([m, [0, 0, 1]]) @ to_px)[:2]
            self._thetas[key] = torch.as_tensor(theta, dtype=dtype, device=device)[None]
        return self._thetas[key]

    def for_crops(self, made_for: Template = ARCFACE_112) -> nn.Module:
        """A module taking [-1, 1] crops aligned to `made_for` (the .bin sets' 112x112, IJB's):
        this Embedder's module behind `from_crops` (the module itself when the templates agree)."""
        if made_for.size == self.template.size and np.allclose(made_for.points, self.template.points):
            return self.module
        return _Reframed(self, made_for)


class _Reframed(nn.Module):
    def __init__(self, embedder: Embedder, made_for: Template):
        super().__init__()
        self.embedder, self.made_for, self.inner = embedder, made_for, embedder.module
        self.source_path = embedder.name  # named when its embeddings are not finite

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.embedder.from_crops(x, self.made_for))


def fingerprint_module(module: nn.Module) -> str:
    """A short hash of every parameter and buffer (names, shapes, values)."""
    digest = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def load_embedder(path: str, network: str | None = None, ema: bool = True,
                  device: torch.device | None = None) -> Embedder:
    """The Embedder of a MODEL argument (see the module docstring), on `device` (default
    `tool_device()`; an `.onnx` runs where onnxruntime places it)."""
    if path == DLIB:
        module = DlibResNet(input_size=DLIB_150.size[0])
        module.load_state_dict(dlib_state())
        module = module.eval().to(device if device is not None else tool_device())
        module.source_path = DLIB
        return Embedder(module, DLIB_150, DLIB, fingerprint_file(model_file(DLIB_FILE)), model_threshold(DLIB))
    module = load_model(path, network, ema, device)
    if isinstance(module, OnnxBackbone):
        return Embedder(module, module.template, path, fingerprint_file(path), module.threshold, ema)
    return Embedder(module, ARCFACE_112, path, fingerprint_module(module), run_threshold(path, ema), ema)


def run_threshold(path: str, ema: bool = True) -> Threshold | None:
    """The threshold training saved beside the weights at `path` (a run output, a checkpoint dir,
    or the run's model.pt: the latest checkpoint's weights, the EMA's where there is one), if it
    was measured at the step of those weights; else None."""
    from utils.checkpoint import CHECKPOINT_NAME, find_checkpoint
    run = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    ckpt = find_checkpoint(run)
    if ckpt is not None and os.path.abspath(ckpt) == os.path.abspath(run):  # a checkpoint dir: its run holds the file
        run = os.path.dirname(os.path.abspath(ckpt))
    file = os.path.join(run, THRESHOLD_FILE)
    if not os.path.isfile(file):
        return None
    try:
        with open(file) as f:
            records = json.load(f)
    except (OSError, ValueError) as exc:
        raise ThresholdError(f"{file}: unreadable ({exc})") from None
    if not isinstance(records, dict):
        raise ThresholdError(f"{file}: not a threshold record")
    want_ema = ema if os.path.isdir(path) else True  # model.pt holds the EMA's weights where there is one
    record = records.get("ema") if want_ema and records.get("ema") else records.get("raw")
    named = CHECKPOINT_NAME.match(os.path.basename(ckpt)) if ckpt else None
    if record is None or (named and isinstance(record, dict) and record.get("step") != int(named.group(1))):
        return None  # measured on other weights than these
    return saved_threshold(record, file)


def image_files(inputs: list[str]) -> list[str]:
    """Image files and the images under folders (recursively, sorted), in the order given."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(walk_images(item))  # links followed, hidden folders skipped (named)
            if not found:
                raise DataLayoutError(f"{item}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            odd = not_regular(found)  # a FIFO named like an image would block the read forever
            if odd is not None:
                raise odd
            files.extend(found)
        elif regular_file(item):
            files.append(item)
        elif os.path.exists(item):
            raise DataLayoutError(f"{item}: not a regular file (a FIFO, socket or device); only image files are read")
        else:
            raise DataLayoutError(f"{item}: no such image file or folder")
    return files


def embed_uint8(images: torch.Tensor, model: nn.Module, batch_size: int = 64, flip: bool = True) -> np.ndarray:
    """N x 3 x h x w uint8 (the crop `model` takes) -> N x D float32: the embedding plus its
    mirror image's (verification's flip test; only the image's own with flip=False), then
    L2-normalised. Embeddings that are not finite are refused, naming the model."""
    out = embed(images, model, batch_size)
    if flip:
        out = out + embed(torch.flip(images, dims=[3]), model, batch_size)
    refuse_non_finite_embeddings(out, getattr(model, "source_path", "the model"))
    return l2_normalize(out).astype(np.float32)


def _as_embedder(model: Embedder | nn.Module) -> Embedder:
    """A bare module (as `load_model` returns) is a 112x112 insightface-crop network."""
    return model if isinstance(model, Embedder) else Embedder(model, ARCFACE_112, "", "")


def embed_files(paths: list[str], model: Embedder | nn.Module, batch_size: int = 64, resize: bool = False,
                show_progress: bool = True, flip: bool = True, faces: dict[str, Face] | None = None) -> np.ndarray:
    """Embeddings of image files, one row per path, read a batch at a time. Without `faces`
    the files are crops of the Embedder's template size (112x112 for a bare module): every
    file's header is read first, and images of another size are refused (unless `resize`)
    before any is embedded. With `faces` (path -> Face, from faces.photos.find_faces) they are
    photos of any size: each one's face is aligned to the template as its batch is read."""
    embedder = _as_embedder(model)
    size = tuple(embedder.template.size)
    if faces is None:
        check_files(paths, resize, size=size)

    def load(path: str) -> torch.Tensor:
        if faces is not None:
            return aligned_chw(path, faces[path], embedder.template)
        return decode_chw(_read(path), path, resize=size if resize else None)

    progress = Progress(len(paths), "embedding") if show_progress and len(paths) > batch_size else None
    out = []
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        out.append(embed_uint8(torch.stack([load(p) for p in chunk]), embedder.module, batch_size, flip))
        if progress is not None:
            progress.update(len(chunk))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def best_threshold(data_set, model: Embedder | nn.Module, batch_size: int = 64,
                   flip: bool = True) -> tuple[float, float]:
    """(cosine threshold, accuracy): the threshold that best separates a verification set's
    pairs (as `load_bin` returns it: insightface 112x112 crops, re-framed for another template),
    with flip-fused embeddings unless flip=False; `cos >= threshold` is "same"."""
    (images, _), issame = data_set
    emb = embed_uint8(images, _as_embedder(model).for_crops(ARCFACE_112), batch_size, flip).astype(np.float64)
    cos = np.sum(emb[0::2] * emb[1::2], axis=1)
    same = np.asarray(issame, dtype=bool)
    candidates = np.unique(cos)
    accuracy = [np.mean((cos >= t) == same) for t in candidates]
    best = int(np.argmax(accuracy))
    return float(candidates[best]), float(accuracy[best])

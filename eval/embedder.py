"""The one MODEL loader: an Embedder from any form of a trained model (a run or checkpoint
directory, a `model.pt` of ShardFace or arcface_torch with `network`, an exported `.onnx`), which
carries the crop geometry its network wants; and the embeddings of image files with
verification's flip test, L2-normalised.

Every Embedder's module takes N x 3 x h x w float RGB in [-1, 1] ((x - 127.5) / 127.5, as
arcface_torch), h x w being its template's size: a network that wants other pixel scaling
converts inside its module, so training's evaluation, ONNX export and a distillation teacher
all feed it alike. Crops made for another template (the 112x112 `.bin` sets, a student's batch)
are re-framed onto the Embedder's template by `Embedder.from_crops`."""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from dataset.errors import DataLayoutError
from dataset.folders import not_regular, regular_file
from dataset.geometry import check_files
from dataset.images import FACE_SIZE, IMAGE_EXTENSIONS, decode_chw
from eval.verification import embed, l2_normalize
from eval.weights import load_backbone
from faces.align import ARCFACE_112, Template, similarity_transform
from utils.checkpoint import CheckpointError
from utils.progress import Progress


class OnnxBackbone(nn.Module):
    """An exported model (scripts/export_onnx.py: input `data`, N x 3 x 112 x 112 float32 RGB
    in [-1, 1]) run by onnxruntime behind the module interface the evaluation code takes.
    It holds no weights of its own; an empty parameter tells callers which device to feed.
    Refused at load, naming what is wrong: weights that are not finite, an output that is not
    N x D. A model exported with a fixed batch size is fed batches of that size."""

    def __init__(self, path: str):
        super().__init__()
        import onnxruntime as ort  # only the ONNX form needs it
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: ONNX model not found")
        wanted = ("CUDAExecutionProvider", "CPUExecutionProvider")
        providers = [p for p in wanted if p in ort.get_available_providers()]
        try:
            self.session = ort.InferenceSession(path, providers=providers)
        except Exception as exc:  # onnxruntime raises its own types for every bad file
            raise CheckpointError(f"{path}: not a readable ONNX model ({str(exc).splitlines()[0]})") from None
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or list(inputs[0].shape[1:]) != [3, *FACE_SIZE]:
            raise CheckpointError(f"{path}: expected one input of shape N x 3 x 112 x 112 (as scripts.export_onnx "
                                  f"writes), got {[(i.name, i.shape) for i in inputs]}")
        if len(outputs[0].shape) != 2:
            raise CheckpointError(f"{path}: its output '{outputs[0].name}' has shape {outputs[0].shape}, not "
                                  f"N x D (one embedding per image); export the embedding, not a feature map")
        _refuse_non_finite_onnx(path)
        self.input_name = inputs[0].name
        batch = inputs[0].shape[0]
        self.fixed_batch = batch if isinstance(batch, int) and batch > 0 else None
        self.path = path
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

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


def load_model(path: str, network: str | None = None, ema: bool = True) -> nn.Module:
    """An eval-mode model whose forward takes N x 3 x 112 x 112 floats in [-1, 1]: an `.onnx`
    through onnxruntime, anything else through eval.weights.load_backbone."""
    if path.lower().endswith(".onnx"):
        model = OnnxBackbone(path).eval()
    else:
        model = load_backbone(path, network, ema=ema)  # weights that are not finite are refused there
        model = model.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model.source_path = path  # named when its embeddings are not finite
    return model


def model_files(path: str) -> list[str]:
    """The files loading the model at `path` reads (an output must never be one of them)."""
    if not os.path.isdir(path):
        return [path]
    from utils.checkpoint import find_checkpoint
    ckpt = find_checkpoint(path) or path
    return [os.path.join(ckpt, f) for f in os.listdir(ckpt)] if os.path.isdir(ckpt) else []


@dataclass
class Embedder:
    """A frozen embedding network and the crop it wants."""
    module: nn.Module       # eval mode; N x 3 x h x w float in [-1, 1] -> N x D
    template: Template      # the crop geometry (size and five-point positions) it was trained on
    name: str               # what was loaded, for messages and derived files
    fingerprint: str        # a hash of its weights (or ONNX file): derived files record it

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
        # output pixel -> input pixel, in the normalised [-1, 1] grid coordinates of affine_grid
        m = similarity_transform(self.template.points, made_for.points)
        (h_out, w_out), (h_in, w_in) = self.template.size, made_for.size
        to_px = np.array([[w_out / 2, 0, w_out / 2 - 0.5], [0, h_out / 2, h_out / 2 - 0.5], [0, 0, 1]])
        to_grid = np.array([[2 / w_in, 0, 1 / w_in - 1], [0, 2 / h_in, 1 / h_in - 1], [0, 0, 1]])
        theta = (to_grid @ np.vstack([m, [0, 0, 1]]) @ to_px)[:2]
        grid = torch.nn.functional.affine_grid(
            torch.as_tensor(theta, dtype=x.dtype, device=x.device).expand(len(x), 2, 3),
            [len(x), 3, h_out, w_out], align_corners=False)
        # outside the crop is black, as alignment leaves it: -1 in [-1, 1]
        return torch.nn.functional.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros",
                                               align_corners=False) - 1


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


def load_embedder(path: str, network: str | None = None, ema: bool = True) -> Embedder:
    """The Embedder of a MODEL argument (see the module docstring)."""
    module = load_model(path, network, ema)
    fingerprint = fingerprint_file(path) if isinstance(module, OnnxBackbone) else fingerprint_module(module)
    return Embedder(module, ARCFACE_112, path, fingerprint)


def image_files(inputs: list[str]) -> list[str]:
    """Image files and the images under folders (recursively, sorted), in the order given."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(d, f) for d, _, names in os.walk(item) for f in names
                           if f.lower().endswith(IMAGE_EXTENSIONS))
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


def embed_uint8(images: torch.Tensor, model: nn.Module, batch_size: int = 64) -> np.ndarray:
    """N x 3 x 112 x 112 uint8 -> N x D float32: the embedding plus its mirror image's, then
    L2-normalised (verification's flip test)."""
    both = embed(images, model, batch_size) + embed(torch.flip(images, dims=[3]), model, batch_size)
    refuse_non_finite_embeddings(both, getattr(model, "source_path", "the model"))
    return l2_normalize(both).astype(np.float32)


def embed_files(paths: list[str], model: nn.Module, batch_size: int = 64, resize: bool = False,
                show_progress: bool = True) -> np.ndarray:
    """Embeddings of image files, one row per path. Every file's header is read first: images
    that are not 112x112 are refused (unless `resize`) before any is embedded."""
    check_files(paths, resize)
    progress = Progress(len(paths), "embedding") if show_progress and len(paths) > batch_size else None
    out = []
    for start in range(0, len(paths), batch_size):
        chunk = paths[start:start + batch_size]
        images = torch.stack([decode_chw(_read(p), p, resize=FACE_SIZE if resize else None) for p in chunk])
        out.append(embed_uint8(images, model, batch_size))
        if progress is not None:
            progress.update(len(chunk))
    return np.concatenate(out) if out else np.zeros((0, 0), np.float32)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def best_threshold(data_set, model: nn.Module, batch_size: int = 64) -> tuple[float, float]:
    """(cosine threshold, accuracy): the threshold that best separates a verification set's
    pairs (as `load_bin` returns it), with flip-fused embeddings; `cos >= threshold` is "same"."""
    (images, _), issame = data_set
    emb = embed_uint8(images, model, batch_size).astype(np.float64)
    cos = np.sum(emb[0::2] * emb[1::2], axis=1)
    same = np.asarray(issame, dtype=bool)
    candidates = np.unique(cos)
    accuracy = [np.mean((cos >= t) == same) for t in candidates]
    best = int(np.argmax(accuracy))
    return float(candidates[best]), float(accuracy[best])

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
    It holds no weights of its own; an empty parameter tells callers which device to feed."""

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
        inputs = self.session.get_inputs()
        if len(inputs) != 1 or list(inputs[0].shape[1:]) != [3, *FACE_SIZE]:
            raise CheckpointError(f"{path}: expected one input of shape N x 3 x 112 x 112 (as scripts.export_onnx "
                                  f"writes), got {[(i.name, i.shape) for i in inputs]}")
        self.input_name = inputs[0].name
        self.anchor = nn.Parameter(torch.zeros(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.session.run(None, {self.input_name: x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(out).to(x.device)


def load_model(path: str, network: str | None = None, ema: bool = True) -> nn.Module:
    """An eval-mode model whose forward takes N x 3 x 112 x 112 floats in [-1, 1]: an `.onnx`
    through onnxruntime, anything else through eval.weights.load_backbone."""
    if path.lower().endswith(".onnx"):
        return OnnxBackbone(path).eval()
    model = load_backbone(path, network, ema=ema)
    return model.to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


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
                raise FileNotFoundError(f"{item}: no images ({', '.join(IMAGE_EXTENSIONS)})")
            files.extend(found)
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise FileNotFoundError(f"{item}: no such image file or folder")
    return files


def embed_uint8(images: torch.Tensor, model: nn.Module, batch_size: int = 64) -> np.ndarray:
    """N x 3 x 112 x 112 uint8 -> N x D float32: the embedding plus its mirror image's, then
    L2-normalised (verification's flip test)."""
    both = embed(images, model, batch_size) + embed(torch.flip(images, dims=[3]), model, batch_size)
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

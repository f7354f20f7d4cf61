"""An embedding function from any form of a trained model: a run or checkpoint directory, a
`model.pt` (ShardFace or arcface_torch, with `network`), or an exported `.onnx`; and the
embeddings of image files with verification's flip test, L2-normalised."""
from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

from dataset.geometry import check_files
from dataset.images import FACE_SIZE, IMAGE_EXTENSIONS, decode_chw
from eval.verification import embed, l2_normalize
from eval.weights import load_backbone
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

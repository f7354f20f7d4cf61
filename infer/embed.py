"""Crops to embeddings: a network's forward over batches of uint8 crops, verification's flip
test, L2 normalisation, and the refusal of embeddings that are not finite. Every tool, the
gallery, the teacher and training's verification embed through these."""
from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
from torch import nn

from checkpoint.files import CheckpointError
from dataset.images import normalize_images


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def module_device(module: nn.Module) -> torch.device:
    """Where `module` wants its input: its weights' device (the CPU for a module without weights,
    as the ONNX form, which takes input anywhere)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _layout(x: torch.Tensor, nhwc: bool) -> torch.Tensor:
    return x.contiguous(memory_format=torch.channels_last) if nhwc and x.dim() == 4 else x


@torch.no_grad()
def embed_batches(batches: Iterable[torch.Tensor], module: nn.Module) -> np.ndarray:
    """Embeddings of batches of uint8 images (normalised to [-1, 1] here) in eval mode on the
    module's device; the module's train/eval mode is restored afterwards."""
    device = module_device(module)
    # on the CPU, convolutions over channels-last batches are 1.1-1.3x faster, the same math
    # (benchmarks/channels_last.py); a module without weights (the ONNX form) takes them as given
    nhwc = device.type == "cpu" and next(module.parameters(), None) is not None
    was_training = module.training
    module.eval()
    try:
        out = [module(normalize_images(_layout(batch.to(device), nhwc))).float().cpu() for batch in batches]
    finally:
        module.train(was_training)
    return torch.cat(out).numpy()


def embed(images: torch.Tensor, module: nn.Module, batch_size: int) -> np.ndarray:
    """Embeddings of a uint8 image tensor; the result does not depend on batch_size."""
    return embed_batches(images.split(batch_size), module)


def refuse_non_finite_embeddings(emb: np.ndarray, where: str) -> np.ndarray:
    """`emb`, or a CheckpointError naming the model and the first row that is NaN or inf (a
    cosine of NaN compares as neither same nor different)."""
    bad = ~np.isfinite(emb).all(axis=1) if emb.ndim == 2 else ~np.isfinite(emb)
    if bad.any():
        raise CheckpointError(f"{where}: {int(bad.sum())} of {len(bad)} embeddings are not finite (NaN or inf), "
                              f"the first row {int(np.argmax(bad))}; the model's output is unusable")
    return emb


def embed_uint8(images: torch.Tensor, module: nn.Module, batch_size: int = 64, flip: bool = True,
                name: str = "the model") -> np.ndarray:
    """N x 3 x h x w uint8 (the crop `module` takes) -> N x D float32: the embedding plus its
    mirror image's (verification's flip test; only the image's own with flip=False), then
    L2-normalised. Embeddings that are not finite are refused, naming the model (`name`)."""
    out = embed(images, module, batch_size)
    if flip:
        out = out + embed(torch.flip(images, dims=[3]), module, batch_size)
    refuse_non_finite_embeddings(out, name)
    return l2_normalize(out).astype(np.float32)

"""Crops to embeddings, for infer.stream (photos) and training's verification (the .bin sets): a
network's forward over batches of uint8 crops, L2 normalisation, and refusing non-finite rows."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from shardface.dataset.images import normalize_images
from shardface.errors import ModelError


def l2_normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def module_device(module: nn.Module) -> torch.device:
    """Where `module` wants its input: its weights' device (the CPU without weights: the ONNX form takes any)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


AUTOCAST = {"fp16": torch.float16, "bf16": torch.bfloat16}


@torch.no_grad()
def embed(images: torch.Tensor, module: nn.Module, batch_size: int, precision: str = "fp32") -> np.ndarray:
    """Embeddings of uint8 images (normalised to [-1, 1] here), `batch_size` at a time (any gives the same result)
    in eval mode on the module's device (its mode restored after), fp32 or on a GPU under `precision`'s autocast."""
    device = module_device(module)
    # channels-last batches: the same math, faster (benchmarks/README.md, 'Channels-last batches');
    # a module without weights (the ONNX form) takes them as given
    nhwc = (
        device.type in ("cpu", "cuda") and next(module.parameters(), None) is not None and images.dim() == 4
    )
    layout = torch.channels_last if nhwc else torch.contiguous_format
    autocast = device.type == "cuda" and precision in AUTOCAST
    was_training = module.training
    module.eval()
    try:
        with torch.autocast("cuda", AUTOCAST.get(precision, torch.float16), enabled=autocast):
            out = [
                module(normalize_images(batch.to(device).contiguous(memory_format=layout))).float().cpu()
                for batch in images.split(batch_size)
            ]
    finally:
        module.train(was_training)
    return torch.cat(out).numpy()


def refuse_non_finite_embeddings(emb: np.ndarray, where: str) -> np.ndarray:
    """`emb`, or a ModelError naming the model and the first row that is NaN or inf (a
    cosine of NaN compares as neither same nor different)."""
    bad = ~np.isfinite(emb).all(axis=1)
    if bad.any():
        raise ModelError(
            f"{where}: {int(bad.sum())} of {len(bad)} embeddings are not finite (NaN or inf), "
            f"the first row {int(np.argmax(bad))}; the model's output is unusable"
        )
    return emb

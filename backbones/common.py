"""Pieces shared by the backbones: mixed-precision trunk context and checkpointed sequences."""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential


def trunk_autocast(x: torch.Tensor, fp16: bool, bf16: bool):
    """Autocast for the convolutional trunk; the head of the backbone stays fp32."""
    if not (fp16 or bf16):
        return contextlib.nullcontext()
    dtype = torch.float16 if fp16 else torch.bfloat16
    return torch.autocast(device_type=x.device.type, dtype=dtype)


def run_layers(layers: nn.Module, x: torch.Tensor, grad_checkpoint: bool) -> torch.Tensor:
    """Run a Sequential, recomputing each child's activations in backward when asked."""
    if not (grad_checkpoint and torch.is_grad_enabled()):
        return layers(x)
    for layer in layers:
        x = checkpoint(layer, x, use_reentrant=False)
    return x


def run_segments(layers: nn.Sequential, x: torch.Tensor, segments: int) -> torch.Tensor:
    """Run a Sequential keeping only the inputs of `segments` runs of children for backward
    (each run recomputed in its own backward): for stages too deep to keep every block's input."""
    if not torch.is_grad_enabled():
        return layers(x)
    return checkpoint_sequential(layers, segments, x, use_reentrant=False)

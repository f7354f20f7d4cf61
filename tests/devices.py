"""The device kinds the GPU kit's tests take: `cuda` (marked gpu, skipped without CUDA) and
`cpu`, which runs the same bodies everywhere, in this process and in subprocesses."""

from __future__ import annotations

import os

import pytest
import torch

CUDA = pytest.param("cuda", marks=pytest.mark.gpu, id="cuda")


def device_of(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device("cpu")


def env_for(kind: str) -> dict:
    """A subprocess's environment: the cpu cases hide any GPU, so they run on the CPU anywhere."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="") if kind == "cpu" else dict(os.environ)

"""Trained weights for evaluation, export and fine-tuning: a backbone built from any form that
checkpoint.load.read_backbone_weights reads, or from `dlib` (dlib's descriptor, network `dlib_resnet`)."""

from __future__ import annotations

import functools
import os

from torch import nn

from shardface.backbones import get_model
from shardface.backbones.dlib_resnet import DlibResNet
from shardface.checkpoint.dlib_format import read_network, state_dict_for
from shardface.checkpoint.files import CheckpointError
from shardface.checkpoint.load import read_backbone_weights, refuse_non_finite, state_mismatch
from shardface.faces.models import model_file

DLIB = "dlib"  # the MODEL / init_backbone name of dlib's face descriptor
DLIB_FILE = "dlib_face_recognition_resnet_model_v1.dat"


def dlib_state() -> dict:
    """dlib's descriptor as backbones.dlib_resnet's state dict, read once per process: callers copy, never change it."""
    path = model_file(DLIB_FILE)
    stat = os.stat(path)
    return _dlib_state(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _dlib_state(path: str, size: int, mtime_ns: int) -> dict:
    return state_dict_for(DlibResNet(), read_network(path))


def load_backbone_state(path: str, ema: bool = True) -> tuple[dict, dict]:
    """(state dict, training config or {}) of checkpoint.load.read_backbone_weights, or `dlib`'s (its network's)."""
    if path == DLIB:
        return dlib_state(), {"network": "dlib_resnet", "embedding_size": 128}
    return read_backbone_weights(path, ema)


def load_backbone(path: str, network: str | None = None, ema: bool = True) -> nn.Module:
    """An eval-mode fp32 backbone with the weights at `path` (EMA weights when present and
    `ema`). `network` defaults to the one recorded in the training config."""
    state, config = load_backbone_state(path, ema)
    network = network or config.get("network")
    if not network:
        raise CheckpointError(f"{path}: no training config beside it names the network; pass --network")
    # without a config (an arcface_torch model.pt), a guess: the width of the last BatchNorm, the embedding's in
    # insightface's networks (iresnet, mbf); a wrong guess is refused by state_mismatch below, naming the key
    bn = [k for k in state if k.endswith("running_mean")]
    size = config.get("embedding_size") or (int(state[bn[-1]].numel()) if bn else 512)
    model = get_model(network, num_features=size)
    problem = state_mismatch(state, model.state_dict())
    if problem:
        raise CheckpointError(f"{path} is not a '{network}' checkpoint: {problem}")
    refuse_non_finite(state, path)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def init_backbone_from(backbone: nn.Module, path: str, network: str) -> None:
    """Load pretrained weights at `path` (any form `load_backbone_state` reads) into `backbone`,
    strictly: a CheckpointError names the first key that does not fit `network`."""
    state, _ = load_backbone_state(path)
    problem = state_mismatch(state, backbone.state_dict())
    if problem:
        raise CheckpointError(
            f"init_backbone {path}: these weights do not fit network '{network}': {problem}"
        )
    backbone.load_state_dict(state, strict=True)

"""Trained weights for evaluation, export and fine-tuning: a backbone from a ShardFace run,
checkpoint, `model.pt`, a plain (insightface) state dict, an arcface_torch
`checkpoint_gpu_<rank>.pt`, or `dlib` (dlib's face descriptor, network `dlib_resnet`)."""
from __future__ import annotations

import functools
import json
import logging
import os

import torch
from torch import nn

from backbones import get_model
from backbones.dlib_resnet import DlibResNet
from checkpoint.files import CheckpointError, safe_load
from checkpoint.load import read_backbone_weights
from checkpoint.dlib_format import read_network, state_dict_for
from faces.models import model_file

DLIB = "dlib"  # the MODEL / init_backbone name of dlib's face descriptor
DLIB_FILE = "dlib_face_recognition_resnet_model_v1.dat"

logger = logging.getLogger("shardface")


def _embedding_size(state: dict) -> int | None:
    """A guess for weights that come without a config (an arcface_torch model.pt): the width of
    the last BatchNorm, which is the embedding's in insightface's networks (iresnet, mbf). A
    network that ends otherwise (dlib_resnet ends in a linear layer) is sized by its config; a
    wrong guess is refused by `state_mismatch`, naming the key."""
    bn = [k for k in state if k.endswith("running_mean")]
    return int(state[bn[-1]].numel()) if bn else None


def _sibling_config(path: str) -> dict:
    """The training config saved beside a weights file, or {} when it is missing or unreadable
    (with a warning naming it: `--network` does without it)."""
    cfg = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
    if not os.path.isfile(cfg):
        return {}
    try:
        with open(cfg) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s: %s), so it is ignored: pass --network to name the backbone", cfg, type(exc).__name__, exc)
        return {}
    return config if isinstance(config, dict) else {}


def dlib_state() -> dict:
    """The state dict of backbones.dlib_resnet holding dlib's face descriptor weights
    (face-recognition-models' file, read once per process: callers copy, never change it)."""
    path = model_file(DLIB_FILE)
    stat = os.stat(path)
    return _dlib_state(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _dlib_state(path: str, size: int, mtime_ns: int) -> dict:
    return state_dict_for(DlibResNet(), read_network(path))


def load_backbone_state(path: str, ema: bool = True) -> tuple[dict, dict]:
    """(state dict, training config or {}) from a checkpoint dir, a run output, a .pt file, or
    `dlib` (dlib's weights, with the config of the network they fit)."""
    if path == DLIB:
        return dlib_state(), {"network": "dlib_resnet", "embedding_size": 128}
    if os.path.isdir(path):
        return read_backbone_weights(path, ema)
    state = safe_load(path)
    for key in ("state_dict", "state_dict_backbone"):  # a wrapped state dict; arcface_torch's checkpoint_gpu_<r>.pt
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise CheckpointError(f"{path}: not a backbone state dict")
    return {k.removeprefix("module."): v for k, v in state.items()}, _sibling_config(path)


def load_backbone(path: str, network: str | None = None, ema: bool = True) -> nn.Module:
    """An eval-mode fp32 backbone with the weights at `path` (EMA weights when present and
    `ema`). `network` defaults to the one recorded in the training config."""
    state, config = load_backbone_state(path, ema)
    network = network or config.get("network")
    if not network:
        raise CheckpointError(f"{path}: no training config beside it names the network; pass --network")
    model = get_model(network, num_features=config.get("embedding_size") or _embedding_size(state) or 512)
    problem = state_mismatch(state, model.state_dict())
    if problem:
        raise CheckpointError(f"{path} is not a '{network}' checkpoint: {problem}")
    refuse_non_finite(state, path)
    model.load_state_dict(state, strict=True)
    return model.float().eval()


def refuse_non_finite(state: dict, path: str) -> None:
    """A CheckpointError naming the first tensor of `state` with a NaN or infinite value: such
    weights give NaN embeddings, which compare as nothing and verify as chance."""
    for key, value in state.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise CheckpointError(f"{path}: weight '{key}' has {bad} non-finite (NaN or inf) values of "
                                  f"{value.numel()}; the model is unusable (was training diverging?)")


def state_mismatch(state: dict, expected: dict) -> str | None:
    """What keeps `state` from loading strictly where `expected` (a model's state dict) is:
    missing and unexpected keys, else the first key of another shape; None when it fits."""
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        return (f"{len(missing)} missing keys (e.g. {missing[:2]}), {len(unexpected)} unexpected "
                f"(e.g. {unexpected[:2]})")
    mismatched = [k for k, v in expected.items() if state[k].shape != v.shape]
    if mismatched:
        k = mismatched[0]
        return f"'{k}' has shape {tuple(state[k].shape)}, expected {tuple(expected[k].shape)}"
    return None


def init_backbone_from(backbone: nn.Module, path: str, network: str) -> None:
    """Load pretrained weights at `path` (any form `load_backbone_state` reads) into `backbone`,
    strictly: a CheckpointError names the first key that does not fit `network`."""
    state, _ = load_backbone_state(path)
    problem = state_mismatch(state, backbone.state_dict())
    if problem:
        raise CheckpointError(f"init_backbone {path}: these weights do not fit network '{network}': {problem}")
    backbone.load_state_dict(state, strict=True)

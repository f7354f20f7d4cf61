"""Backbone registry: `get_model(name, **kwargs)` builds a network by name.

Every backbone maps a N x 3 x 112 x 112 image batch to N x `num_features` embeddings and
accepts `fp16`, `bf16` (autocast inside the trunk, last FC and feature BN in fp32) and
`grad_checkpoint`.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from backbones.iresnet import DEPTHS, IResNet
from backbones.mobilefacenet import MobileFaceNet
from backbones.tiny import TinyCNN
from backbones.vit import VIT_SIZES, VisionTransformer

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str):
    def wrap(fn):
        _REGISTRY[name] = fn
        return fn
    return wrap


for _name, _layers in DEPTHS.items():
    register_model(_name)(lambda _l=_layers, **kw: IResNet(_l, **kw))
for _name, _size in VIT_SIZES.items():
    register_model(_name)(lambda _s=_size, **kw: VisionTransformer(**_s, **kw))
register_model("mbf")(lambda **kw: MobileFaceNet(**{k: v for k, v in kw.items() if k != "dropout"}))
register_model("mbf_large")(lambda **kw: MobileFaceNet(blocks=(2, 8, 12, 4), scale=4,
                                                       **{k: v for k, v in kw.items() if k != "dropout"}))
register_model("tiny")(lambda **kw: TinyCNN(**kw))


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def get_model(name: str, **kwargs) -> nn.Module:
    """Build backbone `name`; kwargs: num_features, dropout, fp16, bf16, grad_checkpoint."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown network '{name}'; known networks: {', '.join(list_models())}")
    return _REGISTRY[name](**kwargs)

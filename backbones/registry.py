"""The backbone registry: family files register builders by name (timm's `register_model`)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from shardface.errors import ConfigError

_REGISTRY: dict[str, Callable[..., nn.Module]] = {}


def register_model(name: str) -> Callable:
    """Decorator: `@register_model("r50")` on a function `(**kwargs) -> nn.Module`."""

    def wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        if name in _REGISTRY:
            raise ValueError(f"backbone '{name}' registered twice")
        _REGISTRY[name] = fn
        return fn

    return wrap


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def get_model(name: str, **kwargs) -> nn.Module:
    """Build backbone `name`; kwargs: num_features, dropout, fp16, bf16, grad_checkpoint."""
    if name not in _REGISTRY:  # a ConfigError (a ValueError too): the tools print it as one line
        raise ConfigError(f"unknown network '{name}'; known networks: {', '.join(list_models())}")
    return _REGISTRY[name](**kwargs)

"""Backbones by name: `get_model(name, **kwargs)`; each family file registers its names.

Every backbone maps a N x 3 x 112 x 112 image batch to N x `num_features` embeddings and
accepts `fp16`, `bf16` (autocast inside the trunk, last FC and feature BN in fp32),
`grad_checkpoint` and `dropout` (on the flattened trunk output before the embedding layer;
MobileFaceNet, like arcface_torch's, has none and refuses a non-zero value).
"""

from shardface.backbones import dlib_resnet, iresnet, mobilefacenet, tiny, vit  # noqa: F401  (registration)
from shardface.backbones.registry import get_model, list_models, register_model

__all__ = ["get_model", "list_models", "register_model"]

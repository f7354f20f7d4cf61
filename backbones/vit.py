"""Vision transformers for 112x112 faces, patch 9 (12x12 = 144 tokens)."""
from __future__ import annotations

import torch
from torch import nn

from backbones.common import run_layers, trunk_autocast
from backbones.registry import register_model


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, embed_dim: int, depth: int, num_heads: int, num_features: int = 512,
                 img_size: int = 112, patch_size: int = 9, fp16: bool = False, bf16: bool = False,
                 grad_checkpoint: bool = False, dropout: float = 0.0):
        super().__init__()
        self.fp16, self.bf16, self.grad_checkpoint = fp16, bf16, grad_checkpoint
        grid = img_size // patch_size
        num_patches = grid * grid
        self.patch_embed = nn.Conv2d(3, embed_dim, patch_size, stride=patch_size)
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.blocks = nn.Sequential(*[Block(embed_dim, num_heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)
        self.feature = nn.Sequential(
            nn.Linear(embed_dim * num_patches, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim),
            nn.Linear(embed_dim, num_features, bias=False),
            nn.BatchNorm1d(num_features),
        )
        self.img_size = img_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with trunk_autocast(x, self.fp16, self.bf16):
            x = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
            x = self.norm(run_layers(self.blocks, x, self.grad_checkpoint))
        return self.feature(self.dropout(x.to(self.pos_embed.dtype).flatten(1)))


VIT_SIZES = {
    "vit_t": dict(embed_dim=256, depth=12, num_heads=8),
    "vit_s": dict(embed_dim=512, depth=12, num_heads=8),
    "vit_b": dict(embed_dim=512, depth=24, num_heads=8),
}


def _register(name: str, size: dict) -> None:
    register_model(name)(lambda **kw: VisionTransformer(**size, **kw))


for _name, _size in VIT_SIZES.items():
    _register(_name, _size)

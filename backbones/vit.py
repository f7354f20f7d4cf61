"""Vision transformers for 112x112 faces (patch 9: 12x12 = 144 tokens), arcface_torch's ViTs.

Parameter names, shapes and registration order equal insightface arcface_torch's
`backbones/vit.py`, so its published ViT weights load with `strict=True` and its optimizer
states map parameter by parameter. The function is the same: pre-norm blocks (LayerNorm,
bias-free qkv, softmax attention in fp32, MLP with ReLU6), a final LayerNorm and a feature
head over all tokens (Linear, BatchNorm eps 2e-5, Linear, BatchNorm eps 2e-5).

In training only, as arcface_torch:
- `mask_ratio` > 0: each sample keeps `int(L * (1 - mask_ratio))` of its L tokens, drawn at
  random; the blocks see only those, and the dropped positions are filled after the final
  norm with a learned `mask_token`;
- stochastic depth: block i drops each residual branch per sample with probability
  `drop_path_rate * i / (depth - 1)` and scales kept branches by 1 / (1 - p);
- `grad_checkpoint` recomputes each block in backward (the large names always do).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from shardface.backbones.common import trunk_autocast
from shardface.backbones.registry import register_model


def _no_autocast(device_type: str):
    if not torch.amp.is_autocast_available(device_type):  # the meta device (planner, flops)
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, enabled=False)


def drop_path(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Zero the whole branch of a random subset of samples (rate p), rescaling the rest."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class PatchEmbed(nn.Module):
    def __init__(self, img_size: int, patch_size: int, embed_dim: int):
        super().__init__()
        self.img_size = img_size
        self.num_patches = (img_size // patch_size) ** 2
        self.proj = nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[-2:]) != (self.img_size, self.img_size):
            raise ValueError(
                f"ViT input {tuple(x.shape[-2:])}: expected {self.img_size}x{self.img_size} images"
            )
        return self.proj(x).flatten(2).transpose(1, 2)  # N x L x D


class Attention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, length, dim = x.shape
        q, k, v = self.qkv(x).view(n, length, 3, self.num_heads, dim // self.num_heads).permute(2, 0, 3, 1, 4)
        # scores and softmax in fp32 even under autocast, as arcface_torch
        wide = torch.promote_types(q.dtype, torch.float32)  # fp16/bf16 up, fp64 stays
        with _no_autocast(x.device.type):
            out = F.scaled_dot_product_attention(q.to(wide), k.to(wide), v.to(wide))
        return self.proj(out.transpose(1, 2).reshape(n, length, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.ReLU6()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, drop_path_rate: float, mlp_ratio: float = 4.0):
        super().__init__()
        # registration order (norms first) is arcface_torch's: it fixes the parameter order
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads)
        self.drop_path_rate = drop_path_rate
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.attn(self.norm1(x)), self.drop_path_rate, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path_rate, self.training)


class VisionTransformer(nn.Module):
    def __init__(
        self,
        embed_dim: int,
        depth: int,
        num_heads: int,
        num_features: int = 512,
        drop_path_rate: float = 0.0,
        mask_ratio: float = 0.0,
        img_size: int = 112,
        patch_size: int = 9,
        fp16: bool = False,
        bf16: bool = False,
        grad_checkpoint: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        if not 0.0 <= mask_ratio < 1.0:
            raise ValueError(f"mask_ratio {mask_ratio}: expected a fraction in [0, 1)")
        self.fp16, self.bf16, self.grad_checkpoint = fp16, bf16, grad_checkpoint
        self.embed_dim, self.mask_ratio = embed_dim, mask_ratio
        self.patch_embed = PatchEmbed(img_size, patch_size, embed_dim)
        self.num_patches = self.patch_embed.num_patches
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_patches, embed_dim))
        # float32 linspace as arcface_torch (explicit CPU: also builds under a meta device)
        rates = torch.linspace(0, drop_path_rate, depth, device="cpu").tolist()
        self.blocks = nn.ModuleList([Block(embed_dim, num_heads, rate) for rate in rates])
        self.norm = nn.LayerNorm(embed_dim)
        self.dropout = nn.Dropout(dropout)  # ShardFace's `dropout` key; arcface_torch has none (0)
        self.feature = nn.Sequential(
            nn.Linear(embed_dim * self.num_patches, embed_dim, bias=False),
            nn.BatchNorm1d(embed_dim, eps=2e-5),
            nn.Linear(embed_dim, num_features, bias=False),
            nn.BatchNorm1d(num_features, eps=2e-5),
        )
        # never used without masking: frozen then, so ZeRO-2 and DDP expect no gradient for it
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim), requires_grad=mask_ratio > 0)
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def keep_random_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens each sample keeps (N x K x D, K = int(L * (1 - mask_ratio))) and their positions."""
        n, length, dim = x.shape
        kept = int(length * (1 - self.mask_ratio))
        order = torch.argsort(torch.rand(n, length, device=x.device), dim=1)
        positions = order[:, :kept]
        return torch.gather(x, 1, positions.unsqueeze(-1).expand(-1, -1, dim)), positions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masking = self.training and self.mask_ratio > 0
        with trunk_autocast(x, self.fp16, self.bf16):
            x = self.patch_embed(x) + self.pos_embed
            if masking:
                x, positions = self.keep_random_tokens(x)
            for block in self.blocks:
                if self.grad_checkpoint and self.training and torch.is_grad_enabled():
                    x = checkpoint(block, x, use_reentrant=False)
                else:
                    x = block(x)
        x = self.norm(x.to(self.norm.weight.dtype))
        if masking:
            full = self.mask_token.to(x.dtype).expand(x.shape[0], self.num_patches, -1)
            x = full.scatter(1, positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]), x)
        return self.feature(self.dropout(x.flatten(1)))


# arcface_torch's get_model names. Its forward masks at its default ratio 0.1 whenever the
# configured ratio is non-zero, so its "mask_005" networks train with 0.1: registered as such.
VIT_NETWORKS = {
    "vit_t": dict(embed_dim=256, depth=12, drop_path_rate=0.1, mask_ratio=0.1),
    "vit_t_dp005_mask0": dict(embed_dim=256, depth=12, drop_path_rate=0.05, mask_ratio=0.0),
    "vit_s": dict(embed_dim=512, depth=12, drop_path_rate=0.1, mask_ratio=0.1),
    "vit_s_dp005_mask_0": dict(embed_dim=512, depth=12, drop_path_rate=0.05, mask_ratio=0.0),
    "vit_b": dict(embed_dim=512, depth=24, drop_path_rate=0.1, mask_ratio=0.1, checkpointed=True),
    "vit_b_dp005_mask_005": dict(
        embed_dim=512, depth=24, drop_path_rate=0.05, mask_ratio=0.1, checkpointed=True
    ),
    "vit_l_dp005_mask_005": dict(
        embed_dim=768, depth=24, drop_path_rate=0.05, mask_ratio=0.1, checkpointed=True
    ),
    "vit_h": dict(embed_dim=1024, depth=48, drop_path_rate=0.1, mask_ratio=0.0, checkpointed=True),
}


def _register(name: str, spec: dict) -> None:
    spec = dict(spec)
    checkpointed = spec.pop("checkpointed", False)

    def build(grad_checkpoint: bool = False, **kw) -> VisionTransformer:
        # arcface_torch always checkpoints its large ViTs in training; the key adds it to the others
        return VisionTransformer(num_heads=8, grad_checkpoint=grad_checkpoint or checkpointed, **spec, **kw)

    register_model(name)(build)


for _name, _spec in VIT_NETWORKS.items():
    _register(_name, _spec)

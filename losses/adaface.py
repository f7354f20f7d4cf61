"""AdaFace (Kim et al., CVPR 2022): a margin adapted to image quality, read off the feature norm."""

from __future__ import annotations

import math

import torch

from shardface.losses.base import MarginLoss


class AdaFace(MarginLoss):
    """The target's angle moves by -m * q and its cosine by -(m + m * q), where the quality
    q = clip(h * (|x| - mean) / (std + eps), -1, 1) compares each raw embedding norm with
    running estimates of the batch mean and (unbiased) std of norms. Norms are detached and
    clipped to [0.001, 100]; the estimates are EMAs (`t_alpha`) starting at mean 20 and std
    100, updated from the global batch before use. Every cosine is clamped to
    [-1 + eps, 1 - eps], eps = 1e-3, as the authors do.
    """

    eps = 1e-3

    def __init__(self, s: float = 64.0, m: float = 0.4, h: float = 0.333, t_alpha: float = 0.01):
        super().__init__(s)
        self.m, self.h, self.t_alpha = float(m), float(h), float(t_alpha)
        self.register_buffer("batch_mean", torch.tensor(20.0))
        self.register_buffer("batch_std", torch.tensor(100.0))

    def begin_step(self, target_cos: torch.Tensor, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        safe = norms.detach().float().clamp(0.001, 100.0)
        if self.training:
            with torch.no_grad():
                self.batch_mean.mul_(1 - self.t_alpha).add_(self.t_alpha * safe.mean())
                self.batch_std.mul_(1 - self.t_alpha).add_(self.t_alpha * safe.std())
        quality = ((safe - self.batch_mean) / (self.batch_std + self.eps) * self.h).clamp(-1.0, 1.0)
        return {"quality": quality}

    def target_logit(self, cos: torch.Tensor, rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        q = rows["quality"]
        theta = torch.acos(cos.clamp(-1 + self.eps, 1 - self.eps))
        theta_m = (theta - self.m * q).clamp(self.eps, math.pi - self.eps)
        return self.s * (torch.cos(theta_m) - (self.m + self.m * q))

    def linear_other_logits(self) -> tuple[float, float, float]:
        return self.s, -1 + self.eps, 1 - self.eps

    def other_logits(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        return cos.clamp(-1 + self.eps, 1 - self.eps) * self.s

    def other_grad(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.where((cos > -1 + self.eps) & (cos < 1 - self.eps), self.s, 0.0)

    def extra_repr(self) -> str:
        return f"s={self.s}, m={self.m}, h={self.h}, t_alpha={self.t_alpha}"

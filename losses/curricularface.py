"""CurricularFace (Huang et al., CVPR 2020): hard negatives weigh more as training goes on."""

from __future__ import annotations

import math

import torch

from shardface.losses.base import MarginLoss


class CurricularFace(MarginLoss):
    """Target as ArcFace (cos(theta + m), cos - m sin(m) past theta + m = pi). A negative
    whose cosine exceeds the row's cos(theta_y + m) is a hard example and becomes
    cos * (t + cos), the gradient flowing through both factors; t is an EMA (0.01) of the
    mean target cosine of the global batch, updated before use, starting at 0."""

    def __init__(self, s: float = 64.0, m: float = 0.5):
        super().__init__(s)
        self.m = float(m)
        self.register_buffer("t", torch.tensor(0.0))

    def begin_step(self, target_cos: torch.Tensor, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        cos = target_cos.detach().float().clamp(-1.0, 1.0)
        if self.training:
            with torch.no_grad():
                self.t.mul_(0.99).add_(0.01 * cos.mean())
        sin = (1.0 - cos * cos).clamp_min(0.0).sqrt()
        return {"hard_above": cos * math.cos(self.m) - sin * math.sin(self.m), "t": self.t.detach().clone()}

    def target_logit(self, cos: torch.Tensor, rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        cos = cos.clamp(-1.0, 1.0)
        sin = (1.0 - cos * cos).clamp_min(0.0).sqrt()
        with_margin = cos * math.cos(self.m) - sin * math.sin(self.m)
        target = torch.where(
            cos > math.cos(math.pi - self.m), with_margin, cos - math.sin(math.pi - self.m) * self.m
        )
        return self.s * target

    def linear_other_logits(self) -> None:
        return None  # hard negatives' logits are s * cos * (t + cos)

    def other_logits(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        hard = cos > rows["hard_above"][:, None]
        return torch.where(hard, cos * (rows["t"] + cos), cos) * self.s

    def other_grad(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        hard = cos > rows["hard_above"][:, None]
        return torch.where(hard, rows["t"] + 2.0 * cos, 1.0) * self.s

    def extra_repr(self) -> str:
        return f"s={self.s}, m={self.m}"

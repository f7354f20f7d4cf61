"""MagFace (Meng et al., CVPR 2021): a margin that grows with the feature magnitude, plus a
regulariser that rewards magnitude for easy samples."""

from __future__ import annotations

import math

import torch

from shardface.losses.base import MarginLoss


class MagFace(MarginLoss):
    """With a = clamp(|x|, l_a, u_a) the raw embedding norm, the target's margin is
    m(a) = l_m + (u_m - l_m) (a - l_a) / (u_a - l_a) in angle (cos(theta + m(a))); the loss
    adds `lambda_g * mean(a / u_a^2 + 1 / a)`. The gradient reaches the norm through the
    margin and the regulariser. `easy_margin` (the authors' default) keeps cos(theta) where
    cos(theta) <= 0; otherwise past theta + m = pi the target is cos - m sin(m)."""

    uses_norms = True

    def __init__(
        self,
        s: float = 64.0,
        l_a: float = 10.0,
        u_a: float = 110.0,
        l_m: float = 0.45,
        u_m: float = 0.8,
        lambda_g: float = 20.0,
        easy_margin: bool = True,
    ):
        super().__init__(s)
        if not (0 < l_a < u_a and l_m <= u_m):
            raise ValueError(
                f"MagFace needs 0 < l_a < u_a and l_m <= u_m; got l_a={l_a}, u_a={u_a}, l_m={l_m}, u_m={u_m}"
            )
        self.l_a = float(l_a)
        self.u_a = float(u_a)
        self.l_m = float(l_m)
        self.u_m = float(u_m)
        self.lambda_g, self.easy_margin = float(lambda_g), bool(easy_margin)

    def _magnitude(self, norms: torch.Tensor) -> torch.Tensor:
        return norms.float().clamp(self.l_a, self.u_a)

    def begin_step(self, target_cos: torch.Tensor, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        a = self._magnitude(norms)
        return {"margin": (self.u_m - self.l_m) / (self.u_a - self.l_a) * (a - self.l_a) + self.l_m}

    def target_logit(self, cos: torch.Tensor, rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        m = rows["margin"]
        cos = cos.clamp(-1.0, 1.0)
        sin = (1.0 - cos * cos).clamp_min(0.0).sqrt()
        with_margin = cos * torch.cos(m) - sin * torch.sin(m)
        if self.easy_margin:
            target = torch.where(cos > 0, with_margin, cos)
        else:
            target = torch.where(cos > torch.cos(math.pi - m), with_margin, cos - torch.sin(math.pi - m) * m)
        return self.s * target

    def regularizer(self, norms: torch.Tensor) -> torch.Tensor:
        a = self._magnitude(norms)
        return self.lambda_g * (a / self.u_a**2 + 1.0 / a).mean()

    def extra_repr(self) -> str:
        return (
            f"s={self.s}, l_a={self.l_a}, u_a={self.u_a}, l_m={self.l_m}, u_m={self.u_m}, "
            f"lambda_g={self.lambda_g}, easy_margin={self.easy_margin}"
        )

"""The combined margin s*(cos(m1*theta + m2) - m3) on the target cosine.

ArcFace = (1, m2, 0), CosFace / AM-softmax = (1, 0, m3), SphereFace = (m1, 0, 0).
"""

from __future__ import annotations

import math

import torch

from shardface.losses.base import MarginLoss


class CombinedMarginLoss(MarginLoss):
    """Called as `margin(cos_logits, labels)` like arcface_torch's CombinedMarginLoss, and used
    by the sharded head through `target_logit` / `other_logits` (see losses/base.py).

    `straight_through`: the loss is the same, but the target logit's derivative in cos is
    taken as s, as if there were no angular margin: the gradient arcface_torch computes
    (it applies the margin under `no_grad`). False (the default) is the true derivative of
    the loss being minimised; True reproduces an arcface_torch run.
    """

    def __init__(
        self,
        s: float = 64.0,
        m1: float = 1.0,
        m2: float = 0.5,
        m3: float = 0.0,
        interclass_filtering_threshold: float = 0.0,
        *,
        straight_through: bool = False,
    ):
        super().__init__(s, interclass_filtering_threshold)
        self.straight_through = bool(straight_through)
        if m1 < 1.0 or m2 < 0 or m3 < 0:
            raise ValueError(f"margins need m1 >= 1, m2 >= 0, m3 >= 0; got ({m1}, {m2}, {m3})")
        self.m1, self.m2, self.m3 = float(m1), float(m2), float(m3)
        # Keep theta' = m1*theta + m2 <= pi: past the switch point cos(theta') would rise
        # again, so the target continues as cos(theta) minus a constant. For m1 = 1 that is
        # arcface_torch's rule (cos - m2*sin(m2) below cos(pi - m2)), so results match it.
        if m1 == 1.0:
            self._cos_switch = math.cos(math.pi - m2)
            self._drop = math.sin(math.pi - m2) * m2
        else:
            theta_c = (math.pi - m2) / m1
            self._cos_switch = math.cos(theta_c)
            self._drop = math.cos(theta_c) + 1.0  # continuous at the switch point

    def target_logit(self, cos: torch.Tensor, rows: dict | None = None) -> torch.Tensor:
        """Scaled logit of the target class given its cosine (differentiable, elementwise)."""
        if self.straight_through:
            plain = self.s * (cos - self.m3)
            return plain + (self._margin_logit(cos) - plain).detach()
        return self._margin_logit(cos)

    def _margin_logit(self, cos: torch.Tensor) -> torch.Tensor:
        cos = cos.clamp(-1.0, 1.0)
        if self.m1 == 1.0 and self.m2 == 0.0:
            return self.s * (cos - self.m3)
        eps = 1e-7
        theta = torch.acos(cos.clamp(-1.0 + eps, 1.0 - eps))
        inside = torch.cos(self.m1 * theta + self.m2)
        target = torch.where(cos > self._cos_switch, inside, cos - self._drop)
        return self.s * (target - self.m3)

    def extra_repr(self) -> str:
        return f"s={self.s}, m1={self.m1}, m2={self.m2}, m3={self.m3}"


def ArcFace(s: float = 64.0, margin: float = 0.5) -> CombinedMarginLoss:
    return CombinedMarginLoss(s=s, m1=1.0, m2=margin, m3=0.0)


def CosFace(s: float = 64.0, m: float = 0.4) -> CombinedMarginLoss:
    return CombinedMarginLoss(s=s, m1=1.0, m2=0.0, m3=m)


AMSoftmax = CosFace

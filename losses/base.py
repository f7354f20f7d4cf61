"""The contract between a margin and the class-sharded head (heads/sharded_ce.py).

The head forms, for every row i of the global batch and every class j of its shard, the
cosine between the L2-normalised embedding and weight row, and asks the margin for logits:

- the target column of each row: `target_logit(cos_y, rows)`, differentiable in `cos_y` and
  in any tensor of `rows` that requires grad (MagFace's embedding norm);
- every other column: `other_logits(cos, rows)`, elementwise, with derivative
  `other_grad(cos, rows)` (a float where it is constant).

`rows` is the per-row context of one step, made once by `begin_step` from the global batch:
every value is a tensor of B entries (sliced by the head to the rows it processes) or a
0-dim tensor (shared by all rows). It is identical on every rank, because the inputs are:
the target cosines are all-reduced and the norms come from the all-gathered embeddings.
Running statistics (AdaFace's norm mean/std, CurricularFace's t) are registered buffers,
updated in `begin_step` while training, so they are checkpointed with the head.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class MarginLoss(nn.Module):
    """Base class: plain scaled cosine logits s * cos; subclasses change what they need.

    `subcenters` k > 1: the head keeps k weight rows per class (class-major) and a class's
    cosine is the max over them. `interclass_filtering_threshold` > 0 (arcface_torch's
    option): non-target cosines above it become 0 and carry no gradient.
    """

    subcenters: int = 1
    uses_norms: bool = False  # True: rows["norm"] (raw embedding norms) carries gradient

    def __init__(self, s: float = 64.0, interclass_filtering_threshold: float = 0.0):
        super().__init__()
        if s <= 0:
            raise ValueError(f"scale s must be positive, got {s}")
        self.s = float(s)
        self.interclass_filtering_threshold = float(interclass_filtering_threshold)

    def begin_step(self, target_cos: torch.Tensor, norms: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-row context of this step. `target_cos` (B,) is detached; `norms` (B,) are the
        raw embedding norms, requiring grad only when `uses_norms`."""
        return {}

    def target_logit(self, cos: torch.Tensor, rows: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        return self.s * cos

    def other_logits(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        thr = self.interclass_filtering_threshold
        if thr > 0:
            return torch.where(cos > thr, 0.0, cos * self.s)
        return cos * self.s

    def other_grad(self, cos: torch.Tensor, rows: dict[str, torch.Tensor]) -> torch.Tensor | float:
        thr = self.interclass_filtering_threshold
        if thr > 0:
            return torch.where(cos > thr, 0.0, self.s)
        return self.s

    def linear_other_logits(self) -> tuple[float, float, float] | None:
        """(s, lo, hi) where `other_logits` is exactly s * clamp(cos, lo, hi), with derivative s
        strictly between lo and hi and 0 outside, and no target logit exceeds s; None where
        other logits are anything else. The head then keeps exp(logit) instead of cosines
        (one exponential per logit, not two)."""
        if self.interclass_filtering_threshold > 0:
            return None
        return self.s, -math.inf, math.inf

    def regularizer(self, norms: torch.Tensor) -> torch.Tensor | None:
        """A term added to the loss from the global batch's norms (MagFace), or None."""
        return None

    def forward(
        self, cos: torch.Tensor, labels: torch.Tensor, norms: torch.Tensor | None = None
    ) -> torch.Tensor:
        """arcface_torch's call: logits from a full B x C cosine matrix (one class per column,
        `labels` index columns, -1 for rows whose class is elsewhere). The input is not modified."""
        cos = cos.clamp(-1.0, 1.0)
        b = torch.arange(cos.shape[0], device=cos.device)
        has = labels >= 0
        cols = labels.clamp_min(0)
        target_cos = cos[b, cols]
        rows = self.begin_step(
            target_cos.detach(), norms if norms is not None else cos.new_ones(cos.shape[0])
        )
        out = self.other_logits(cos, rows)
        target = self.target_logit(target_cos, rows)
        return out.index_put((b[has], cols[has]), target[has])

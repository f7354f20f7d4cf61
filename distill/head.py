"""Distillation's term of a rank's loss, and the projection it trains.

Gradient scale, as the margin head's (heads/partial_fc.py): the backbone optimizer averages
gradients over ranks, so each rank's loss must give W x its share of the global gradient.
- cosine: the mean over the rank's own b rows is W x its share of the global mean over W*b
  rows. Nothing is communicated: the teacher's targets are per row.
- relational: the global loss compares the (W*b) x (W*b) cosine matrices. Rank r takes its
  b rows of them, read from the embeddings the head gathers (whose backward sums every
  rank's gradient and scales it by W), against all W*b columns; the teacher's embeddings are
  gathered once (no gradient). The mean over b x W*b entries is W x the rank's share, so its
  gradient is taken 1/W (the value stays that mean: rank 0's logged loss estimates the global).
"""

from __future__ import annotations

import torch
from torch import nn

from shardface.checkpoint.state import DISTILL_PROJECTION
from shardface.distill.losses import DISTILL_LOSSES, centred, cosine_distill, relational_distill
from shardface.parallel.collectives import all_gather_no_grad, all_gather_rows
from shardface.parallel.dist import get_rank, get_world_size

PROJECTION = DISTILL_PROJECTION  # training-only: checkpoint.state.exported leaves it out of model.pt


def attach_projection(backbone: nn.Module, student_dim: int, teacher_dim: int, seed: int) -> nn.Linear:
    """A learned student_dim -> teacher_dim map for the cosine loss, registered on the backbone
    as `distill_projection`: the data-parallel optimizer (ZeRO-2 or DDP) averages and steps it,
    the EMA, the checkpoint and resume at any W carry it by name like any backbone parameter,
    and model.pt leaves it out. Drawn from `seed` alone: the same on every rank and every W."""
    proj = nn.Linear(student_dim, teacher_dim, bias=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(teacher_dim, student_dim, generator=g) / student_dim**0.5)
    p = next(backbone.parameters())
    backbone.add_module(PROJECTION, proj.to(device=p.device))
    return proj


class DistillLoss:
    """`loss(head, local_embeddings, labels, teacher)`: the margin head's loss (when there is
    a head) plus `weight` x the distillation term, for this rank's batch; `teacher`: b x D_t
    targets of the rank's rows (no gradient), centred on `center` (the teacher's mean unit
    target over the training data; None: as given) before the loss. Call on every rank (the
    head and relational gather). The terms since the last `take_term()` are kept on the device
    for the log."""

    def __init__(
        self,
        kind: str,
        weight: float,
        projection: nn.Module | None = None,
        group=None,
        center: torch.Tensor | None = None,
    ):
        if kind not in DISTILL_LOSSES:
            raise ValueError(f"distill_loss must be one of {DISTILL_LOSSES}, got {kind!r}")
        self.kind = kind
        self.weight = weight
        self.projection = projection
        self.group = group
        self.center = center
        self.world_size, self.rank = get_world_size(group), get_rank(group)
        self._terms: torch.Tensor | None = None
        self._count = 0

    def take_term(self) -> float | None:
        """The mean unweighted term since the last call (reads the device), or None."""
        if self._terms is None:
            return None
        value = self._terms
        self._terms = None
        count = self._count
        self._count = 0
        return float(value) / count

    def term(self, local: torch.Tensor, teacher: torch.Tensor, gathered: torch.Tensor | None) -> torch.Tensor:
        """The distillation term alone (unweighted), scaled as the module docstring says."""
        teacher = centred(teacher.detach().float(), self.center)
        if self.kind == "cosine":
            student = self.projection(local.float()) if self.projection is not None else local
            return cosine_distill(student, teacher)
        b = local.shape[0]
        if gathered.shape[0] != b * self.world_size:  # its rows are sliced by rank as if every b were equal
            raise ValueError(
                f"relational distillation: {gathered.shape[0]} gathered rows are not "
                f"{self.world_size} ranks x this rank's {b}: every rank needs the same batch size"
            )
        rows = gathered[self.rank * b : (self.rank + 1) * b]
        value = relational_distill(
            rows, gathered, teacher, all_gather_no_grad(teacher.contiguous(), self.group)
        )
        share = 1.0 / self.world_size
        return value * share + value.detach() * (1.0 - share)

    def __call__(
        self, head, local: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor
    ) -> torch.Tensor:
        gathered = None
        if self.kind == "relational":  # the head's one all-gather serves both
            gathered = (
                head.gather(local)
                if head is not None
                else all_gather_rows(local, self.group, grad_scale=float(self.world_size))
            )
        term = self.term(local, teacher, gathered)
        self._terms = term.detach() if self._terms is None else self._terms + term.detach()
        self._count += 1
        loss = self.weight * term
        if head is not None:
            loss = head(local, labels, gathered=gathered) + loss
        return loss

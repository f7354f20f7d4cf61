"""Sub-center ArcFace (Deng et al., ECCV 2020): k centres per class, the closest one counts."""

from __future__ import annotations

import torch

from shardface.losses.margin import CombinedMarginLoss


class SubCenterArcFace(CombinedMarginLoss):
    """k weight rows per class, class-major (rows [c*k, (c+1)*k) of a shard are class c, so
    a class's centres never straddle ranks or tiles); a class's cosine is the max over its
    centres; ArcFace's additive angular margin on the target."""

    def __init__(self, s: float = 64.0, margin: float = 0.5, k: int = 3):
        super().__init__(s, 1.0, margin, 0.0)
        if k < 1:
            raise ValueError(f"sub-centres per class must be >= 1, got k={k}")
        self.subcenters = int(k)

    def extra_repr(self) -> str:
        return f"s={self.s}, margin={self.m2}, k={self.subcenters}"


@torch.no_grad()
def dominant_subcenters(
    weight: torch.Tensor, embeddings: torch.Tensor, labels: torch.Tensor, k: int
) -> torch.Tensor:
    """For each class, the sub-centre (0..k-1) nearest to most of its training images (the
    paper's dominant sub-centre); classes without images keep centre 0."""
    num_classes = weight.shape[0] // k
    w = torch.nn.functional.normalize(weight.float(), dim=1).view(num_classes, k, -1)
    e = torch.nn.functional.normalize(embeddings.float(), dim=1)
    nearest = torch.einsum("bd,bkd->bk", e, w[labels]).argmax(1)
    votes = torch.zeros(num_classes, k, dtype=torch.long)
    votes.index_put_((labels, nearest), torch.ones_like(labels), accumulate=True)
    return votes.argmax(1)


@torch.no_grad()
def drop_subcenters(weight: torch.Tensor, dominant: torch.Tensor, k: int) -> torch.Tensor:
    """The C x D weight that keeps only each class's dominant sub-centre (C*k x D in)."""
    num_classes = weight.shape[0] // k
    return weight.view(num_classes, k, -1)[torch.arange(num_classes), dominant].clone()


@torch.no_grad()
def far_from_dominant(
    weight: torch.Tensor,
    dominant: torch.Tensor,
    embeddings: torch.Tensor,
    labels: torch.Tensor,
    k: int,
    max_degrees: float = 75.0,
) -> torch.Tensor:
    """Indices of images whose angle to their class's dominant centre exceeds `max_degrees`:
    the paper drops them as label noise before retraining."""
    centres = torch.nn.functional.normalize(drop_subcenters(weight, dominant, k).float(), dim=1)
    e = torch.nn.functional.normalize(embeddings.float(), dim=1)
    cos = (e * centres[labels]).sum(1).clamp(-1.0, 1.0)
    return torch.nonzero(torch.rad2deg(torch.acos(cos)) > max_degrees).flatten()

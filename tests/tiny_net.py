"""The tiny two-dtype model, its per-step data and loss, shared by the ZeRO-2 and EMA tests."""

import torch
from torch import nn

GLOBAL_BATCH = 12
TINY_BUCKET_MB = 40 * 4 / 2**20  # ~40 fp32 elements: many buckets, shards straddle params


class TwoDtypeNet(nn.Module):
    """7*13+13+13+13*5+5 = 187 fp32 elements (not divisible by 2 or 3) plus an fp64 vector."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin1 = nn.Linear(7, 13)
        self.act = nn.PReLU(13)
        self.lin2 = nn.Linear(13, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5, dtype=torch.float64))

    def forward(self, x):
        return self.lin2(self.act(self.lin1(x))) * self.scale.float()


def step_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (inputs, targets) of `step`, the same on every rank and process."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 5, generator=g)


def mse_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (model(x) - y).square().mean()

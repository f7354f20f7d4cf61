"""A plain 4-stage CNN (16 -> 128 channels) for the CPU demo and tests; still 112x112 input."""

from __future__ import annotations

import torch
from torch import nn

from shardface.backbones.common import run_layers, trunk_autocast
from shardface.backbones.registry import register_model


def _stage(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.PReLU(cout),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.PReLU(cout),
    )


@register_model("tiny")
class TinyCNN(nn.Module):
    def __init__(
        self,
        num_features: int = 512,
        widths=(16, 32, 64, 128),
        dropout: float = 0.0,
        fp16: bool = False,
        bf16: bool = False,
        grad_checkpoint: bool = False,
    ):
        super().__init__()
        self.fp16, self.bf16, self.grad_checkpoint = fp16, bf16, grad_checkpoint
        chans = (3,) + tuple(widths)
        self.body = nn.Sequential(*[_stage(a, b) for a, b in zip(chans[:-1], chans[1:])])
        self.bn2 = nn.BatchNorm2d(widths[-1])
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(widths[-1] * 7 * 7, num_features)
        self.features = nn.BatchNorm1d(num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with trunk_autocast(x, self.fp16, self.bf16):
            x = torch.flatten(self.bn2(run_layers(self.body, x, self.grad_checkpoint)), 1)
        return self.features(self.fc(self.dropout(x.to(self.fc.weight.dtype))))

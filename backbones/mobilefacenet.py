"""MobileFaceNet ("mbf"), parameter-compatible with insightface arcface_torch."""

from __future__ import annotations

import torch
from torch import nn

from shardface.backbones.common import run_layers, trunk_autocast
from shardface.backbones.registry import register_model


class ConvBlock(nn.Module):
    def __init__(self, cin, cout, kernel=(1, 1), stride=(1, 1), padding=(0, 0), groups=1):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(cin, cout, kernel, groups=groups, stride=stride, padding=padding, bias=False),
            nn.BatchNorm2d(cout),
            nn.PReLU(cout),
        )

    def forward(self, x):
        return self.layers(x)


class LinearBlock(nn.Module):
    def __init__(self, cin, cout, kernel=(1, 1), stride=(1, 1), padding=(0, 0), groups=1):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(cin, cout, kernel, stride, padding, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
        )

    def forward(self, x):
        return self.layers(x)


class DepthWise(nn.Module):
    def __init__(self, cin, cout, residual=False, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=1):
        super().__init__()
        self.residual = residual
        self.layers = nn.Sequential(
            ConvBlock(cin, groups, kernel=(1, 1), padding=(0, 0), stride=(1, 1)),
            ConvBlock(groups, groups, groups=groups, kernel=kernel, padding=padding, stride=stride),
            LinearBlock(groups, cout, kernel=(1, 1), padding=(0, 0), stride=(1, 1)),
        )

    def forward(self, x):
        out = self.layers(x)
        return x + out if self.residual else out


class Residual(nn.Module):
    def __init__(self, c, num_block, groups, kernel=(3, 3), stride=(1, 1), padding=(1, 1)):
        super().__init__()
        self.layers = nn.Sequential(
            *[DepthWise(c, c, True, kernel, stride, padding, groups) for _ in range(num_block)]
        )

    def forward(self, x):
        return self.layers(x)


class GDC(nn.Module):
    def __init__(self, embedding_size):
        super().__init__()
        self.layers = nn.Sequential(
            LinearBlock(512, 512, groups=512, kernel=(7, 7), stride=(1, 1), padding=(0, 0)),
            nn.Flatten(),
            nn.Linear(512, embedding_size, bias=False),
            nn.BatchNorm1d(embedding_size),
        )

    def forward(self, x):
        return self.layers(x)


class MobileFaceNet(nn.Module):
    def __init__(
        self,
        num_features: int = 512,
        blocks=(1, 4, 6, 2),
        scale: int = 2,
        fp16: bool = False,
        bf16: bool = False,
        grad_checkpoint: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        if dropout:
            raise ValueError(
                f"dropout {dropout}: MobileFaceNet has no dropout layer (as arcface_torch's); set dropout 0"
            )
        self.fp16, self.bf16, self.grad_checkpoint = fp16, bf16, grad_checkpoint
        c1, c2 = 64 * scale, 128 * scale
        self.layers = nn.ModuleList([ConvBlock(3, c1, kernel=(3, 3), stride=(2, 2), padding=(1, 1))])
        if blocks[0] == 1:
            self.layers.append(ConvBlock(c1, c1, kernel=(3, 3), stride=(1, 1), padding=(1, 1), groups=64))
        else:
            self.layers.append(Residual(c1, num_block=blocks[0], groups=128))
        self.layers.extend(
            [
                DepthWise(c1, c1, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=128),
                Residual(c1, num_block=blocks[1], groups=128),
                DepthWise(c1, c2, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=256),
                Residual(c2, num_block=blocks[2], groups=256),
                DepthWise(c2, c2, kernel=(3, 3), stride=(2, 2), padding=(1, 1), groups=512),
                Residual(c2, num_block=blocks[3], groups=256),
            ]
        )
        self.conv_sep = ConvBlock(c2, 512, kernel=(1, 1), stride=(1, 1), padding=(0, 0))
        self.features = GDC(num_features)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                if m.bias is not None:
                    m.bias.data.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with trunk_autocast(x, self.fp16, self.bf16):
            x = run_layers(nn.Sequential(*self.layers), x, self.grad_checkpoint)
        x = self.conv_sep(x.to(self.conv_sep.layers[0].weight.dtype))
        return self.features(x)


@register_model("mbf")
def mbf(**kw) -> MobileFaceNet:
    return MobileFaceNet(**kw)


@register_model("mbf_large")
def mbf_large(**kw) -> MobileFaceNet:
    return MobileFaceNet(blocks=(2, 8, 12, 4), scale=4, **kw)

"""IResNet (r18 … r200, r2060). Parameter names, shapes and order equal insightface
arcface_torch's, so its published checkpoints load with `load_state_dict(strict=True)`."""

from __future__ import annotations

import torch
from torch import nn

from shardface.backbones.common import run_layers, run_segments, trunk_autocast
from shardface.backbones.registry import register_model


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


class IBasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(inplanes, eps=1e-05)
        self.conv1 = conv3x3(inplanes, planes)
        self.bn2 = nn.BatchNorm2d(planes, eps=1e-05)
        self.prelu = nn.PReLU(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn3 = nn.BatchNorm2d(planes, eps=1e-05)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.bn3(self.conv2(self.prelu(self.bn2(self.conv1(self.bn1(x))))))
        return out + identity


class IResNet(nn.Module):
    fc_scale = 7 * 7

    def __init__(
        self,
        layers,
        dropout: float = 0.0,
        num_features: int = 512,
        fp16: bool = False,
        bf16: bool = False,
        grad_checkpoint: bool = False,
        segments: tuple[int, int, int, int] | None = None,
    ):
        super().__init__()
        self.fp16, self.bf16, self.grad_checkpoint = fp16, bf16, grad_checkpoint
        # per stage: checkpoint in this many segments in training whatever grad_checkpoint says
        self.segments = segments or (0, 0, 0, 0)
        self.inplanes = 64
        self.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(64, eps=1e-05)
        self.prelu = nn.PReLU(64)
        self.layer1 = self._make_layer(64, layers[0])
        self.layer2 = self._make_layer(128, layers[1])
        self.layer3 = self._make_layer(256, layers[2])
        self.layer4 = self._make_layer(512, layers[3])
        self.bn2 = nn.BatchNorm2d(512, eps=1e-05)
        self.dropout = nn.Dropout(p=dropout, inplace=True)
        self.fc = nn.Linear(512 * self.fc_scale, num_features)
        self.features = nn.BatchNorm1d(num_features, eps=1e-05)
        nn.init.constant_(self.features.weight, 1.0)
        self.features.weight.requires_grad = False  # as arcface_torch: a fixed-scale feature BN
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, 0, 0.1)
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, planes: int, blocks: int) -> nn.Sequential:
        downsample = nn.Sequential(
            nn.Conv2d(self.inplanes, planes, 1, stride=2, bias=False),
            nn.BatchNorm2d(planes, eps=1e-05),
        )
        layers = [IBasicBlock(self.inplanes, planes, 2, downsample)]
        self.inplanes = planes
        layers += [IBasicBlock(planes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with trunk_autocast(x, self.fp16, self.bf16):
            x = self.prelu(self.bn1(self.conv1(x)))
            for layer, segments in zip((self.layer1, self.layer2, self.layer3, self.layer4), self.segments):
                if segments and self.training:
                    x = run_segments(layer, x, segments)
                else:
                    x = run_layers(layer, x, self.grad_checkpoint)
            x = torch.flatten(self.bn2(x), 1)
            x = self.dropout(x)
        return self.features(self.fc(x.to(self.fc.weight.dtype)))


DEPTHS = {
    "r18": (2, 2, 2, 2),
    "r34": (3, 4, 6, 3),
    "r50": (3, 4, 14, 3),
    "r100": (3, 13, 30, 3),
    "r200": (6, 26, 60, 6),
}


def _register(name: str, layers: tuple[int, int, int, int]) -> None:
    register_model(name)(lambda **kw: IResNet(layers, **kw))


for _name, _layers in DEPTHS.items():
    _register(_name, _layers)


@register_model("r2060")
def r2060(**kw) -> IResNet:
    """arcface_torch's 2060-layer IResNet; like there, its two deep stages always train
    checkpointed in segments (20 of stage 2's 128 blocks, 100 of stage 3's 896)."""
    return IResNet((3, 128, 896, 3), segments=(0, 20, 100, 0), **kw)

"""dlib's face descriptor network (dlib_face_recognition_resnet_model_v1, as its
dnn_face_recognition_ex.cpp defines it) in torch: a 29-convolution ResNet on a 150x150 chip,
128-D, with per-channel affine layers where training had batch norm.

Its geometry is dlib's, not torchvision's: convolutions of stride 2 and the pools have no
padding, and a down-sampling block adds its 2x2 average-pooled input to the block's output
top-left aligned, zero where one is smaller (channels or pixels), as dlib's add_prev does.
The weights come from dlib's file through checkpoint.dlib_format (MODEL `dlib`).

Input, as every ShardFace module: RGB in [-1, 1]; inside, dlib's own scaling
(pixel - mean) / 256 with the means its file carries. `input_size=150` takes dlib's chips;
`input_size=112` (the registered `dlib_resnet`, for training on insightface's 112x112 crops)
first re-frames the crop onto dlib's chip by a fixed similarity warp (`FRONT_112_TO_150`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shardface.backbones.common import trunk_autocast
from shardface.backbones.registry import register_model

CHIP_SIZE = 150
# dlib's input_rgb_image_sized defaults (its file carries the values; these are they)
PIXEL_MEAN = (122.782, 117.001, 104.298)
# The affine_grid matrix (output grid -> input grid, align_corners=False) that re-frames an
# insightface 112x112 crop onto dlib's 150x150 chip: faces.dlib_chip.DLIB_150 against
# faces.align.ARCFACE_112, written here because backbones sit below faces (tests/test_dlib.py
# checks it equals infer.model.Model.reframe's warp between those two templates).
FRONT_112_TO_150 = ((0.9201470421, 0.0051075324, 0.0153296223), (-0.0051075324, 0.9201470421, 0.2847230046))


class Affine(nn.Module):
    """y = weight * x + bias per channel (dlib's affine_, frozen batch norm)."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.view(1, -1, 1, 1) + self.bias.view(1, -1, 1, 1)


def add_prev(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """dlib's add_prev: the sum over the larger of the two shapes, each input zero outside itself."""
    c, h, w = (max(a.shape[i], b.shape[i]) for i in (1, 2, 3))
    pad = lambda t: F.pad(t, (0, w - t.shape[3], 0, h - t.shape[2], 0, c - t.shape[1]))  # noqa: E731
    return pad(a) + pad(b)


class Block(nn.Module):
    """conv 3x3 (stride 1, or 2 without padding) -> affine -> relu -> conv 3x3 -> affine, plus the
    input (2x2 average-pooled when down-sampling), then relu."""

    def __init__(self, cin: int, cout: int, down: bool):
        super().__init__()
        self.down = down
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=2 if down else 1, padding=0 if down else 1)
        self.affine1 = Affine(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.affine2 = Affine(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.affine2(self.conv2(F.relu(self.affine1(self.conv1(x)))))
        return F.relu(add_prev(y, F.avg_pool2d(x, 2, 2) if self.down else x))


# (channels, down-sampling) of each block, input to output (dlib's alevel4 .. alevel0)
BLOCKS = (
    [(32, False)] * 3
    + [(64, True)]
    + [(64, False)] * 3
    + [(128, True)]
    + [(128, False)] * 2
    + [(256, True)]
    + [(256, False)] * 2
    + [(256, True)]
)


class DlibResNet(nn.Module):
    def __init__(
        self,
        num_features: int = 128,
        input_size: int = CHIP_SIZE,
        dropout: float = 0.0,
        fp16: bool = False,
        bf16: bool = False,
        grad_checkpoint: bool = False,
    ):
        super().__init__()
        if input_size not in (112, CHIP_SIZE):
            raise ValueError(
                f"dlib_resnet: input_size {input_size} (112: insightface crops; 150: dlib chips)"
            )
        self.input_size = input_size
        self.fp16 = fp16
        self.bf16 = bf16
        self.grad_checkpoint = grad_checkpoint
        self.register_buffer("pixel_mean", torch.tensor(PIXEL_MEAN))
        # the 112 -> 150 warp, made once and moved with the module: a tensor built from the
        # constants in each forward is a copy from host memory that waits for the device
        self.register_buffer("front_theta", torch.tensor(FRONT_112_TO_150)[None], persistent=False)
        self.conv = nn.Conv2d(3, 32, 7, stride=2)
        self.affine = Affine(32)
        blocks, cin = [], 32
        for cout, down in BLOCKS:
            blocks.append(Block(cin, cout, down))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(cin, num_features, bias=False)

    def dlib_layers(self) -> list[tuple[str, nn.Module]]:
        """The learned layers in the order dlib's file holds them: ("con" | "affine" | "fc", module)."""
        out = [("con", self.conv), ("affine", self.affine)]
        for b in self.blocks:
            out += [("con", b.conv1), ("affine", b.affine1), ("con", b.conv2), ("affine", b.affine2)]
        return out + [("fc", self.fc)]

    def chip(self, x: torch.Tensor) -> torch.Tensor:
        """[-1, 1] input -> dlib's scaled 150x150 chip (re-framed when the input is a 112 crop)."""
        if self.input_size != CHIP_SIZE:
            # one grid for every image: x.shape[0], not len(x), so an ONNX trace keeps the batch dynamic
            grid = F.affine_grid(
                self.front_theta.to(x.dtype), [1, 3, CHIP_SIZE, CHIP_SIZE], align_corners=False
            )
            grid = grid.expand(x.shape[0], -1, -1, -1)
            # outside the crop is black, as alignment leaves it: -1 in [-1, 1]
            x = F.grid_sample(x + 1, grid, mode="bilinear", padding_mode="zeros", align_corners=False) - 1
        return (x * 127.5 + 127.5 - self.pixel_mean.view(1, 3, 1, 1)) / 256

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.chip(x.float())
        with trunk_autocast(x, self.fp16, self.bf16):
            x = F.max_pool2d(F.relu(self.affine(self.conv(x))), 3, 2)
            if self.grad_checkpoint and torch.is_grad_enabled():
                for block in self.blocks:
                    x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = self.blocks(x)
            x = x.mean(dim=(2, 3))
        return self.fc(self.dropout(x.float()))


@register_model("dlib_resnet")
def dlib_resnet(**kwargs) -> DlibResNet:
    """dlib's face descriptor network fed insightface 112x112 crops (init_backbone `dlib` loads dlib's weights)."""
    return DlibResNet(input_size=kwargs.pop("input_size", 112), **kwargs)

"""A tiny ResNet in plain torch (torchvision breaks next to CPU torch here), laid out as torchvision's: a stem (conv,
batch norm, ReLU, max pool), four stages `layer1`..`layer4` of residual blocks, the first block of stages 2..4
halving the resolution and widening the channels through a 1x1 projection shortcut, then global average pooling and
a linear classifier.

Normalization is GroupNorm by default (`NORM = "group"`): BatchNorm (`NORM = "batch"`, torchvision's choice)
normalizes over each microbatch, so a pipelined step cannot equal the whole-batch reference that `autopp run`
validates against, and its running statistics are buffers that every forward rewrites.

Units are found without SPLIT_POINTS: the blocks are spread over four Sequential containers, so each block of each
stage is a unit (the stem is the first unit; pooling and the classifier the last). `BLOCK = "bottleneck"` swaps the
basic blocks for ResNet-50-style bottlenecks.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

IMAGE = 64
CHANNELS = 3
WIDTH = 8
DEPTHS = (2, 2, 2, 2)
CLASSES = 10
BLOCK = "basic"
NORM = "group"


class BasicBlock(nn.Module):
    """Two 3x3 convolutions in a residual; a 1x1 projection shortcut when the shape changes."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = _norm(planes)
        self.downsample = _shortcut(inplanes, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand by 4, in a residual."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = _norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = _norm(planes * 4)
        self.downsample = _shortcut(inplanes, planes * 4, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (self.downsample(x) if self.downsample is not None else x))


def _norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if NORM == "batch" else nn.GroupNorm(min(4, channels), channels)


def _shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride=stride, bias=False), _norm(outplanes))


class ResNet(nn.Module):
    """Images (B, C, H, W) to class logits (B, CLASSES)."""

    def __init__(self, block: type[BasicBlock] | type[Bottleneck] = BasicBlock,
                 depths: tuple[int, ...] = DEPTHS, width: int = WIDTH) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(CHANNELS, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = _norm(width)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = width
        for i, depth in enumerate(depths):
            planes, stride = width * 2 ** i, 1 if i == 0 else 2
            blocks = [block(inplanes, planes, stride)]
            inplanes = planes * block.expansion
            blocks += [block(inplanes, planes) for _ in range(depth - 1)]
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(images))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build_model() -> nn.Module:
    return ResNet(Bottleneck if BLOCK == "bottleneck" else BasicBlock)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)

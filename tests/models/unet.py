"""A small U-Net with long skips: each encoder level's output is read again by the decoder level of the same
resolution, so on 4 ranks the outermost skip goes from the first stage to the last, skipping every stage between.

Units (SPLIT_POINTS): the stem, three encoder levels, three decoder levels and the head (8 units, enough for 2
stages per rank on 4 ranks); the skips are relayed through the stages between (they depend on the input, so they
cannot be recomputed locally).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

CHANNELS = 4
SIZE = 16


class Down(nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(F.max_pool2d(x, 2)))


class Up(nn.Module):
    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in + c_skip, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return F.relu(self.conv(torch.cat([x, skip], dim=1)))


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        c = CHANNELS
        self.stem = nn.Conv2d(1, c, 3, padding=1)
        self.down1 = Down(c, 2 * c)
        self.down2 = Down(2 * c, 4 * c)
        self.down3 = Down(4 * c, 4 * c)
        self.up3 = Up(4 * c, 4 * c, 4 * c)
        self.up2 = Up(4 * c, 2 * c, 2 * c)
        self.up1 = Up(2 * c, c, c)
        self.head = nn.Conv2d(c, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s0 = F.relu(self.stem(x))
        s1 = self.down1(s0)
        s2 = self.down2(s1)
        h = self.up3(self.down3(s2), s2)
        h = self.up2(h, s1)
        h = self.up1(h, s0)
        return self.head(h) + x


SPLIT_POINTS = ["down1", "down2", "down3", "up3", "up2", "up1", "head"]


def build_model() -> nn.Module:
    return UNet()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(batch_size, 1, SIZE, SIZE)
    return x, torch.tanh(x)

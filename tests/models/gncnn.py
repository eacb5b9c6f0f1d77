"""A small residual CNN normalized with GroupNorm (issue 26, point 11): a stem, four residual blocks in `blocks`, a
pooled linear head; lr 0.01 SGD over 30 steps moves it far enough that a free-running reference drifted past the loss
tolerance at step 7 while each step agreed to rounding. `NORM = "batch"` (tests/models/bncnn.py) swaps in BatchNorm,
whose statistics are per microbatch."""

import torch
from torch import nn
from torch.nn import functional as F

NORM = "group"
WIDTH = 8
CLASSES = 10


def _norm(channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if NORM == "batch" else nn.GroupNorm(4, channels)


class Block(nn.Module):
    """Two 3x3 convolutions, each normalized, in a residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = _norm(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = _norm(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(out)))


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, WIDTH, 3, padding=1, bias=False), _norm(WIDTH), nn.ReLU())
        self.blocks = nn.Sequential(*(Block(WIDTH) for _ in range(4)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return CNN()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 8, 8), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)

"""A small CNN with a long skip (issue 26, point 5): a stem, four convolution blocks in `blocks`, a pooled linear
head, and the stem's output added again after the last block. Its units look like a trainer's layer stack (embedding,
`blocks.0` .. `blocks.3`, head), but the skip is read three blocks later, which a GPT's layer-to-layer hidden state
cannot carry: the Megatron export must refuse it and say why."""

import torch
from torch import nn
from torch.nn import functional as F

WIDTH = 8
CLASSES = 10


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, WIDTH, 3, padding=1)
        self.blocks = nn.ModuleList(nn.Conv2d(WIDTH, WIDTH, 3, padding=1) for _ in range(4))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = F.relu(self.stem(x))
        h = skip
        for block in self.blocks:
            h = F.relu(block(h))
        return self.head((h + skip).mean(dim=(2, 3)))


def build_model() -> nn.Module:
    return CNN()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, 3, 8, 8), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)

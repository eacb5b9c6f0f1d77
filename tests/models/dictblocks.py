"""Blocks in an `nn.ModuleDict`, called in another order than they were inserted, and two parallel heads in a
second ModuleDict (both read the last block's output: not a chain, so not blocks). Without SPLIT_POINTS the units
are the stem, each block in call order (b2, b0, b3, b1), and the heads."""
import torch
from torch import nn

WIDTH = 8
ORDER = ["b2", "b0", "b3", "b1"]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.lin(x)


class DictBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleDict({f"b{i}": Block() for i in range(4)})
        self.heads = nn.ModuleDict({"mean": Head(), "scale": Head()})

    def forward(self, x):
        h = self.stem(x)
        for name in ORDER:
            h = self.blocks[name](h)
        return self.heads["mean"](h) * torch.sigmoid(self.heads["scale"](h))


def build_model():
    return DictBlocks()


def sample_batch(batch_size):
    return torch.randn(batch_size, 3, 4), torch.randn(batch_size, 3, 2)

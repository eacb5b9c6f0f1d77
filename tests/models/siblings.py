"""Blocks as sibling attributes (`self.block1` .. `self.block4`, no container), with two parallel heads of one class
(`head_mean`, `head_scale`: both read the last block's output, so they are not a chain of blocks). Without
SPLIT_POINTS the units are the stem, each block, and the heads."""
import torch
from torch import nn

WIDTH = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.lin(x)


class Siblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, WIDTH)
        self.block1 = Block()
        self.block2 = Block()
        self.block3 = Block()
        self.block4 = Block()
        self.head_mean = Head()
        self.head_scale = Head()

    def forward(self, x):
        h = self.stem(x)
        h = self.block1(h)
        h = self.block2(h)
        h = self.block3(h)
        h = self.block4(h)
        return self.head_mean(h) * torch.sigmoid(self.head_scale(h))


def build_model():
    return Siblings()


def sample_batch(batch_size):
    return torch.randn(batch_size, 3, 4), torch.randn(batch_size, 3, 2)

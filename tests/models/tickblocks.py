"""Identical blocks that take known times on the fake clock (tests/models/ticking.py's tick), between an input and
an output layer: the blocks are units of one structure and input shape, measured once and shared."""
import torch
from torch import nn

from tests.models.tick_op import tick
from tests.models.ticking import WIDTH

BLOCKS = 3
BLOCK_FORWARD_S = 0.010
BLOCK_BACKWARD_INPUT_S = 0.004
BLOCK_BACKWARD_WEIGHT_S = 0.003


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return tick(x, BLOCK_FORWARD_S, BLOCK_BACKWARD_INPUT_S) + tick(self.bias, 0.0, BLOCK_BACKWARD_WEIGHT_S)


class Model(nn.Module):
    """BLOCKS blocks between an input and an output Linear of `width` features (tests/models/tpticks.py passes its
    own block and width)."""

    def __init__(self, block=Block, width=WIDTH):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))
        self.out = nn.Linear(width, width)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build_model():
    return Model()


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)

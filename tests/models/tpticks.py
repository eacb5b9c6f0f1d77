"""Identical MLP blocks with a TP_PLAN (fc1 colwise, fc2 rowwise) whose times on the fake clock
(tests/models/fakeclock.py) are proportional to fc1's output features: TP rank 0's local shard at degree t takes
exactly 1/t of each block's time, so profiled TP rows are exact."""
import torch
from torch import nn

from tests.models import tickblocks
from tests.models.tick_op import tick

WIDTH = 8
HIDDEN = 32
BLOCKS = tickblocks.BLOCKS
BLOCK_FORWARD_S = 0.012
BLOCK_BACKWARD_S = 0.008

TP_PLAN = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        share = self.fc1.out_features / HIDDEN
        h = tick(self.fc1(x), BLOCK_FORWARD_S * share, BLOCK_BACKWARD_S * share)
        return x + self.fc2(torch.relu(h))


class Model(tickblocks.Model):
    def __init__(self):
        super().__init__(Block, WIDTH)


def build_model():
    return Model()


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)

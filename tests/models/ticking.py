"""Layers that take known times on a fake clock in forward, input-gradient and weight-gradient backward: exact
profiler tests (the profiler reads tests/models/fakeclock.py's CLOCK; nothing sleeps).

Each layer is `tick(x) + tick(bias)`: the gradient path to the input runs the first tick's backward (input time),
the path to the parameter runs the second's (weight time), so torch's stage_backward_input / stage_backward_weight
split them exactly and a full backward takes their sum.
"""
import torch
from torch import nn

from tests.models.tick_op import tick  # a normal import: the op is defined once however often this file loads

FORWARD_S = [0.004, 0.012, 0.008]
BACKWARD_INPUT_S = [0.002, 0.006, 0.001]
BACKWARD_WEIGHT_S = [0.004, 0.004, 0.001]
BACKWARD_S = [i + w for i, w in zip(BACKWARD_INPUT_S, BACKWARD_WEIGHT_S)]
WIDTH = 16



class TickLayer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return tick(x, FORWARD_S[self.i], BACKWARD_INPUT_S[self.i]) + tick(self.bias, 0.0, BACKWARD_WEIGHT_S[self.i])


def build_model():
    return nn.Sequential(*[TickLayer(i) for i in range(len(FORWARD_S))])


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)

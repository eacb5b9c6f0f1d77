"""Layers that sleep known times in forward, input-gradient and weight-gradient backward: exact profiler tests.

Each layer is `sleep(x) + sleep(bias)`: the gradient path to the input runs the first sleep's backward (input time),
the path to the parameter runs the second's (weight time), so torch's stage_backward_input / stage_backward_weight
split them exactly and a full backward takes their sum.
"""
import time
import torch
from torch import nn

FORWARD_S = [0.004, 0.012, 0.008]
BACKWARD_INPUT_S = [0.002, 0.006, 0.001]
BACKWARD_WEIGHT_S = [0.004, 0.004, 0.001]
BACKWARD_S = [i + w for i, w in zip(BACKWARD_INPUT_S, BACKWARD_WEIGHT_S)]
WIDTH = 16


@torch.library.custom_op("autopp_test::sleep", mutates_args=())
def sleep(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    time.sleep(forward_s)
    return x.clone()


@sleep.register_fake
def _(x, forward_s, backward_s):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return sleep(grad, ctx.backward_s, 0.0), None, None


def _setup(ctx, inputs, output):
    ctx.backward_s = inputs[2]


sleep.register_autograd(_backward, setup_context=_setup)


class SleepLayer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.bias = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return sleep(x, FORWARD_S[self.i], BACKWARD_INPUT_S[self.i]) + sleep(self.bias, 0.0, BACKWARD_WEIGHT_S[self.i])


def build_model():
    return nn.Sequential(*[SleepLayer(i) for i in range(len(FORWARD_S))])


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)

"""Layers that sleep a known time in forward and backward: profiler tests get exact expectations."""
import time
import torch
from torch import nn

FORWARD_S = [0.004, 0.012, 0.008]
BACKWARD_S = [0.006, 0.010, 0.002]
WIDTH = 16


@torch.library.custom_op("autopp_test::sleep", mutates_args=())
def sleep(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x.clone()


@sleep.register_fake
def _(x, seconds):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return sleep(grad, ctx.backward_s), None


def _setup(ctx, inputs, output):
    ctx.backward_s = BACKWARD_S[FORWARD_S.index(inputs[1])]


sleep.register_autograd(_backward, setup_context=_setup)


class SleepLayer(nn.Module):
    def __init__(self, i):
        super().__init__()
        self.i = i
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return sleep(self.lin(x), FORWARD_S[self.i])


def build_model():
    return nn.Sequential(*[SleepLayer(i) for i in range(len(FORWARD_S))])


def sample_batch(batch_size):
    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)

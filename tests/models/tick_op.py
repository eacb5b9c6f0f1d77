"""The custom op `autopp_test::tick`: an identity that advances the fake clock (tests/models/fakeclock.py) by a
known time in forward and in backward.

It lives in its own module, imported normally, because ticking.py is also loaded as a model file by path (a new
module object each time): defining the op there registered it again on every load, and when an earlier module was
collected its registration went with it, so the op lost its schema and later calls crashed the process (a
segmentation fault in the full suite, "schema_.has_value() INTERNAL ASSERT FAILED" in a smaller run), depending on
test order and garbage collection.
"""
import torch

from tests.models.fakeclock import CLOCK

__all__ = ["tick"]


@torch.library.custom_op("autopp_test::tick", mutates_args=())
def tick(x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
    CLOCK.advance(forward_s)
    return x.clone()


@tick.register_fake
def _(x, forward_s, backward_s):
    return torch.empty_like(x)


def _backward(ctx, grad):
    return tick(grad, ctx.backward_s, 0.0), None, None


def _setup(ctx, inputs, output):
    ctx.backward_s = inputs[2]


tick.register_autograd(_backward, setup_context=_setup)

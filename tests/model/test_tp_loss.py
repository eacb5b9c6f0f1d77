"""autopp.model.tp_loss: one rank's share of torch's loss_parallel cross-entropy, as the local shard's loss counts
it (its values and gradients are the plain cross-entropy's, its saved bytes the log-probabilities in the logits'
dtype), and a model whose output holds no logits of the shard's width refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from autopp.errors import TpPlanError
from autopp.model.tp_loss import LocalLoss, sharded_cross_entropy


def test_sharded_cross_entropy_is_the_cross_entropy_with_its_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 16, requires_grad=True)
    target = torch.randint(0, 16, (2, 5))
    got = sharded_cross_entropy(logits, target)
    (grad,) = torch.autograd.grad(got, logits)
    want = F.cross_entropy(logits.reshape(-1, 16), target.reshape(-1))
    (want_grad,) = torch.autograd.grad(want, logits)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(grad, want_grad, atol=1e-6)


def test_it_saves_the_log_probabilities_in_the_logits_dtype() -> None:
    """What autograd keeps: bfloat16 log-probabilities (2 bytes an element) and the targets; the float32 working
    copies torch's _log_softmax makes are freed in the forward."""
    logits = torch.randn(4, 32, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 32, (4,))
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        sharded_cross_entropy(logits, target)
    assert sorted(saved) == sorted([4 * 32 * 2, 4 * 8])


def test_the_local_loss_reads_the_shards_logits_and_maps_the_targets() -> None:
    """With the shard's rows set, the loss is the cross-entropy of the output's logits of that width (targets
    modulo the rows), whatever the model file's loss_fn; without them, the model file's loss_fn."""
    loss = LocalLoss(lambda out, target: out.sum() * 0)
    logits = torch.randn(2, 3, 8)
    target = torch.tensor([[1, 9, 17], [3, 4, 31]])
    assert float(loss(logits, target)) == 0.0  # rows unset: the model file's loss
    loss.rows = 8
    want = F.cross_entropy(logits.reshape(-1, 8), target.remainder(8).reshape(-1))
    assert torch.allclose(loss(logits, target), want)
    with pytest.raises(TpPlanError, match=r"^colwise_loss_parallel: the model's output holds no logits of 8 classes "
                                          r"\(the head's shard\) or its target is not one tensor of ids; name the "
                                          r"head colwise_gather_output in TP_PLAN$"):
        loss(torch.randn(2, 3, 16), target)

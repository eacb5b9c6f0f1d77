"""The loss of TP rank 0's local shard (autopp.model.tp.local_model_file), for measuring and counting it: the model
file's own, but with a `LOSS_PARALLEL` head, whose logits hold 1/t of the vocabulary, the cross-entropy torch's
`loss_parallel()` computes on one rank (torch/distributed/tensor/parallel/loss.py: `_log_softmax`,
`_nll_loss_forward`, `_nll_loss_and_log_softmax_backward`) without its collectives: float32 working copies of the
shard's logits in the forward (the maximum, the shifted logits, their exponentials), the log-probabilities saved in
the logits' dtype, and a backward that rebuilds the gradient from them. The values do not matter (targets are taken
modulo the shard's rows); the work and the bytes are the rank's."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ..errors import TpPlanError

__all__ = ["LocalLoss", "sharded_cross_entropy"]


class _ShardedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `logits` [tokens, rows] against `target` [tokens] (ids < rows), as one rank of torch's
    loss_parallel computes it (module docstring)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = logits.float()  # torch's _log_softmax: the computation dtype of a half / bfloat16 input
        shifted = x - x.amax(-1, keepdim=True)  # [all-reduce of the maximum]
        result = (shifted - shifted.exp().sum(-1, keepdim=True).log()).to(logits.dtype)  # [all-reduce of the sum]
        ctx.save_for_backward(result, target)
        return -result.gather(-1, target.unsqueeze(-1)).mean()  # [all-reduce of the target's log-probability]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        result, target = ctx.saved_tensors
        onehot = torch.zeros_like(result).scatter_(-1, target.unsqueeze(-1), -1.0)
        return (onehot + result.exp()) * (grad / target.numel()), None


def sharded_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One rank's loss_parallel cross-entropy of `logits` (class dimension last) against integer `target`."""
    out = _ShardedCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
    assert isinstance(out, torch.Tensor)
    return out


class LocalLoss:
    """The loss of TP rank 0's shard: the model file's `loss_fn`, or with a `LOSS_PARALLEL` head, whose logits hold
    the shard's `rows` of the vocabulary (set when the shard is built: autopp.model.tp.local_shard_of), the
    cross-entropy of those logits as one rank of torch's loss_parallel computes it (what the style means), the
    targets' ids taken modulo `rows`."""

    def __init__(self, loss_fn: Callable[[Any, Any], torch.Tensor]) -> None:
        self.loss_fn, self.rows = loss_fn, 0

    def __call__(self, output: Any, target: Any) -> torch.Tensor:
        if not self.rows:
            return self.loss_fn(output, target)
        found = getattr(output, "logits", None)
        leaves = [found] if isinstance(found, torch.Tensor) else pytree.tree_leaves(output)
        logits = next((x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()
                       and x.dim() >= 1 and x.shape[-1] == self.rows), None)
        ids = [x for x in pytree.tree_leaves(target) if isinstance(x, torch.Tensor) and not x.is_floating_point()]
        if logits is None or len(ids) != 1:
            raise TpPlanError(f"colwise_loss_parallel: the model's output holds no logits of {self.rows} classes (the "
                              f"head's shard) or its target is not one tensor of ids; name the head "
                              "colwise_gather_output in TP_PLAN")
        return sharded_cross_entropy(logits, ids[0].remainder(self.rows))

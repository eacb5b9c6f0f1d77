"""Context parallelism in `autopp run`: which plans it runs, each cp rank's share of a batch, and the rotary
positions of the pipeline pieces a cp rank exports.

A cp rank holds the head-tail pair of chunks of every sequence (rank r: chunks r and 2cp-1-r of 2cp, torch's
`_HeadTailLoadBalancer`, through `autopp.run.context.shard_sequence`). Its pieces are exported at s / cp tokens (the
shapes torch.export bakes in are the rank's own), and each rank's rotary embedding is told the positions of its own
tokens: a forward pre-hook replaces the `position_ids` the model makes (0 .. s/cp - 1) by a buffer holding the rank's
positions, so the rotary tables computed from it are values of buffers alone, which `autopp.run.chain` holds on
every stage that reads them (`constant_values`) as it does without cp. Attention is torch's ring over the cp group
(`autopp.run.context.ring_attention` around each step); the loss is each rank's mean over its tokens, and the
gradients are averaged over dp x cp (`Layout.sync`), as for data parallelism. docs/parallelism.md, "Context
parallelism", has what was checked.

Supported: HF causal LMs built from a config (`--hf-config`; `CAUSAL_ATTENTION`: SDPA with is_causal and no mask)
of the families in `CP_MODEL_TYPES`, whose positions enter through one rotary embedding module only; tp 1, ep 1, no
vocabulary parallelism, schedules that run each microbatch whole (not Chimera, not Seq1F1B). The rest is refused in
one line before any rank starts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data.plan import Plan
from ..errors import RunError
from ..model.hf import CAUSAL_ATTENTION
from ..data.runner_rules import CP_MODEL_TYPES, context_refusal, cp_refusal
from .context import RingConfig, shard_sequence

__all__ = ["CP_MODEL_TYPES", "POSITIONS", "check_context_plan", "check_context_model", "rotary_modules",
           "own_positions", "shard_batch"]

#: The buffer a rotary embedding module gets with the rank's positions (`own_positions`).
POSITIONS = "autopp_positions"


def _refuse(plan: Plan, why: str) -> RunError:
    return RunError(cp_refusal(plan, why))


def check_context_plan(plan: Plan) -> None:
    """Refuse, in one line, a plan with cp > 1 that the runner does not run (module docstring; `context_refusal`)."""
    if why := context_refusal(plan):
        raise RunError(why)


def rotary_modules(model: nn.Module) -> list[str]:
    """The names of the model's rotary embedding modules (those holding an `inv_freq` buffer)."""
    return [name for name, m in model.named_modules() if "inv_freq" in dict(m.named_buffers(recurse=False))]


def check_context_model(model: nn.Module, plan: Plan) -> None:
    """Refuse, in one line, a model (built, on any device) whose positions the runner cannot place per cp rank: a
    model type outside `CP_MODEL_TYPES`, attention other than `CAUSAL_ATTENTION`, or not exactly one rotary
    embedding."""
    if plan.layout.cp == 1:
        return
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", type(model).__name__)
    attention = getattr(config, "_attn_implementation", None)
    if kind not in CP_MODEL_TYPES or attention != CAUSAL_ATTENTION:
        raise _refuse(plan, f"autopp run runs context parallelism for {', '.join(CP_MODEL_TYPES)} causal LMs with "
                            f"{CAUSAL_ATTENTION} attention, not model_type {kind} with {attention} attention")
    rotary = rotary_modules(model)
    if len(rotary) != 1:
        raise _refuse(plan, f"autopp run places positions per cp rank through one rotary embedding module, and "
                            f"{kind} has {len(rotary)}")


def _positions_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`forward(x, position_ids)` with the module's `POSITIONS` buffer as `position_ids` (batch dimension as given)."""
    given = kwargs.get("position_ids", args[1] if len(args) > 1 else None)
    own = getattr(module, POSITIONS)
    positions = own.expand(given.shape[0], -1) if isinstance(given, torch.Tensor) else own
    if len(args) > 1:
        return (args[0], positions, *args[2:]), kwargs
    return args, {**kwargs, "position_ids": positions}


def own_positions(model: nn.Module, positions: torch.Tensor) -> None:
    """Make the model's rotary embedding (`check_context_model`: exactly one) compute its tables for `positions`
    (1-D: this cp rank's token positions, in the order of its shard) whatever `position_ids` it is given."""
    (name,) = rotary_modules(model)
    module = model.get_submodule(name)
    module.register_buffer(POSITIONS, positions.reshape(1, -1).to(torch.long), persistent=False)
    module.register_forward_pre_hook(_positions_hook, with_kwargs=True)


def shard_batch(values: tuple[Any, ...], config: RingConfig) -> tuple[Any, ...]:
    """This cp rank's share of every (batch, seq, ...) tensor of a causal LM's batch (token ids, targets), along
    dimension 1; other values as they are."""
    return tuple(shard_sequence(v, 1, config) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
                 for v in values)

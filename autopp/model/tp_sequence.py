"""One rank's local shard under sequence parallelism, for counting (and measuring) its compute: TP rank 0's shard
(autopp.model.tp.local_shard) whose residual stream holds 1/t of the sequence, as the runner runs it
(autopp.run.tensor_parallel, torchtitan's Llama plan; Korthikanti et al. 2022, arXiv:2205.05198, s.4.2.2), with
forward hooks standing in for the collectives (rank 0's share, no communication):

- a block (a module holding a sequence-wise module, the norms of `autopp.model.tp.sequence_modules`, and a module
  with colwise children) takes its first 1/t of the sequence (dimension 1, [batch, sequence, hidden]) when its
  input is whole (the first block: `PrepareModuleInput` Replicate() -> Shard(1)); later blocks read the previous
  one's shard;
- the modules with colwise children inside a block (attention, MLP) get their first input gathered to the whole
  sequence (`PrepareModuleInput` Shard(1) -> Replicate(), the all-gather: the shard repeated t times), and the
  rowwise projections inside them give their first 1/t of the sequence (`RowwiseParallel(output_layouts=Shard(1))`,
  the reduce-scatter);
- a colwise_gather_output or colwise_loss_parallel module (the LM head) gets its input gathered (the runner keeps
  the head's input whole).

So the norms, the residual adds and whatever else a block runs between its sharded modules run on 1/t of the
sequence, as they do under torch's `SequenceParallel`; the tensor-parallel rows without SP count them whole on
every rank (a property of DTensor TP without SP, docs/analytic.md). A gather counts one copy of the whole tensor
(the bytes an all-gather writes) and its backward a sum (a reduce-scatter's); a shard is a view, its backward a
copy into the whole gradient (an all-gather's)."""

from __future__ import annotations

import weakref
from dataclasses import replace
from functools import partial
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .contract import ModelFile
from ..data.tp_plan import LOSS_PARALLEL
from .tp import local_shard, local_shard_of
from .tp_loss import LocalLoss

__all__ = ["sequence_shard", "sequence_model_file"]

#: The residual stream's shards the blocks made, by id: weak, so a shard's id freed when it dies and recycled for a
#: whole tensor (the next forward's embedding output) is not taken for a shard (`_is_shard`).
_Marks = weakref.WeakValueDictionary[int, torch.Tensor]


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | str, torch.Tensor] | None:
    """Where a module's first tensor input is (position or keyword) and the tensor: the hidden states a HF block,
    attention or MLP reads first (`autopp.model.tp`'s rule for a planned module's input)."""
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    for k, v in kwargs.items():
        if isinstance(v, torch.Tensor):
            return k, v
    return None


def _replaced(args: tuple[Any, ...], kwargs: dict[str, Any], where: int | str, value: torch.Tensor
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(where, int):
        return (*args[:where], value, *args[where + 1:]), kwargs
    return args, {**kwargs, where: value}


def _is_shard(sharded: _Marks, x: torch.Tensor) -> bool:
    """Whether `x` is itself a shard a block made (its id alone may be a dead shard's, recycled)."""
    return sharded.get(id(x)) is x


def _shard_input(t: int, sharded: _Marks, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A block's pre-hook: its first input narrowed to 1/t of the sequence unless a block already sharded it."""
    found = _first_tensor(args, kwargs)
    if found is None or _is_shard(sharded, found[1]) or found[1].dim() < 3:
        return None
    where, x = found
    return _replaced(args, kwargs, where, x.narrow(1, 0, x.shape[1] // t))


def _mark(sharded: _Marks, _module: nn.Module, _args: Any, out: Any) -> None:
    """A block's hook: its output (or the first tensor of it) is the residual stream's shard."""
    first = out if isinstance(out, torch.Tensor) else next(
        (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.Tensor)), None)
    if first is not None:
        sharded[id(first)] = first


def _gather_input(t: int, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The all-gather's stand-in on a module's first input: the shard repeated t times along the sequence."""
    found = _first_tensor(args, kwargs)
    if found is None or found[1].dim() < 3:
        return None
    where, x = found
    return _replaced(args, kwargs, where, x.repeat(1, t, *([1] * (x.dim() - 2))))


def _shard_output(t: int, _module: nn.Module, _args: Any, out: torch.Tensor) -> torch.Tensor:
    """The reduce-scatter's stand-in on a rowwise output: its first 1/t of the sequence."""
    return out.narrow(1, 0, out.shape[1] // t) if out.dim() >= 3 else out


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def sequence_shard(model: nn.Module, resolved: Mapping[str, str], sequence: Sequence[str], t: int) -> nn.Module:
    """`model` (in place; returned) as TP rank 0's local shard at degree `t` (`local_shard`) computing under sequence
    parallelism (module docstring): the hooks go on the blocks (parents of a `sequence` module that hold a module
    with colwise children), those modules, their rowwise projections, and the colwise_gather_output modules."""
    return _sequence_hooks(local_shard(model, dict(resolved), t), resolved, sequence, t)


def _sequence_hooks(model: nn.Module, resolved: Mapping[str, str], sequence: Sequence[str], t: int) -> nn.Module:
    """`sequence_shard`'s hooks on `model`, already TP rank 0's local shard."""
    regions = {_parent(n) for n, s in resolved.items() if s == "colwise"}
    blocks = {b for b in (_parent(n) for n in sequence) if any(r.startswith(b + ".") for r in regions)}
    sharded: _Marks = _Marks()
    for name in blocks:
        block = model.get_submodule(name)
        block.register_forward_pre_hook(partial(_shard_input, t, sharded), with_kwargs=True)
        block.register_forward_hook(partial(_mark, sharded))
    inside = {r for r in regions if any(r.startswith(b + ".") for b in blocks)}
    for name in inside:
        model.get_submodule(name).register_forward_pre_hook(partial(_gather_input, t), with_kwargs=True)
    for name, style in resolved.items():
        if style == "rowwise" and _parent(name) in inside:
            model.get_submodule(name).register_forward_hook(partial(_shard_output, t))
        elif style in ("colwise_gather_output", LOSS_PARALLEL):
            model.get_submodule(name).register_forward_pre_hook(partial(_gather_input, t), with_kwargs=True)
    return model


def _build(mf: ModelFile, resolved: Mapping[str, str], sequence: Sequence[str], t: int, loss: LocalLoss
           ) -> nn.Module:
    return _sequence_hooks(local_shard_of(mf, resolved, t, loss), resolved, sequence, t)


def sequence_model_file(mf: ModelFile, resolved: Mapping[str, str], sequence: Sequence[str], t: int) -> ModelFile:
    """`mf` whose build_model() gives the local shard at degree `t` under sequence parallelism (`sequence_shard`),
    counted like any model file; its units are the model's."""
    loss = LocalLoss(mf.loss_fn)
    return replace(mf, build_model=partial(_build, mf, resolved, tuple(sequence), t, loss), loss_fn=loss)

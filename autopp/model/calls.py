"""One forward pass of a model seen from every module: when each is called, how often, and which autograd nodes
its first call reads and returns (to tell a chain of blocks from parallel branches)."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["Calls", "record_calls", "reads"]


@dataclass(frozen=True)
class Calls:
    """One forward pass seen from every module: the positions of its first and last call among all module calls, how
    often it is called, and the autograd nodes of its first call's input and output tensors (to tell a chain of
    blocks from parallel branches). Keyed by module; `ids` maps every name of a module (aliases too) to its key."""

    ids: dict[str, int]
    first: dict[int, int]
    last: dict[int, int]
    count: dict[int, int]
    inputs: dict[int, frozenset[Any]]
    outputs: dict[int, frozenset[Any]]

    def times(self, name: str) -> int:
        """How often forward calls module `name`."""
        return self.count.get(self.ids[name], 0)

    def order(self, names: list[str]) -> list[str]:
        """The modules `names` that forward calls, in first-call order (names of one module in the order given)."""
        called = [n for n in names if self.ids[n] in self.first]
        return sorted(called, key=lambda n: self.first[self.ids[n]])


def _grad_nodes(value: Any) -> frozenset[Any]:
    """The autograd nodes that produced the tensors in `value` (any nesting of tuples, lists, dicts)."""
    leaves = pytree.tree_leaves(value)
    return frozenset(t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None)


@contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Run a pass that leaves the model's buffers (BatchNorm statistics) and torch's random state as they were."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def record_calls(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Calls:
    """Run forward once with autograd on (buffers and random state kept), recording every module's calls."""
    ids = {name: id(module) for name, module in model.named_modules(remove_duplicate=False)}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    ins: dict[int, frozenset[Any]] = {}
    outs: dict[int, frozenset[Any]] = {}
    ticket = itertools.count()

    def before(module: nn.Module, args: Any, kwargs: Any) -> None:
        key, position = id(module), next(ticket)
        count[key], last[key] = count.get(key, 0) + 1, position
        if key not in first:
            first[key], ins[key] = position, _grad_nodes((args, kwargs))

    def after(module: nn.Module, _args: Any, _kwargs: Any, output: Any) -> None:
        outs.setdefault(id(module), _grad_nodes(output))

    handles = []
    for module in model.modules():
        handles += [module.register_forward_pre_hook(before, with_kwargs=True),
                    module.register_forward_hook(after, with_kwargs=True)]
    try:
        with _state_kept(model), torch.enable_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return Calls(ids, first, last, count, ins, outs)


def reads(calls: Calls, later: str, earlier: str) -> bool:
    """Whether the first call of `later` reads, through any operations, what the first call of `earlier` returned:
    a walk back through the autograd graph from `later`'s inputs, pruned at nodes created before `earlier`'s outputs
    (autograd numbers its nodes in creation order), so that each test costs what runs between the two calls."""
    targets = calls.outputs.get(calls.ids[earlier], frozenset())
    if not targets:
        return False
    floor = min(node._sequence_nr() for node in targets)
    stack, seen = list(calls.inputs.get(calls.ids[later], ())), set()
    while stack:
        node = stack.pop()
        if node in targets:
            return True
        if node not in seen and node._sequence_nr() >= floor:
            seen.add(node)
            stack.extend(n for n, _ in node.next_functions if n is not None)
    return False


"""Discover a model's units, the ordered places a stage may begin: SPLIT_POINTS if the model file gives them, else the
children of a Sequential or the blocks of its block groups (README, "Without SPLIT_POINTS")."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, TypeVar

from torch import nn

from .calls import Calls, reads, record_calls
from .contract import ModelFile, describe_error
from .fake import on_meta, run_fake

__all__ = ["Unit", "discover_units", "fingerprint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Unit:
    """One split candidate: a stage may begin before `split_point` (None for the first unit)."""

    index: int
    name: str
    split_point: str | None
    modules: tuple[str, ...]


_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class _Group:
    """Sibling modules of one class that may be blocks: all children of a block container (a ModuleList,
    Sequential or ModuleDict of one class), or the children of one class of any module (`block1`, `block2`, ...)."""

    parent: str
    members: tuple[str, ...]
    container: bool
    blocks: tuple[str, ...] = ()
    """The members that are blocks, in call order (`_chained`)."""


def _child(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _inside(name: str, outer: str) -> bool:
    """Whether module `name` is `outer` or lies inside it."""
    return name == outer or name.startswith(outer + ".")


def _block_like(module: nn.Module) -> bool:
    """Whether a sibling `module` can be a block: anything but a single torch.nn layer without submodules (a Linear
    or LayerNorm is a part of a block, as `fc1`/`fc2` or `ln_1`/`ln_2` inside one)."""
    return next(module.children(), None) is not None or not type(module).__module__.startswith("torch.nn.")


def _candidate_groups(modules: dict[str, nn.Module]) -> list[_Group]:
    """Every block container (>= 2 children, all of one class), then every other set of >= 2 block-like siblings
    of one class."""
    containers: list[_Group] = []
    siblings: list[_Group] = []
    for name, module in modules.items():
        children = list(module.named_children())
        if name and isinstance(module, _CONTAINERS) and len(children) >= 2 and \
                len({type(child) for _, child in children}) == 1:
            containers.append(_Group(name, tuple(_child(name, c) for c, _ in children), True))
        by_class: dict[type, list[str]] = {}
        for child_name, child in children:
            if _block_like(child):
                by_class.setdefault(type(child), []).append(_child(name, child_name))
        siblings += [_Group(name, tuple(members), False) for members in by_class.values() if len(members) >= 2]
    known = {g.members for g in containers}
    return containers + [g for g in siblings if g.members not in known]



def _chained(group: _Group, calls: Calls) -> tuple[str, ...]:
    """The group's blocks: its members that forward calls, in call order, cut into chains where each reads the
    output of the one called before it, and kept when in a chain of >= 2 (parallel heads are chains of one). Empty
    when a member is called more than once (shared weights)."""
    called = calls.order(list(group.members))
    if any(calls.times(m) > 1 for m in called):
        return ()
    chains = [[m] for m in called[:1]]
    for a, b in zip(called, called[1:]):
        if reads(calls, b, a):
            chains[-1].append(b)
        else:
            chains.append([b])
    return tuple(m for chain in chains if len(chain) >= 2 for m in chain)


def _block_groups(model: nn.Module, calls: Calls) -> list[_Group]:
    """The groups whose members become units (README, "Without SPLIT_POINTS"), in the order they are taken.

    Candidates (`_candidate_groups`) must have blocks (`_chained`). A group made of modules that are each made only of
    one chained group (a list of stages of blocks) gives way to those inner groups. Block containers are taken
    first, then sibling groups; within each, the largest (most members, then most parameters) first; a group is
    taken unless one of its members lies inside or contains a member of a group already taken: ResNet's
    layer1..layer4, an encoder's and a decoder's blocks, a U-Net's `down1..3` and `up1..3`."""
    modules = dict(model.named_modules())
    chains = [replace(g, blocks=blocks) for g in _candidate_groups(modules) if (blocks := _chained(g, calls))]
    made_of_blocks = {g.parent for g in chains if len(g.blocks) == len(list(modules[g.parent].children()))}
    eligible = [g for g in chains if not all(m in made_of_blocks for m in g.members)]

    def rank(g: _Group) -> tuple[bool, int, int, str]:
        params = sum(p.numel() for m in g.members for p in modules[m].parameters())
        return not g.container, -len(g.members), -params, g.parent

    taken: list[_Group] = []
    for group in sorted(eligible, key=rank):
        if not any(_inside(a, b) or _inside(b, a) for t in taken for a in group.members for b in t.members):
            taken.append(group)
    return taken


def _granules(model: nn.Module, expand: set[str]) -> list[str]:
    """Top-level children, recursively expanded where a child is in `expand` (an ancestor of a split point) or is a
    ModuleList/ModuleDict (never called itself: its members are)."""
    out: list[str] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            if full in expand or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                walk(full + ".", child)
            else:
                out.append(full)

    walk("", model)
    return out


def _ancestors(names: list[str]) -> set[str]:
    parts = {".".join(n.split(".")[:k]) for n in names for k in range(1, len(n.split(".")))}
    return parts


def _default_split_points(model: nn.Module, calls: Calls) -> list[str]:
    """The children of a Sequential model; else a split point before every member of every block group taken (in
    first-call order) and before the first module called after the last block. A point where a cut would split the
    calls of a module with parameters (`_weights_split_by`) is left out."""
    if isinstance(model, nn.Sequential):
        points = [name for name, _ in model.named_children()][1:]
    else:
        points = _block_points(model, calls)
    kept = [p for p in points if _weights_split_by(model, calls, p) is None]
    if kept != points:
        log.info("no unit starts at %s: a cut there would split the calls of a module with parameters",
                 sorted(set(points) - set(kept)))
    return kept


def _block_points(model: nn.Module, calls: Calls) -> list[str]:
    """A point before every block (in first-call order) and before the first module called after the last block."""
    blocks = {m for group in _block_groups(model, calls) for m in group.blocks}
    order = calls.order(_granules(model, _ancestors(sorted(blocks))))
    called = [name for name in order if name in blocks]
    if not called:
        return []
    points = called if order[0] != called[0] else called[1:]
    after = order[order.index(called[-1]) + 1:]
    return points + after[:1]


def _weights_split_by(model: nn.Module, calls: Calls, point: str) -> str | None:
    """A module holding parameters, under one name, that forward calls both before `point` starts and after (or
    `point` itself, called twice): torch's pipeline() would copy its weights onto both stages of a cut there, where
    they would train apart. (A module with several names, as T5's shared embedding, is a tied group: the runner sums
    its copies' gradients.)"""
    if calls.ids[point] not in calls.first:
        return None
    start = calls.first[calls.ids[point]]
    aliases = Counter(calls.ids.values())
    for name, module in model.named_modules():
        key = calls.ids[name]
        if aliases[key] == 1 and key in calls.first and calls.first[key] <= start < calls.last[key] and \
                next(module.parameters(recurse=False), None) is not None:
            return name
    return None


T = TypeVar("T")


def _forward_checked(mf: ModelFile, run: Callable[[], T]) -> T:
    """`run()`, a forward pass on sample_batch(1); its failure becomes an error naming the model file."""
    try:
        return run()
    except Exception as exc:
        raise mf.error(f"forward() on sample_batch(1), run to find the order modules are called in, raised "
                       f"{describe_error(exc)}") from exc


def discover_units(mf: ModelFile, model: nn.Module) -> list[Unit]:
    """Units from SPLIT_POINTS if given, else the Sequential's children or the blocks (README).

    Blocks: every member of every group `_block_groups` takes (a GPT's, Llama's or ViT's block list; layer1..4 of a
    ResNet; an encoder's and a decoder's blocks; a ModuleDict of blocks; sibling attributes `block1`, `block2`, ...)
    starts a unit, in first-call order; what runs before the first block is the first unit, what runs after the last
    block the last unit, and what runs between two groups (an encoder's final norm, a decoder's embedding) joins the
    unit of the block called just before it. Works on a model built on meta (autopp.model.meta) as on a real one."""
    inputs, _ = mf.sample_batch(1)
    named = dict(model.named_modules())
    if on_meta(model):  # a model built on meta (autopp.model.meta): the forward runs on fake tensors
        calls = _forward_checked(mf, lambda: run_fake(lambda *i: record_calls(model, i), *inputs))
    else:
        calls = _forward_checked(mf, lambda: record_calls(model, inputs))
    points = list(mf.split_points) if mf.split_points is not None else _default_split_points(model, calls)
    for p in points:
        if p not in named or p == "":
            raise mf.error(f"split point {p!r} is not a module of the model (see model.named_modules())")
    order = calls.order(_granules(model, _ancestors(points)))
    missing = [p for p in points if p not in order]
    if missing:
        raise mf.error(f"split point {missing[0]!r} is never called by forward()")
    positions = [order.index(p) for p in points]
    if positions != sorted(set(positions)):
        raise mf.error(f"split points must be listed in the order forward() calls them; call order is {order}")
    for p in points:
        shared = _weights_split_by(model, calls, p)
        if shared is not None:
            raise mf.error(f"split point {p!r} cuts between two calls of {shared!r}, whose parameters would then be "
                           f"copied onto two stages and trained apart: move it so that every call of {shared!r} "
                           f"falls on one side")
    starts = [0] + positions
    ends = positions + [len(order)]
    return [
        Unit(i, order[a] if a < len(order) else f"unit{i}", points[i - 1] if i else None, tuple(order[a:b]))
        for i, (a, b) in enumerate(zip(starts, ends))
    ]


def fingerprint(model: nn.Module, units: list[Unit]) -> str:
    """A short hash of the model's structure (parameter and buffer names, shapes, dtypes) and its units."""
    items = {
        "class": type(model).__qualname__,
        "params": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "units": [u.split_point for u in units],
    }
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()[:16]

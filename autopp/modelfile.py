"""Load a user's model file (the contract in README.md) and discover its units: the ordered places a stage may begin."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import itertools
import json
import logging
import re
import sys
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

from .errors import ModelFileError
from .preflight import check_model_file

__all__ = ["Unit", "ModelFile", "load_model_file", "discover_units", "fingerprint", "default_loss"]

log = logging.getLogger(__name__)

Batch = tuple[tuple[torch.Tensor, ...], Any]


@dataclass(frozen=True)
class Unit:
    """One split candidate: a stage may begin before `split_point` (None for the first unit)."""

    index: int
    name: str
    split_point: str | None
    modules: tuple[str, ...]


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy for integer targets (class dimension last), mean squared error otherwise; of an HF model's
    output structure, its `logits`."""
    output = getattr(output, "logits", output)
    if isinstance(target, torch.Tensor) and not target.is_floating_point():
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.mse_loss(output, target)


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: its functions, checked against the contract."""

    path: Path
    build_model: Callable[[], nn.Module]
    sample_batch_fn: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    split_points: tuple[str, ...] | None

    def sample_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """Return (inputs as a tuple, target) for `batch_size` samples, reproducibly for `seed`."""
        torch.manual_seed(seed)
        try:
            batch = self.sample_batch_fn(batch_size)
        except (Exception, SystemExit) as exc:  # a sys.exit() in the user's code is an error of that code
            raise self.error(f"sample_batch({batch_size}) raised {_describe(exc)}") from exc
        if not (isinstance(batch, tuple) and len(batch) == 2):
            raise self.error(f"sample_batch({batch_size}) must return (inputs, target), got {type(batch).__name__}")
        inputs, target = batch
        inputs = inputs if isinstance(inputs, tuple) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise self.error("sample_batch must return a Tensor or a tuple of Tensors as inputs")
        if any(t.shape[0] != batch_size for t in inputs):
            shapes = [tuple(t.shape) for t in inputs]
            raise self.error(f"sample_batch({batch_size}) returned inputs of shapes {shapes}: dim 0 must be the batch")
        return inputs, target

    def build(self, seed: int = 0) -> nn.Module:
        """Build the model with weights reproducible for `seed`."""
        torch.manual_seed(seed)
        try:
            model = self.build_model()
        except (Exception, SystemExit) as exc:
            raise self.error(f"build_model() raised {_describe(exc)}") from exc
        if not isinstance(model, nn.Module):
            raise self.error(f"build_model() must return a torch.nn.Module, got {type(model).__name__}")
        return model

    def error(self, message: str) -> ModelFileError:
        """A ModelFileError that names this file."""
        return ModelFileError(f"{self.path}: {message}")


def _describe(exc: BaseException) -> str:
    """`ValueError: text (at file.py:12)`, pointing at the innermost frame of the user's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _import(path: Path) -> ModuleType:
    name = f"autopp_model_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise ModelFileError(f"{path}{f':{exc.lineno}' if exc.lineno else ''}: syntax error: {exc.msg}") from exc
    except (Exception, SystemExit) as exc:
        raise ModelFileError(f"{path}: importing it raised {_describe(exc)}") from exc
    finally:
        sys.path.remove(str(path.parent))
    return module


def _function(module: ModuleType, path: Path, name: str, required: bool) -> Callable[..., Any] | None:
    fn = getattr(module, name, None)
    if fn is None and required:
        raise ModelFileError(f"{path}: missing required function {name}() (see the model file contract in README.md)")
    if fn is not None and not callable(fn):
        raise ModelFileError(f"{path}: {name} must be a function, got {type(fn).__name__}")
    return fn


def load_model_file(path: str | Path) -> ModelFile:
    """Import `path` and check it defines build_model() and sample_batch(), and optionally loss_fn, SPLIT_POINTS."""
    path = check_model_file(path)
    module = _import(path)
    build = _function(module, path, "build_model", True)
    sample = _function(module, path, "sample_batch", True)
    loss = _function(module, path, "loss_fn", False) or default_loss
    points = getattr(module, "SPLIT_POINTS", None)
    if points is not None and not (isinstance(points, (list, tuple)) and all(isinstance(p, str) for p in points)):
        raise ModelFileError(f"{path}: SPLIT_POINTS must be a list of module names (strings)")
    assert build is not None and sample is not None
    return ModelFile(path, build, sample, loss, tuple(points) if points is not None else None)


def check_forward(mf: ModelFile, model: nn.Module, batch_size: int = 2) -> None:
    """Run forward, the loss and backward once on a small batch so that contract mismatches (and operations
    without a gradient) fail early and clearly; the parameters' gradients are cleared afterwards."""
    inputs, target = mf.sample_batch(batch_size)
    n_args = _positional_arity(model)
    if n_args is not None and len(inputs) > n_args:
        raise mf.error(f"sample_batch gives {len(inputs)} inputs but forward() takes {n_args} positional arguments")
    try:
        output = model(*inputs)
    except (Exception, SystemExit) as exc:
        raise mf.error(f"forward() on sample_batch({batch_size}) raised {_describe(exc)}") from exc
    try:
        loss = mf.loss_fn(output, target)
    except (Exception, SystemExit) as exc:
        raise mf.error(f"loss_fn(output, target) raised {_describe(exc)}") from exc
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        got = f"a Tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise mf.error(f"loss_fn must return a scalar Tensor (the loss averaged over the batch, e.g. with .mean()), "
                       f"got {got}")
    try:
        if loss.requires_grad:
            loss.backward()
    except Exception as exc:
        raise mf.error(f"backward of the loss on sample_batch({batch_size}) raised {_first_line(exc)}"
                       f"{_backward_hint(exc)}") from exc
    finally:
        model.zero_grad(set_to_none=True)


#: What autograd says when an operation has no gradient formula (a custom op without one, a non-differentiable op).
_NO_GRADIENT = re.compile(r"no autograd formula|register_autograd|does not require grad|does not have a grad_fn|"
                          r"derivative for .* is not implemented", re.IGNORECASE)


def _backward_hint(exc: BaseException) -> str:
    """The advice for a backward failure: the custom-op hint only when autograd says an operation has no gradient
    (an in-place modification or any other error keeps torch's own words)."""
    if _NO_GRADIENT.search(str(exc)):
        return ("; every operation in forward() needs a gradient (a torch.library.custom_op needs "
                "register_autograd)")
    return ""


def _first_line(exc: BaseException) -> str:
    """`RuntimeError: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _positional_arity(model: nn.Module) -> int | None:
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


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


@dataclass(frozen=True)
class _Calls:
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


def _record_calls(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> _Calls:
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
    return _Calls(ids, first, last, count, ins, outs)


def _reads(calls: _Calls, later: str, earlier: str) -> bool:
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


def _chained(group: _Group, calls: _Calls) -> tuple[str, ...]:
    """The group's blocks: its members that forward calls, in call order, cut into chains where each reads the
    output of the one called before it, and kept when in a chain of >= 2 (parallel heads are chains of one). Empty
    when a member is called more than once (shared weights)."""
    called = calls.order(list(group.members))
    if any(calls.times(m) > 1 for m in called):
        return ()
    chains = [[m] for m in called[:1]]
    for a, b in zip(called, called[1:]):
        if _reads(calls, b, a):
            chains[-1].append(b)
        else:
            chains.append([b])
    return tuple(m for chain in chains if len(chain) >= 2 for m in chain)


def _block_groups(model: nn.Module, calls: _Calls) -> list[_Group]:
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


def _default_split_points(model: nn.Module, calls: _Calls) -> list[str]:
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


def _block_points(model: nn.Module, calls: _Calls) -> list[str]:
    """A point before every block (in first-call order) and before the first module called after the last block."""
    blocks = {m for group in _block_groups(model, calls) for m in group.blocks}
    order = calls.order(_granules(model, _ancestors(sorted(blocks))))
    called = [name for name in order if name in blocks]
    if not called:
        return []
    points = called if order[0] != called[0] else called[1:]
    after = order[order.index(called[-1]) + 1:]
    return points + after[:1]


def _weights_split_by(model: nn.Module, calls: _Calls, point: str) -> str | None:
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
                       f"{_describe(exc)}") from exc


def discover_units(mf: ModelFile, model: nn.Module) -> list[Unit]:
    """Units from SPLIT_POINTS if given, else the Sequential's children or the blocks (README).

    Blocks: every member of every group `_block_groups` takes (a GPT's, Llama's or ViT's block list; layer1..4 of a
    ResNet; an encoder's and a decoder's blocks; a ModuleDict of blocks; sibling attributes `block1`, `block2`, ...)
    starts a unit, in first-call order; what runs before the first block is the first unit, what runs after the last
    block the last unit, and what runs between two groups (an encoder's final norm, a decoder's embedding) joins the
    unit of the block called just before it."""
    inputs, _ = mf.sample_batch(1)
    named = dict(model.named_modules())
    calls = _forward_checked(mf, lambda: _record_calls(model, inputs))
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

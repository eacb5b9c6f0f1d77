"""Load a user's model file (the contract in README.md) and discover its units: the ordered places a stage may begin."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from .errors import ModelFileError

__all__ = ["Unit", "ModelFile", "load_model_file", "discover_units", "fingerprint", "default_loss"]

Batch = tuple[tuple[torch.Tensor, ...], Any]


@dataclass(frozen=True)
class Unit:
    """One split candidate: a stage may begin before `split_point` (None for the first unit)."""

    index: int
    name: str
    split_point: str | None
    modules: tuple[str, ...]


def default_loss(output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy for integer targets (class dimension last), mean squared error otherwise."""
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
        except Exception as exc:
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
        except Exception as exc:
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
        raise ModelFileError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except Exception as exc:
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
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelFileError(f"{path}: no such file")
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
    """Run forward and the loss once on a small batch so that contract mismatches fail early and clearly."""
    inputs, target = mf.sample_batch(batch_size)
    n_args = _positional_arity(model)
    if n_args is not None and len(inputs) > n_args:
        raise mf.error(f"sample_batch gives {len(inputs)} inputs but forward() takes {n_args} positional arguments")
    try:
        with torch.no_grad():
            output = model(*inputs)
    except Exception as exc:
        raise mf.error(f"forward() on sample_batch({batch_size}) raised {_describe(exc)}") from exc
    try:
        loss = mf.loss_fn(output, target)
    except Exception as exc:
        raise mf.error(f"loss_fn(output, target) raised {_describe(exc)}") from exc
    if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
        raise mf.error(f"loss_fn must return a scalar Tensor, got {type(loss).__name__}")


def _positional_arity(model: nn.Module) -> int | None:
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _repeated(module: nn.Module) -> bool:
    """Whether `module` is a ModuleList/Sequential of >= 2 children all of one class."""
    return isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2 and \
        len({type(child) for child in module}) == 1


def _inside(name: str, outer: str) -> bool:
    """Whether module `name` is `outer` or lies inside it."""
    return name == outer or name.startswith(outer + ".")


def _block_containers(model: nn.Module) -> list[str]:
    """Names of the repeated-block containers whose children become units, largest first.

    Candidates are the ModuleList/Sequential modules of >= 2 same-class children, except one whose children are all
    candidates themselves (a list of stages: its stages' blocks are taken instead). The largest (most children, then
    most parameters) is taken; then each other candidate, largest first, that neither lies inside nor contains one
    already taken: ResNet's layer1..layer4, an encoder's and a decoder's blocks. A model with one such container
    (GPT, Llama, ViT) gets exactly that one."""
    modules = dict(model.named_modules())
    candidates = {name for name, module in modules.items() if name and _repeated(module)}
    eligible = [name for name in candidates
                if not all(f"{name}.{child}" in candidates for child, _ in modules[name].named_children())]

    def rank(name: str) -> tuple[int, int, str]:
        return -len(modules[name]), -sum(p.numel() for p in modules[name].parameters()), name

    taken: list[str] = []
    for name in sorted(eligible, key=rank):
        if not any(_inside(name, t) or _inside(t, name) for t in taken):
            taken.append(name)
    return taken


def _granules(model: nn.Module, expand: set[str]) -> list[str]:
    """Top-level children, recursively expanded where a child is in `expand` (an ancestor of a split point)."""
    out: list[str] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            full = f"{prefix}{child_name}"
            if full in expand:
                walk(full + ".", child)
            else:
                out.append(full)

    walk("", model)
    return out


def _call_order(model: nn.Module, names: list[str], inputs: tuple[torch.Tensor, ...]) -> list[str]:
    """The first-call order of the modules `names` in one forward pass."""
    order: list[str] = []
    handles = []
    for name in names:
        def hook(_m: nn.Module, _a: Any, name: str = name) -> None:
            if name not in order:
                order.append(name)
        handles.append(model.get_submodule(name).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return order


def _ancestors(names: list[str]) -> set[str]:
    parts = {".".join(n.split(".")[:k]) for n in names for k in range(1, len(n.split(".")))}
    return parts


def _default_split_points(model: nn.Module, order_of: Callable[[list[str]], list[str]]) -> list[str]:
    """The children of a Sequential model; else a split point before every block of every repeated container (in
    first-call order) and before the first module called after the last block."""
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()][1:]
    containers = _block_containers(model)
    if not containers:
        return []
    blocks = {f"{c}.{name}" for c in containers for name, _ in model.get_submodule(c).named_children()}
    order = order_of(_granules(model, _ancestors(sorted(blocks)) | set(containers)))
    called = [name for name in order if name in blocks]
    if not called:
        return []
    points = called if order[0] != called[0] else called[1:]
    after = order[order.index(called[-1]) + 1:]
    return points + after[:1]


def discover_units(mf: ModelFile, model: nn.Module) -> list[Unit]:
    """Units from SPLIT_POINTS if given, else the Sequential's children or the repeated blocks (README).

    Repeated blocks: every child of every container `_block_containers` takes (one for GPT, Llama, ViT; layer1..4 of
    a ResNet; an encoder's and a decoder's blocks) starts a unit, in first-call order; what runs before the first
    block is the first unit, what runs after the last block the last unit, and what runs between two containers
    (an encoder's final norm, a decoder's embedding) joins the unit of the block called just before it."""
    inputs, _ = mf.sample_batch(1)
    named = dict(model.named_modules())

    def order_of(names: list[str]) -> list[str]:
        try:
            return _call_order(model, names, inputs)
        except Exception as exc:
            raise mf.error(f"forward() on sample_batch(1), run to find the order modules are called in, raised "
                           f"{_describe(exc)}") from exc

    points = list(mf.split_points) if mf.split_points is not None else _default_split_points(model, order_of)
    for p in points:
        if p not in named or p == "":
            raise mf.error(f"split point {p!r} is not a module of the model (see model.named_modules())")
    granules = _granules(model, _ancestors(points))
    order = order_of(granules)
    missing = [p for p in points if p not in order]
    if missing:
        raise mf.error(f"split point {missing[0]!r} is never called by forward()")
    positions = [order.index(p) for p in points]
    if positions != sorted(set(positions)):
        raise mf.error(f"split points must be listed in the order forward() calls them; call order is {order}")
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

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


def _block_container(model: nn.Module) -> str | None:
    """Name of the largest ModuleList/Sequential whose children are all of one class (>= 2 of them)."""
    best: tuple[int, str] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if best is None or (len(module), size) > (best[0], sum(p.numel() for p in model.get_submodule(best[1]).parameters())):
            best = (len(module), name)
    return best[1] if best else None


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
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()][1:]
    container = _block_container(model)
    if container is None:
        return []
    blocks = [f"{container}.{name}" for name, _ in model.get_submodule(container).named_children()]
    order = order_of(_granules(model, _ancestors(blocks) | {container}))
    called = [name for name in order if name in blocks]
    points = called if order and order[0] != called[0] else called[1:]
    after = order[order.index(called[-1]) + 1:] if called else []
    return points + after[:1]


def discover_units(mf: ModelFile, model: nn.Module) -> list[Unit]:
    """Units from SPLIT_POINTS if given, else the Sequential's children or the repeated blocks (README)."""
    inputs, _ = mf.sample_batch(1)
    named = dict(model.named_modules())
    order_of = lambda names: _call_order(model, names, inputs)  # noqa: E731
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

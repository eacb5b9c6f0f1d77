"""The model-file contract (README.md): load a user's model file, check its functions, and run one forward, loss and
backward so that a mismatch fails early with one clear line."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import re
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.nn import functional as F

from ..errors import ModelFileError
from ..preflight import check_model_file
from .fake import fake_mode, faking, on_meta, to_fake

__all__ = ["Batch", "ModelFile", "load_model_file", "check_forward", "default_loss", "describe_error", "batch_norms"]

Batch = tuple[tuple[torch.Tensor, ...], Any]


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
    tp_plan: dict[str, str] | None = None
    """TP_PLAN of the model file: module-name pattern -> tensor-parallel style (autopp.model.tp); None: not given."""
    sequence_chunks: bool = False
    """SEQUENCE_CHUNKS of the model file: its attention is causal SDPA without a mask and positions come from its
    inputs, so `autopp run` may split its sequences into chunks (Seq1F1B, autopp.run.seq_chunks)."""
    cross_entropy: bool = False
    """The loss is autopp's cross-entropy of the output logits (an HF config's model file, autopp.model.hf): a TP
    plan's gathered head then keeps its logits sharded into the loss (autopp.model.tp.LOSS_PARALLEL)."""
    shard: str = ""
    """What build_model() gives when it is not the whole model (a tensor-parallel rank's shard, autopp.model.tp), and
    what that asks of forward(): said in this file's errors; "" for the model itself."""

    def sample_batch(self, batch_size: int, seed: int = 0) -> Batch:
        """Return (inputs as a tuple, target) for `batch_size` samples, reproducibly for `seed`."""
        torch.manual_seed(seed)
        try:
            batch = self.sample_batch_fn(batch_size)
        except (Exception, SystemExit) as exc:  # a sys.exit() in the user's code is an error of that code
            raise self.error(f"sample_batch({batch_size}) raised {describe_error(exc)}") from exc
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
        except ModelFileError:  # already one line naming the file (an HF config's build, autopp.model.hf)
            raise
        except (Exception, SystemExit) as exc:
            raise self.error(f"build_model() raised {describe_error(exc)}") from exc
        if not isinstance(model, nn.Module):
            raise self.error(f"build_model() must return a torch.nn.Module, got {type(model).__name__}")
        return model

    def error(self, message: str) -> ModelFileError:
        """A ModelFileError that names this file (and the shard it builds, if any)."""
        return ModelFileError(f"{self.path}{f' ({self.shard})' if self.shard else ''}: {message}")


def batch_norms(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s BatchNorm modules (any `_BatchNorm`: BatchNorm1d/2d/3d, SyncBatchNorm), which
    normalize by the statistics of the batch they are given: a microbatch under pipelining (profiles record them,
    plans say so, `autopp run` refuses to validate them; autopp.run.steps.batch_norm_refusal)."""
    return [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def describe_error(exc: BaseException) -> str:
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
        raise ModelFileError(f"{path}: importing it raised {describe_error(exc)}") from exc
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
    """Import `path` and check it defines build_model() and sample_batch(), and optionally loss_fn, SPLIT_POINTS,
    TP_PLAN, SEQUENCE_CHUNKS."""
    path = check_model_file(path)
    module = _import(path)
    build = _function(module, path, "build_model", True)
    sample = _function(module, path, "sample_batch", True)
    loss = _function(module, path, "loss_fn", False) or default_loss
    points = getattr(module, "SPLIT_POINTS", None)
    if points is not None and not (isinstance(points, (list, tuple)) and all(isinstance(p, str) for p in points)):
        raise ModelFileError(f"{path}: SPLIT_POINTS must be a list of module names (strings)")
    chunks = getattr(module, "SEQUENCE_CHUNKS", False)
    if not isinstance(chunks, bool):
        raise ModelFileError(f"{path}: SEQUENCE_CHUNKS must be True or False, got {chunks!r}")
    assert build is not None and sample is not None
    return ModelFile(path, build, sample, loss, tuple(points) if points is not None else None,
                     _tp_plan(module, path), chunks)


def _tp_plan(module: ModuleType, path: Path) -> dict[str, str] | None:
    """The file's TP_PLAN, checked to be a dict of module-name pattern -> style (both strings); None without one."""
    plan = getattr(module, "TP_PLAN", None)
    if plan is None:
        return None
    bad = (f"a {type(plan).__name__}" if not isinstance(plan, dict) else
           next((f"{k!r}: {v!r}" for k, v in plan.items() if not (isinstance(k, str) and isinstance(v, str))), None))
    if bad is not None:
        raise ModelFileError(f"{path}: TP_PLAN must be a dict of module-name pattern -> style strings (e.g. "
                             f"{{'layers.*.fc1': 'colwise'}}), got {bad}")
    return dict(plan)


def check_forward(mf: ModelFile, model: nn.Module, batch_size: int = 2) -> None:
    """Run forward, the loss and backward once on a small batch so that contract mismatches (and operations
    without a gradient) fail early and clearly; the parameters' gradients are cleared afterwards. A model on the
    meta device (autopp.model.meta) runs on fake tensors: shapes, dtypes and gradients are checked, no values."""
    inputs, target = mf.sample_batch(batch_size)
    n_args = _positional_arity(model)
    if n_args is not None and len(inputs) > n_args:
        raise mf.error(f"sample_batch gives {len(inputs)} inputs but forward() takes {n_args} positional arguments")
    if on_meta(model):  # a model built on meta (autopp.model.meta) runs on fake tensors
        mode = fake_mode()
        inputs, target = to_fake(mode, (inputs, target))
        with faking(mode), _quiet_fake_tensor_log():
            _forward_loss_backward(mf, model, inputs, target, batch_size)
    else:
        _forward_loss_backward(mf, model, inputs, target, batch_size)


@contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch's fake tensors log a traceback ("failed while attempting to run meta for ...") before they raise the
    error that autopp reports on one line: keep that log quiet while the model's forward runs on them."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _forward_loss_backward(mf: ModelFile, model: nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                           batch_size: int) -> None:
    """check_forward's run: each step's failure becomes one line naming the model file."""
    try:
        output = model(*inputs)
    except (Exception, SystemExit) as exc:
        raise mf.error(f"forward() on sample_batch({batch_size}) raised {describe_error(exc)}"
                       f"{_forward_hint(model, exc)}") from exc
    try:
        loss = mf.loss_fn(output, target)
    except (Exception, SystemExit) as exc:
        raise mf.error(f"loss_fn(output, target) raised {describe_error(exc)}") from exc
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


#: Module names of a mixture-of-experts layer (transformers: `experts`, `block_sparse_moe`, `SparseMoeBlock`).
_EXPERTS = re.compile(r"expert|moe", re.IGNORECASE)


def _forward_hint(model: nn.Module, exc: BaseException) -> str:
    """The advice for an op whose output shape depends on values (`nonzero`, `where(mask)`), which fake tensors (a
    model built on meta) cannot run: for a mixture of experts, what does run (docs/models.md, "Mixture of
    experts"); for any other model, where the limit comes from."""
    if not isinstance(exc, (DynamicOutputShapeException, DataDependentOutputException)):
        return ""
    names = [f"{name} {type(m).__name__}" for name, m in model.named_modules()]
    if any(_EXPERTS.search(n) for n in names):
        return ("; this mixture of experts picks each expert's tokens by value (a loop over the experts hit), "
                "which fake tensors cannot run: MoE layers that route with torch._grouped_mm over tokens sorted by "
                "expert work (transformers' default experts implementation: Mixtral, Qwen2-MoE, Qwen3-MoE, "
                "DeepSeek-V3, ...; see docs/models.md)")
    return ("; an op whose output shape depends on tensor values cannot run on the fake tensors autopp checks models "
            "on (docs/analytic.md)")


def _first_line(exc: BaseException) -> str:
    """`RuntimeError: first line of the message`."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _positional_arity(model: nn.Module) -> int | None:
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

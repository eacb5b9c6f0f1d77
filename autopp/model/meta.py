"""Build a user's model without materializing it: every parameter and buffer on the meta device, the small ones'
real initial values kept by name; then materialize a few modules at a time (a pipeline piece) on the measuring
device with the modules' own initialisation, and free them again.

Building (`build_meta`): while `build_model()` runs, `nn.Module.register_parameter` puts every parameter larger than
`SMALL_BYTES`, and every one after the first `REAL_BYTES` of real ones, on meta (the idea of accelerate's
`init_empty_weights(include_buffers=False)`, written here), so the big weights never take memory while the modules'
`__init__` code still runs as written: small parameters and all buffers stay real and keep what `__init__` gave them
(rotary tables, norm weights, BatchNorm statistics). Those real values are kept by qualified name, then everything
moves to meta. A tensor factory asked for more than the real budget is made on meta directly
(`_HugeFactoriesOnMeta`): a MoE model's stacked expert weights would not fit in memory even until they are
registered. A model file may also return a model already on meta (built under `torch.device("meta")`): it is
accepted as it is.

Materializing (`MetaModel.materialize`): each module owning a requested tensor gets fresh tensors on the device,
every floating-point one filled with NaN, then runs its own initialisation: transformers'
`PreTrainedModel._init_weights(module)` when the root model has it (it also recomputes rotary `inv_freq` buffers),
else `module.reset_parameters()` (or torch's private `_reset_parameters()`, MultiheadAttention's); real values kept
at build time are copied in by name; a tensor still holding NaN after that (a module with no initialisation of its
own) gets the documented fallback, logged: floating-point parameters normal(0, 0.02), buffers zeros. Uninitialised
memory is never measured (it can hold NaN or denormals, which change CPU timings). The module then gets its own meta
tensors back; the caller holds the returned tensors.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import Pipe
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .contract import ModelFile, check_forward
from .fake import run_fake, to_meta
from .hf import is_hf_config
from .split import output_spec, split_model
from .units import Unit, discover_units, fingerprint

__all__ = ["SMALL_BYTES", "REAL_BYTES", "MetaModel", "build_meta", "build_units", "meta_pieces", "retarget"]

log = logging.getLogger(__name__)

#: Parameters of at most this many bytes are built for real (and their values kept); larger ones on meta.
SMALL_BYTES = 1 << 20
#: At most this many bytes of parameters are built for real in all; the small ones after that go to meta too.
REAL_BYTES = 64 << 20

#: The fallback standard deviation for a floating-point parameter that no initialisation touched.
FALLBACK_STD = 0.02


@contextlib.contextmanager
def _large_parameters_on_meta(limit: int, budget: int) -> Iterator[None]:
    """While active, a parameter registered on any module goes to meta when larger than `limit` bytes, or when
    keeping it real would take the real parameters kept so far beyond `budget` bytes (a model of many small layers
    is not built whole); the same parameter object registered twice, a tied weight, becomes the same meta parameter."""
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref[nn.Parameter], nn.Parameter]] = {}  # weak: a freed id may be reused
    kept: dict[int, weakref.ref[nn.Parameter]] = {}
    total = [0]

    def keep(param: nn.Parameter) -> bool:
        known = kept.get(id(param))
        if known is not None and known() is param:
            return True
        n = param.numel() * param.element_size()
        if n > limit or total[0] + n > budget:
            return False
        kept[id(param)] = weakref.ref(param)
        total[0] += n
        return True

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:  # the method's own signature
        if param is not None and param.device.type != "meta" and not keep(param):
            known = moved.get(id(param))
            if known is None or known[0]() is not param:
                meta = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
                meta.__dict__.update(param.__dict__)
                known = moved[id(param)] = (weakref.ref(param), meta)
            param = known[1]
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


#: Tensor factories `_huge_factories_on_meta` watches: their size is the first argument(s).
_FACTORIES = frozenset({torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn})


def _factory_bytes(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Bytes of the tensor a factory call makes: its size given as ints or as one sequence, in its dtype."""
    dims = args[0] if args and isinstance(args[0], (tuple, list, torch.Size)) else kwargs.get("size", args)
    numel = 1
    for d in dims:
        if not isinstance(d, int):
            return 0  # torch.full's fill value after the size, or a symbolic size: not ours to judge
        numel *= d
    return numel * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize


class _HugeFactoriesOnMeta(TorchFunctionMode):
    """While active, a tensor factory called without a device makes a tensor of more than `limit` bytes on meta.
    `_large_parameters_on_meta` moves a parameter to meta only once it is registered, after `torch.empty` has
    allocated it: a stacked expert weight of DeepSeek-V3 (256 x 4096 x 7168 float32, 30 GB) would not fit in memory
    even for that moment. A buffer that large loses its built value (it gets the modules' initialisation or the
    fallback, logged)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None and _factory_bytes(args, kwargs) > self.limit:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _named_tensors(module: nn.Module, recurse: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters then buffers, every name of a shared tensor (aliases) included."""
    yield from module.named_parameters(recurse=recurse, remove_duplicate=False)
    yield from module.named_buffers(recurse=recurse, remove_duplicate=False)


@dataclass
class MetaModel:
    """A model on the meta device and the real initial values of its small tensors."""

    model: nn.Module
    real: dict[str, torch.Tensor]
    """Real initial values by qualified name (every alias of a tied tensor): buffers and parameters built for real."""
    seed: int = 0
    materialized_bytes: int = 0
    """Bytes of tensors materialized by `load` and not yet freed by `unload` (what this model holds for real now)."""
    peak_materialized_bytes: int = 0
    """The most `materialized_bytes` has been."""

    def materialize(self, names: Iterable[str], device: torch.device | str, dtype: torch.dtype | None = None
                    ) -> dict[str, torch.Tensor]:
        """Real, initialised tensors for the parameters and buffers `names` (qualified names of `model`), floating
        ones in `dtype` when given; the model stays on meta."""
        wanted = list(dict.fromkeys(names))
        owners: dict[str, list[str]] = {}
        for name in wanted:
            owners.setdefault(name.rpartition(".")[0], []).append(name)
        out: dict[str, torch.Tensor] = {}
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            for prefix in owners:
                torch.manual_seed(self.seed + zlib.crc32(prefix.encode()))
                out.update(self._materialize_owner(prefix, torch.device(device), dtype))
        return {n: out[n] for n in wanted}

    def _materialize_owner(self, prefix: str, device: torch.device, dtype: torch.dtype | None
                           ) -> dict[str, torch.Tensor]:
        """Every direct parameter and buffer of the module `prefix`, materialized and initialised (module docstring).
        The module holds fresh tensors while its initialisation runs, then gets its own (meta) tensors back, so the
        meta model's parameter objects, and with them its tied weights, never change."""
        module = self.model.get_submodule(prefix)
        params, buffers = dict(module._parameters), dict(module._buffers)
        try:
            for leaf, p in params.items():
                if p is not None:
                    module._parameters[leaf] = nn.Parameter(_blank(p, device), requires_grad=p.requires_grad)
            for leaf, b in buffers.items():
                if b is not None:
                    module._buffers[leaf] = _blank(b, device)
            _initialise(self.model, module)
            tensors = dict(_named_tensors(module, recurse=False))  # an initialisation may replace a buffer
            for leaf, t in tensors.items():
                qualified = f"{prefix}.{leaf}" if prefix else leaf
                if qualified in self.real:
                    t.detach().copy_(self.real[qualified])
                elif t.is_floating_point() and bool(torch.isnan(t).any()):
                    _fallback(module, leaf, t, isinstance(t, nn.Parameter))
            return {(f"{prefix}.{leaf}" if prefix else leaf): _cast(t.detach(), dtype) for leaf, t in tensors.items()}
        finally:
            module._parameters.update(params)
            module._buffers.update(buffers)

    def load(self, module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None) -> int:
        """Give `module` (the meta model itself, or a piece of its split whose tensors carry the model's qualified
        names) real, initialised parameters and buffers, in place; returns their bytes."""
        names = [(name, id(t)) for name, t in _named_tensors(module)]  # before materialize replaces buffers
        first: dict[int, str] = {}
        for name, key in names:
            first.setdefault(key, name)  # a tensor under several names (tied) is materialized once
        values = self.materialize(first.values(), device, dtype)
        params: dict[int, nn.Parameter] = {}
        for name, key in names:
            _assign(module, name, values[first[key]], key, params)
        n = sum(t.numel() * t.element_size() for t in values.values())
        self.materialized_bytes += n
        self.peak_materialized_bytes = max(self.peak_materialized_bytes, self.materialized_bytes)
        return n

    def unload(self, module: nn.Module) -> None:
        """Free what `load` gave `module`: every parameter and buffer back to meta (gradients dropped)."""
        first: dict[int, str] = {}
        for name, t in _named_tensors(module):
            if t.device.type != "meta":
                first.setdefault(id(t), name)
        live = {id(t): t for _, t in _named_tensors(module) if id(t) in first}
        n = sum(t.numel() * t.element_size() for t in live.values())
        params: dict[int, nn.Parameter] = {}
        for name, t in list(_named_tensors(module)):
            if id(t) in live:
                _assign(module, name, torch.empty_like(t, device="meta"), id(t), params)
        self.materialized_bytes -= n


def _blank(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor like `t` on `device`, NaN (zeros for integers): what no initialisation touched stays recognisable."""
    return torch.full(t.shape, float("nan") if t.is_floating_point() else 0, dtype=t.dtype, device=device)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


def _assign(root: nn.Module, name: str, value: torch.Tensor, key: int, params: dict[int, nn.Parameter]) -> None:
    """Put `value` in place of the tensor `name` of `root`: a parameter becomes a new Parameter (one per `key`, the
    old tensor's id, memoised in `params`, so the names of a tied weight stay one tensor; `set_data` cannot move a
    meta parameter to another device), a buffer is replaced."""
    prefix, _, leaf = name.rpartition(".")
    owner = root.get_submodule(prefix)
    old = owner._parameters.get(leaf)
    if old is not None:
        if key not in params:
            params[key] = nn.Parameter(value, requires_grad=old.requires_grad)
        owner._parameters[leaf] = params[key]
    else:
        owner._buffers[leaf] = value


def _initialise(root: nn.Module, module: nn.Module) -> None:
    """The module's own initialisation: transformers' `_init_weights` from the root model when it has one (a
    PreTrainedModel), else `reset_parameters()` (torch's MultiheadAttention: `_reset_parameters()`); with both,
    `reset_parameters()` also runs when the former left a tensor untouched (still NaN)."""
    hf = getattr(root, "_init_weights", None)
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(hf) and hasattr(root, "config"):
        hf(module)
        untouched = any(t.is_floating_point() and bool(torch.isnan(t).any())
                        for _, t in _named_tensors(module, recurse=False))
        if not (untouched and callable(reset)):
            return
    if callable(reset):
        reset()


_FALLEN_BACK: set[tuple[str, str]] = set()


def _fallback(module: nn.Module, leaf: str, t: torch.Tensor, parameter: bool) -> None:
    """A tensor no initialisation touched: parameters normal(0, FALLBACK_STD), buffers zeros; logged once per
    module class and name."""
    key = (type(module).__qualname__, leaf)
    if key not in _FALLEN_BACK:
        _FALLEN_BACK.add(key)
        what = f"normal(0, {FALLBACK_STD})" if parameter else "zeros"
        log.warning("%s.%s: no initialisation of its own (no _init_weights or reset_parameters); filled with %s",
                    key[0], leaf, what)
    if parameter:
        nn.init.normal_(t.detach(), 0.0, FALLBACK_STD)
    else:
        t.detach().zero_()


def build_meta(mf: ModelFile, seed: int = 0, small_bytes: int | None = None, real_bytes: int | None = None
               ) -> MetaModel:
    """The model of `mf` with every parameter and buffer on meta, and the real initial values of those built for
    real (parameters of at most `small_bytes`, default `SMALL_BYTES`, while they add up to at most `real_bytes`,
    default `REAL_BYTES`; buffers), by qualified name."""
    budget = REAL_BYTES if real_bytes is None else real_bytes
    with _large_parameters_on_meta(SMALL_BYTES if small_bytes is None else small_bytes, budget), \
            _HugeFactoriesOnMeta(max(budget, SMALL_BYTES)):
        model = mf.build(seed)
    real = {name: t.detach() for name, t in _named_tensors(model) if t.device.type != "meta"}
    params: dict[int, nn.Parameter] = {}
    for name, t in list(_named_tensors(model)):  # not model.to("meta"): it would untie tied weights
        if t.device.type != "meta":
            _assign(model, name, torch.empty_like(t, device="meta"), id(t), params)
    return MetaModel(model, real, seed)


def build_units(mf: ModelFile, dtype: torch.dtype | None = None) -> tuple[MetaModel, list[Unit], str]:
    """The model built on meta and its forward checked, its units (at least 2) and its fingerprint, taken before the
    model is cast to `dtype` (so profiles of one model in any dtype, measured or analytic, share it)."""
    meta = build_meta(mf)
    check_forward(mf, meta.model)
    units = discover_units(mf, meta.model)
    if len(units) < 2:
        fix = "use a config with at least 2 layers" if is_hf_config(mf.path) else "define SPLIT_POINTS (see README.md)"
        raise mf.error(f"found {len(units)} unit(s); a pipeline needs >= 2: {fix}")
    model_fingerprint = fingerprint(meta.model, units)
    if dtype is not None:
        meta.model.to(dtype)
    return meta, units, model_fingerprint


def meta_pieces(mf: ModelFile, meta: MetaModel, split_points: Sequence[str], b: int,
                dtype: torch.dtype | None = None) -> tuple[Pipe, pytree.TreeSpec, tuple[Any, ...], Any]:
    """The split of the meta model at `split_points` on sample_batch(`b`) moved to meta (floating-point inputs in
    `dtype`): the Pipe (pieces on meta, parameters named by the model's qualified names), the model output's
    structure, the meta inputs and the meta target."""
    inputs, target = mf.sample_batch(b)
    cast = (lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) if dtype else None
    if cast is not None:
        inputs, target = pytree.tree_map(cast, (inputs, target))
    meta_inputs, meta_target = to_meta((inputs, target))
    pipe = split_model(meta.model, meta_inputs, split_points)
    spec = run_fake(lambda *i: output_spec(meta.model, i), *meta_inputs)
    return pipe, spec, meta_inputs, meta_target


def _float_histc_inputs(graph: torch.fx.Graph) -> int:
    """Cast the integer input of every `aten.histc` in `graph` to float32; returns how many. Tracing on meta takes a
    model's branches for a device other than the CPU, and transformers' MoE experts (`grouped_mm_experts_forward`,
    transformers/integrations/moe.py) then count tokens per expert with `histc` of int32 expert ids, as CUDA's
    deterministic histc wants, which the CPU kernel refuses (`"histogram_cpu" not implemented for 'Int'`); on the
    CPU that code casts the ids to float instead, which is what this does (exact: ids are small integers)."""
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.histc.default:
            continue
        source = node.args[0]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if value is None or value.is_floating_point():
            continue
        with graph.inserting_before(node):
            cast = graph.call_function(torch.ops.aten.to.dtype, (source, torch.float32))
        cast.meta["val"] = value.to(torch.float32)
        node.args = (cast, *node.args[1:])
        changed += 1
    return changed


def retarget(pipe: Pipe, device: torch.device | str) -> int:
    """Make the pieces of a split traced on meta create their tensors on `device`: torch.export records a device
    that forward() reads from a tensor (`torch.ones(..., device=x.device)`, a causal mask) as the constant `meta`;
    every such constant in the pieces' graphs becomes `device`. On the CPU, an integer `histc` input is also cast to
    float (`_float_histc_inputs`). Returns how many were changed."""
    target = torch.device(device)
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == "meta":
            changed += 1
            return target
        return value

    for module in pipe.split_gm.modules():
        graph = getattr(module, "graph", None)
        if not isinstance(graph, torch.fx.Graph):
            continue
        before = changed
        for node in graph.nodes:
            node.args, node.kwargs = pytree.tree_map(swap, (node.args, node.kwargs))
        if target.type == "cpu":
            changed += _float_histc_inputs(graph)
        # An InterpreterModule runs the code of its `graph_module` (same graph) on itself: regenerate that code.
        code = module if isinstance(module, torch.fx.GraphModule) else getattr(module, "graph_module", None)
        if changed != before and isinstance(code, torch.fx.GraphModule):
            code.recompile()
    return changed

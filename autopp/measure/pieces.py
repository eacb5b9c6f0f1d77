"""Measure every unit of a model at one microbatch size: split the meta model, then walk the pieces in model order,
materializing a window of pieces at a time (autopp.model.meta) and measuring each piece of the window inside it:
parameters, saved activations, outputs, the peak allocated, the times (autopp.measure.timing), and when asked its
optimizer step; then the window is freed. Pieces of the same structure and input shapes as an earlier one are not
measured again: they run through the earlier piece's materialized module and share its measurement."""

from __future__ import annotations

import hashlib
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ..model.contract import ModelFile
from ..model.meta import MetaModel, meta_pieces, retarget
from ..model.split import (LiveValue, live_values, model_output, rebuild_output, source_piece, tied_groups,
                           walk_split_graph)
from ..model.units import Unit
from .allocator import return_freed_memory
from .head import HeadSlice, extrapolate, find_head, sliced_head, sliced_target
from .memory import SavedOps, peak_bytes, saved_bytes, static_bytes, storage_key, value_bytes
from .options import make_optimizer
from .settings import Settings
from .timing import Budget, Piece, summarize, time_pieces

__all__ = ["OPTIMIZER_SLICE_NUMEL", "SizeResult", "measure_pieces", "optimizer_step_s", "piece_key", "windows"]


@dataclass
class SizeResult:
    """What one microbatch size gave: unit rows, edge rows, live values and their bytes (by split-graph name), the
    peak bytes per unit, and the optimizer steps measured per piece (when asked; shared units included)."""

    rows: list[dict[str, Any]]
    edges: list[dict[str, Any]]
    live: list[LiveValue]
    value_bytes: dict[str, int]
    peaks: dict[int, int] = field(default_factory=dict)
    optimizer_step_s: float = 0.0
    head_slice: dict[str, Any] | None = None
    """How the last piece's head was measured on slices of its vocabulary (autopp.measure.head), if it was."""


#: The most elements an optimizer step is measured on; a larger set of parameters is timed on a slice this large
#: and the time scaled by its element count (the step is elementwise, so linear in the elements).
OPTIMIZER_SLICE_NUMEL = 1 << 24


def optimizer_step_s(params: list[nn.Parameter], settings: Settings, restore: bool = True,
                     slice_numel: int = OPTIMIZER_SLICE_NUMEL) -> float:
    """Median time of what a pipeline rank does to `params` once per step after the backward: scale the gradients
    by the microbatch count (torch's `scale_grads`), the optimizer's step, zero_grad; with a gradient per
    parameter, as after a backward. Parameters of more than `slice_numel` elements in all are not stepped
    themselves: the step is timed on a copy of their first `slice_numel` elements (one tensor) and scaled by
    numel / `slice_numel`, so its optimizer state stays bounded (an 8B model's 2 GB embedding would need 4 GB of
    Adam state). Otherwise the parameters themselves, restored afterwards when `restore`."""
    params = [p for p in params if p.requires_grad]
    numel = sum(p.numel() for p in params)
    if not params:
        return 0.0
    if numel > slice_numel:
        return _step_s([_leading(params, slice_numel)], settings) * numel / slice_numel
    saved = [p.detach().clone() for p in params] if restore else []
    try:
        return _step_s(params, settings)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def _leading(params: list[nn.Parameter], numel: int) -> nn.Parameter:
    """A new parameter holding the first `numel` elements of `params`, in order (their values: no denormals or NaN
    that would change CPU timings), in the dtype of the first."""
    flat = torch.empty(numel, dtype=params[0].dtype, device=params[0].device)
    at = 0
    with torch.no_grad():
        for p in params:
            n = min(p.numel(), numel - at)
            flat[at:at + n] = p.detach().reshape(-1)[:n]
            at += n
            if at == numel:
                break
    return nn.Parameter(flat)


def _step_s(params: list[nn.Parameter], settings: Settings) -> float:
    """Median time of the optimizer step of `optimizer_step_s` on `params` (their values change)."""
    optimizer = make_optimizer(settings.options.optimizer, params)

    def step() -> None:
        for p in params:
            p.grad.div_(2)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for timed in settings.budget.runs():
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        _, t = settings.timer.time(step)
        if timed:
            times.append(t)
    return statistics.median(times)


def _graph_text(graph: fx.Graph) -> str:
    """A graph's operations with the names of its submodules and attributes replaced by their order of first use, so
    that two blocks differing only in their names (`layers.0` / `layers.1`) give the same text; constants kept."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    names: dict[str, int] = {}
    lines = []
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr"):
            target: Any = names.setdefault(str(node.target), len(names))
        elif node.op == "placeholder":  # named after the value fed in (`add`, `add_2`): its position is enough
            target = ""
        else:
            target = getattr(node.target, "__qualname__", None) or str(node.target)
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: f"%{index[n]}")
        lines.append(f"{node.op} {target} {args!r}")
    return "\n".join(lines)


def _describe(value: Any) -> str:
    """Shapes, dtypes and gradient flags of the tensors in `value`; other values by repr."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.requires_grad}"
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    return repr(value)


def piece_key(module: nn.Module, args: tuple[Any, ...], originals: dict[str, nn.Module], extra: tuple[Any, ...]
              ) -> str:
    """Pieces with one key are measured once: the same operations (graph text of every submodule), types of the
    original modules owning its parameters (`originals`: the model's `named_modules()`), parameter and buffer shapes
    and dtypes, input shapes and dtypes, and `extra` (whether it is the last piece, which of its inputs need a
    gradient)."""
    parts = [_graph_text(g) for m in module.modules() if isinstance(g := getattr(m, "graph", None), fx.Graph)]
    parts += [type(originals.get(n.rpartition(".")[0], module)).__qualname__ for n, _ in module.named_parameters()]
    parts += [f"{tuple(t.shape)}{t.dtype}{t.requires_grad}" for t in list(module.parameters()) + list(module.buffers())]
    parts += [_describe(args), repr(extra)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def windows(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive indices grouped so that each group's `sizes` add up to at most `limit` (an index larger than
    `limit` alone is a group of its own)."""
    groups: list[list[int]] = []
    total = 0
    for i, n in enumerate(sizes):
        if not groups or total + n > limit:
            groups.append([])
            total = 0
        groups[-1].append(i)
        total += n
    return groups


def measure_pieces(mf: ModelFile, meta: MetaModel, units: list[Unit], b: int, settings: Settings, *,
                   limit_bytes: int, optimizer_per_piece: bool = False, head_slice_numel: int | None = None
                   ) -> SizeResult:
    """Measure every unit at microbatch size `b` (module docstring). At most `limit_bytes` of parameters and
    gradients are materialized at once (a window), besides a piece kept for the shared units after it; with
    `settings.measuring.measure_every_unit`, no piece shares another's measurement. With `head_slice_numel`, a head
    whose weight has more elements than that is measured on slices of its vocabulary (autopp.measure.head). Whatever
    is materialized is freed on return, also when a measurement raises."""
    if settings.overall is not None:
        settings.overall.next_phase()
    walk = _Walk(mf, meta, units, b, settings, limit_bytes, optimizer_per_piece, head_slice_numel)
    try:
        for _ in walk_split_graph(walk.gm, walk.inputs, walk.env, walk.measure):
            pass
    finally:
        walk.unload(sorted(walk.loaded))
    return walk.result()


class _Walk:
    """One walk of the split graph at one microbatch size: materializes the window a measured piece opens, measures
    it, runs shared pieces through their measured piece, and frees what no later piece needs."""

    def __init__(self, mf: ModelFile, meta: MetaModel, units: list[Unit], b: int, settings: Settings,
                 limit_bytes: int, optimizer_per_piece: bool, head_slice_numel: int | None = None) -> None:
        self.mf, self.meta, self.b, self.settings = mf, meta, b, settings
        self.names = [u.name for u in units]
        self.optimizer_per_piece = optimizer_per_piece
        self.inputs, self.target = settings.batch(mf, b)
        dtype = settings.options.torch_dtype
        self.pipe, self.spec, meta_inputs, _ = meta_pieces(
            mf, meta, [u.split_point for u in units[1:] if u.split_point], b, dtype)
        self.gm = self.pipe.split_gm
        calls = [n for n in self.gm.graph.nodes if n.op == "call_module"]
        self.index = {str(n.target): i for i, n in enumerate(calls)}
        self.modules = [self.gm.get_submodule(str(n.target)) for n in calls]
        self.grads = [tuple(not (isinstance(a, fx.Node) and source_piece(a, self.index) == -1) for a in n.args)
                      for n in calls]
        self.same_as = _shared(meta, self.gm, calls, self.modules, meta_inputs, self.grads,
                               settings.measuring.measure_every_unit)
        retarget(self.pipe, settings.timer.device)
        self.measured = [i for i in range(len(calls)) if self.same_as[i] is None]
        params = {i: static_bytes(self.modules[i], settings.options.optimizer, settings.options.recipe)["param_bytes"]
                  for i in self.measured}
        self.windows = [[self.measured[j] for j in group] for group in windows(
            [2 * params[i] for i in self.measured], limit_bytes)]
        self.weight = {i: params[i] + 1 for i in self.measured}  # the overall line's measure of a piece's work
        self.last_use = {r: max(i for i, s in enumerate(self.same_as) if s == r) for r in set(self.same_as)
                         if r is not None}
        self.tied = {u: g.bytes for g in tied_groups(meta.model, [u.modules for u in units]) for u in g.units
                     if len(g.units) > 1}
        self.env: dict[fx.Node, Any] = {}
        self.rows: dict[int, dict[str, Any]] = {}
        self.peaks: dict[int, int] = {}
        self.edges: dict[tuple[int, int], int] = defaultdict(int)
        self.loaded: set[int] = set()
        self.pending: dict[int, Piece] = {}
        self.opt: dict[int, float] = {}
        self.head: HeadSlice | None = None if head_slice_numel is None or self.same_as[-1] is not None else \
            find_head(self.modules[-1], meta.model, self.target, head_slice_numel)

    def span(self, i: int) -> tuple[float, float]:
        """Where the window of piece `i` begins in the walk, and its share of it, both by weight (`self.weight`); a
        shared piece's is that of the next measured piece (windows hold measured pieces in model order)."""
        total = sum(self.weight.values())
        group = next((w for w in self.windows if w[-1] >= i), None)
        if group is None:
            return 1.0, 0.0
        start = sum(n for j, n in self.weight.items() if j < group[0])
        return start / total, sum(self.weight[j] for j in group) / total

    def unload(self, pieces: list[int]) -> None:
        for j in pieces:
            self.meta.unload(self.modules[j])
            self.loaded.discard(j)

    def load_window(self, i: int) -> None:
        """Free what no later piece needs, then materialize the window that piece `i` opens."""
        group = next(w for w in self.windows if i in w)
        done = [j for j in sorted(self.loaded) if j not in group and self.last_use.get(j, j) < i]
        self.unload(done)
        if done:
            return_freed_memory()  # the next window starts from the process's baseline (allocator.py)
        for j in group:
            self.meta.load(self.modules[j], self.settings.timer.device, self.settings.options.torch_dtype)
            self.loaded.add(j)

    def measure(self, node: fx.Node, args: tuple[Any, ...]) -> Any:
        """Run piece `node` on `args` (walk_split_graph's callback), measuring it when it is not shared."""
        i = self.index[str(node.target)]
        n = len(self.modules)
        start, _ = self.span(i)
        self.settings.say(start, f"microbatch {self.b}: sizes of unit {i} of 0-{n - 1} ({self.names[i]})", i, n)
        for arg in node.all_input_nodes:
            src = source_piece(arg, self.index)
            if src is not None:
                self.edges[(src, i)] += value_bytes(self.env[arg])
        rep = self.same_as[i]
        last = i == n - 1
        if last and self.head is not None:
            return self._measure_head(i, node, args, self.head)
        if rep is None and i not in self.loaded:
            self.load_window(i)
        finish = (lambda out: self.mf.loss_fn(
            rebuild_output(self.spec, model_output(self.gm, self.env, node, out)), self.target)) \
            if last else (lambda out: out)
        piece = Piece(self.modules[i if rep is None else rep], args, finish, i == 0, self.grads[i])
        with torch.no_grad():
            out = piece.module(*piece.args)
        if rep is None:
            self._measure_own(i, piece, out)
        return out

    def _measure_head(self, i: int, node: fx.Node, args: tuple[Any, ...], head: HeadSlice) -> Any:
        """The last piece measured at each row count of `head` (its weight and targets sliced, autopp.measure.head;
        not timed at the middle one), its row, peak and step extrapolated to the whole vocabulary; returns the
        output on the largest slice."""
        found: list[dict[str, Any]] = []
        out = None
        for rows in head.rows:
            target = sliced_target(self.target, rows)
            with sliced_head(self.meta, self.modules[i], head, rows):
                self.load_window(i)
                try:
                    piece = Piece(self.modules[i], args, lambda o: self.mf.loss_fn(
                        rebuild_output(self.spec, model_output(self.gm, self.env, node, o)), target), i == 0,
                        self.grads[i])
                    with torch.no_grad():
                        out = piece.module(*piece.args)
                    self._measure_own(i, piece, out, timed=rows != head.rows[1])
                    found.append(dict(self.rows[i], peak=self.peaks[i], optimizer_step_s=self.opt.get(i, 0.0)))
                    self.opt.pop(i, None)
                finally:
                    self.unload([i])
            return_freed_memory()
        whole = extrapolate((found[0], found[1], found[2]), head)
        self.peaks[i], opt = whole.pop("peak"), whole.pop("optimizer_step_s")
        if self.optimizer_per_piece:
            self.opt[i] = opt
        self.rows[i] = whole
        return out

    def _measure_own(self, i: int, piece: Piece, out: Any, timed: bool = True) -> None:
        """Sizes and peak of a measured piece; once its window is complete, the window's times (and steps) when
        `timed`."""
        self.rows[i] = _sizes(piece, out, self.settings)
        self.rows[i].update(unit=i, microbatch_size=self.b, tied_param_bytes=self.tied.get(i, 0))
        self.peaks[i] = peak_bytes(self.settings.timer.device, piece.forward_backward)
        self.pending[i] = piece
        if i != next(w for w in self.windows if i in w)[-1]:
            return
        if timed:
            _time_window(self.pending, self.rows, self.b, self.settings, self.span(i), self.names)
        if self.optimizer_per_piece and timed:
            self.opt.update({j: optimizer_step_s(list(self.modules[j].parameters()), self.settings, restore=False)
                             for j in self.pending})
        for j in self.pending:  # measured: a piece kept for the shared ones after it needs no gradients
            self.modules[j].zero_grad(set_to_none=True)
        self.pending.clear()

    def result(self) -> SizeResult:
        """The rows (shared units copied from their measured one), edges, live values and steps of the walk."""
        rows = self.rows
        for i, rep in enumerate(self.same_as):
            if rep is not None:
                rows[i] = {**rows[rep], "unit": i, "tied_param_bytes": self.tied.get(i, 0)}
                self.peaks[i] = self.peaks[rep]
            rows[i].update(source="measured" if rep is None else "shared", same_as=-1 if rep is None else rep)
        live = live_values(self.pipe)
        by_name = {n.name: n for n in self.gm.graph.nodes}
        return SizeResult(
            [rows[i] for i in range(len(self.modules))],
            [{"src": s, "dst": d, "microbatch_size": self.b, "bytes": n} for (s, d), n in sorted(self.edges.items())],
            live, {v.name: value_bytes(self.env[by_name[v.name]]) for v in live}, self.peaks,
            sum(self.opt[i if rep is None else rep] for i, rep in enumerate(self.same_as)) if self.opt else 0.0,
            None if self.head is None else self.head.describe(len(self.modules) - 1))


def _shared(meta: MetaModel, gm: fx.GraphModule, calls: list[fx.Node], modules: list[nn.Module],
            meta_inputs: tuple[Any, ...], grads: list[tuple[bool, ...]], every_unit: bool) -> list[int | None]:
    """Per piece, the earlier piece whose measurement it shares (None: measured itself): the first with the same
    `piece_key`, its inputs' shapes taken from a walk of the split graph on meta inputs."""
    if every_unit:
        return [None] * len(calls)
    args_of: dict[int, tuple[Any, ...]] = {}
    index = {str(n.target): i for i, n in enumerate(calls)}

    def record(node: fx.Node, args: tuple[Any, ...]) -> Any:
        args_of[index[str(node.target)]] = args
        return gm.get_submodule(str(node.target))(*args)

    with torch.no_grad():
        for _ in walk_split_graph(gm, meta_inputs, {}, record):
            pass
    named = dict(meta.model.named_modules())
    first: dict[str, int] = {}
    out: list[int | None] = []
    for i, module in enumerate(modules):
        key = piece_key(module, args_of[i], named, (i == len(calls) - 1, grads[i]))
        rep = first.setdefault(key, i)
        out.append(None if rep == i else rep)
    return out


def _sizes(piece: Piece, out: Any, settings: Settings) -> dict[str, Any]:
    """Parameter, gradient, optimizer, saved-activation, output and recompute-keep bytes of one piece, and what it
    keeps under selective recomputation (`SavedOps`). `out`: what the piece's module returned (for the last piece the
    model's output, before the loss: what torch's last stage holds per in-flight microbatch)."""
    params = {storage_key(p) for p in piece.module.parameters()}
    row: dict[str, Any] = dict(static_bytes(piece.module, settings.options.optimizer, settings.options.recipe))
    _, saved = saved_bytes(lambda: piece.forward()[1], params)
    with SavedOps(params) as kept:
        piece.forward()
    row.update(activation_bytes=saved, output_bytes=value_bytes(out),
               recompute_keep_bytes=value_bytes(piece.args), selective_activation_bytes=kept.bytes)
    return row


def _time_window(pending: dict[int, Piece], rows: dict[int, dict[str, Any]], b: int, settings: Settings,
                 span: tuple[float, float], names: list[str]) -> None:
    """Time the pieces of one window together, in model order (autopp.measure.timing.time_pieces); `span`: where the
    window begins in the walk and its share of it (`_Walk.span`), for the progress line."""
    budget = settings.budget
    runs = budget.warmup + budget.repeats
    # The time budget is per unit; a run times every unit of the window.
    per_run = Budget(budget.warmup, budget.repeats,
                     None if budget.seconds is None else budget.seconds * len(pending), budget.now)
    order = sorted(pending)
    what = f"units {order[0]}-{order[-1]}" if len(order) > 1 else f"unit {order[0]} ({names[order[0]]})"
    samples = time_pieces([pending[i] for i in order], per_run, settings.timer, lambda r: settings.say(
        span[0] + span[1] * r / runs, f"microbatch {b}: {what}: timing run {r + 1}/{runs} ({budget.warmup} warm-up)",
        r, runs))
    for i, piece_samples in zip(order, samples):
        rows[i].update(summarize(piece_samples))

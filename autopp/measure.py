"""Measure each unit of a model (forward, backward split into input and weight gradients, recompute; parameter,
activation and boundary bytes) into a Profile, and compare the units' sum with one whole-model step."""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import pandas as pd
import torch
from torch import fx, nn
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from .allocator import keep_freed_memory
from .corun import co_running
from .modelfile import ModelFile, Unit, check_forward, discover_units, fingerprint, load_model_file
from .profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from .split import (LiveValue, live_values, output_spec, rebuild_output, source_piece, split_model, tied_groups,
                    walk_split_graph)

__all__ = ["OPTIMIZER_STATES", "DTYPES", "Clock", "profile_model", "tensors_in", "storage_bytes"]

#: Optimizer state kept per parameter, in multiples of the parameter's element count (fp32 states).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}
#: Parameter dtypes that can be profiled; below float32, an fp32 master copy is counted with the optimizer state.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}

Progress = Callable[[str], None]
#: Kinds of timed sample kept per unit: forward, full backward, input-gradient, weight-gradient, forward without saving.
KINDS = ("forward", "backward", "backward_input", "backward_weight", "recompute")


def tensors_in(value: Any) -> list[torch.Tensor]:
    """All tensors in a (nested) tuple/list/dict value."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors_in(v)]
    return []


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: set[int] = frozenset()) -> int:  # type: ignore[assignment]
    """Bytes of the distinct storages behind `tensors`, each counted once, skipping storages in `exclude`."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _leaf_inputs(values: tuple[Any, ...], grad: Sequence[bool] | None = None) -> tuple[Any, ...]:
    """Detached copies of the inputs; floating-point ones require grad, like a received pipeline activation, unless
    `grad` says otherwise (the model's own inputs need no gradient)."""
    def leaf(v: Any, g: bool) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(g and v.is_floating_point())
        return v
    return tuple(leaf(v, grad[i] if grad is not None else True) for i, v in enumerate(values))


def _saved_bytes(run: Callable[[], Any], params: set[int]) -> int:
    """Bytes autograd saves for backward while `run()` executes, parameters excluded, shared storage once."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    del out
    return storage_bytes(saved, exclude=params)


Clock = Callable[[], float]
"""Seconds from an arbitrary origin (time.perf_counter; tests inject a fake one that the model advances)."""


@dataclass
class _Clock:
    """Times a call: with `now` (the wall clock by default) on CPU; CUDA events (and a synchronize) on a GPU unless
    a clock was injected."""

    device: torch.device
    now: Clock | None = None
    """An injected clock; None: time.perf_counter, or CUDA events on a GPU."""

    def time(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self.device.type == "cuda" and self.now is None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            torch.cuda.synchronize(self.device)
            return result, start.elapsed_time(end) / 1e3
        now = self.now or time.perf_counter
        t0 = now()
        result = fn()
        return result, now() - t0


@dataclass(frozen=True)
class _Budget:
    """How many times to run: `warmup` untimed, then timed until `repeats` runs or `seconds` spent (at least 1)."""

    warmup: int
    repeats: int
    seconds: float | None = None
    now: Clock = time.perf_counter
    """The clock that `seconds` is measured on (the timings' clock)."""

    def runs(self) -> Iterable[bool]:
        """Yields True for each timed run, False for each warm-up run."""
        for _ in range(self.warmup):
            yield False
        start = self.now()
        for i in range(self.repeats):
            if i and self.seconds is not None and self.now() - start >= self.seconds:
                return
            yield True


@dataclass
class _Piece:
    """One unit's piece of the split model, with its real inputs and how to turn its output into what backward needs."""

    module: nn.Module
    args: tuple[Any, ...]
    finish: Callable[[Any], Any]  # output -> loss for the last unit, identity otherwise
    first: bool
    grad: tuple[bool, ...]  # per argument: whether it is an activation (needs a gradient) or a model input

    def forward(self) -> tuple[tuple[Any, ...], Any]:
        leaves = _leaf_inputs(self.args, self.grad)
        return leaves, self.finish(self.module(*leaves))


def _outputs_and_grads(out: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    outs = [t for t in tensors_in(out) if t.requires_grad]
    return outs, [torch.ones_like(t) for t in outs]


def _backward(outs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if outs:
        torch.autograd.backward(outs, grads)


def _input_then_weight(piece: _Piece, leaves: tuple[Any, ...], out: Any) -> bool:
    """Whether the piece's backward splits into input then weight gradients: like torch's first stage, a unit none
    of whose inputs needs a gradient runs one full backward, counted as weight time."""
    return not (piece.first or not _outputs_and_grads(out)[0]
                or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves))


def _time_pieces(pieces: Sequence[_Piece], budget: _Budget, clock: _Clock, progress: Callable[[int], None]
                 ) -> list[dict[str, list[float]]]:
    """Timed samples of each kind in KINDS, per piece. Each run times every piece in model order, as a pipeline
    stage runs them: forward through all pieces then full backward in reverse order; forward again, then
    input-gradient backward in reverse order (torch's `stage_backward_input`, graph kept), then weight-gradient
    backward in reverse order (`stage_backward_weight`), as zero-bubble schedules compute them; then forward
    without grad (recompute). Timing the pieces one after another rather than each in a loop of its own leaves the
    caches as a pipeline stage finds them: a unit timed in a tight loop finds its weights in the last-level cache,
    which a stage running the model's other units in between does not (examples/mlp.py: sum of forwards 0.8 ms in
    tight loops vs 3.4 ms with the cache flushed, at microbatch 2 on a 32 MiB L3)."""
    samples: list[dict[str, list[float]]] = [{k: [] for k in KINDS} for _ in pieces]
    n = len(pieces)
    for run, timed in enumerate(budget.runs()):
        progress(run)

        def keep(i: int, kind: str, value: float) -> None:
            if timed:
                samples[i][kind].append(value)

        forwards = []
        for i, piece in enumerate(pieces):
            forward, f = clock.time(piece.forward)
            keep(i, "forward", f)
            forwards.append(forward)
        for i in reversed(range(n)):
            outs, grads = _outputs_and_grads(forwards[i][1])
            keep(i, "backward", clock.time(lambda: _backward(outs, grads))[1])
        forwards = [piece.forward() for piece in pieces]
        groups: dict[int, Any] = {}
        for i in reversed(range(n)):
            (leaves, out), piece = forwards[i], pieces[i]
            outs, grads = _outputs_and_grads(out)
            if not _input_then_weight(piece, leaves, out):
                keep(i, "backward_input", 0.0)
                keep(i, "backward_weight", clock.time(lambda: _backward(outs, grads))[1])
                continue
            params = list(piece.module.parameters())
            (_, groups[i]), t = clock.time(lambda: stage_backward_input(outs, grads, list(leaves), iter(params)))
            keep(i, "backward_input", t)
        for i in reversed(sorted(groups)):
            params = list(pieces[i].module.parameters())
            keep(i, "backward_weight", clock.time(lambda: stage_backward_weight(iter(params), groups[i]))[1])
        forwards, groups = [], {}  # free the graphs before the no-grad forwards
        with torch.no_grad():
            for i, piece in enumerate(pieces):
                keep(i, "recompute", clock.time(piece.forward)[1])
    return samples


def _summary(samples: dict[str, list[float]]) -> dict[str, float]:
    row = {}
    for kind, values in samples.items():
        row[f"{kind}_s"] = statistics.median(values)
        row[f"{kind}_spread_s"] = max(values) - min(values)
    return row


def _peak_bytes(piece: _Piece, clock: _Clock) -> int | None:
    """On CUDA: the most memory allocated during one forward and backward, above what was allocated before."""
    if clock.device.type != "cuda":
        return None
    torch.cuda.synchronize(clock.device)
    torch.cuda.reset_peak_memory_stats(clock.device)
    before = torch.cuda.memory_allocated(clock.device)
    _, out = piece.forward()
    _backward(*_outputs_and_grads(out))
    torch.cuda.synchronize(clock.device)
    return int(torch.cuda.max_memory_allocated(clock.device) - before)


@dataclass
class _Settings:
    """What profile_model was asked for, passed down to the per-size measurement."""

    optimizer: str
    dtype: torch.dtype
    budget: _Budget
    clock: _Clock
    progress: Progress
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    co_runners: int = 0
    """Processes training the model beside the timing (autopp.corun), as other ranks on one host do."""

    def beside(self, mf: ModelFile, b: int) -> Any:
        """Context for the timings at microbatch `b`: with `co_runners` processes training the model at `b`."""
        name = next(k for k, v in DTYPES.items() if v == self.dtype)
        return co_running(mf.path, b, name, self.co_runners)


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype) if value.is_floating_point() else value.to(device)
    if isinstance(value, tuple):
        return tuple(_to(v, device, dtype) for v in value)
    return value


def _static_bytes(module: nn.Module, settings: _Settings) -> dict[str, int]:
    params = list(module.parameters())
    numel = sum(p.numel() for p in params if p.requires_grad)
    master = 4 * numel if settings.dtype != torch.float32 else 0
    return {"param_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
            "optimizer_bytes": OPTIMIZER_STATES[settings.optimizer] * 4 * numel + master}


def _measure_size(mf: ModelFile, model: nn.Module, units: list[Unit], b: int, settings: _Settings
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[LiveValue], dict[str, int]]:
    """Unit rows, edge rows, live values and their bytes (by split-graph name) at microbatch size `b`."""
    inputs, target = _to(mf.sample_batch(b), settings.clock.device, settings.dtype)
    pipe = split_model(model, inputs, [u.split_point for u in units[1:] if u.split_point is not None])
    spec = output_spec(model, inputs)
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    tied = {u: g.bytes for g in tied_groups(model, [u.modules for u in units]) for u in g.units if len(g.units) > 1}
    env: dict[fx.Node, Any] = {}
    rows: list[dict[str, Any]] = []
    pieces: list[_Piece] = []
    edges: dict[tuple[int, int], int] = defaultdict(int)

    def measure(node: fx.Node, args: tuple[Any, ...]) -> Any:
        i = piece_index[str(node.target)]
        settings.progress(_bar(i, len(calls), f"microbatch {b}: sizes of unit {i + 1}/{len(calls)}"))
        for arg in node.all_input_nodes:
            src = source_piece(arg, piece_index)
            if src is not None:
                edges[(src, i)] += storage_bytes(tensors_in(env[arg]))
        module = gm.get_submodule(str(node.target))
        last = i == len(calls) - 1
        finish = (lambda out: mf.loss_fn(rebuild_output(spec, _model_output(gm, env, node, out)), target)) \
            if last else (lambda out: out)
        grad = tuple(not (isinstance(a, fx.Node) and source_piece(a, piece_index) == -1) for a in node.args)
        piece = _Piece(module, args, finish, i == 0, grad)
        pieces.append(piece)
        row: dict[str, Any] = {"unit": i, "microbatch_size": b}
        params = {p.untyped_storage().data_ptr() for p in module.parameters()}
        with torch.no_grad():
            out = module(*piece.args)
        row.update(_static_bytes(module, settings))
        row.update(tied_param_bytes=tied.get(i, 0),
                   activation_bytes=_saved_bytes(lambda: piece.forward()[1], params),
                   output_bytes=0 if last else storage_bytes(tensors_in(out)),
                   recompute_keep_bytes=storage_bytes(tensors_in(piece.args)))
        peak = _peak_bytes(piece, settings.clock)
        if peak is not None:
            settings.peaks.setdefault(str(i), {})[str(b)] = peak
        rows.append(row)
        return out

    for _ in walk_split_graph(gm, inputs, env, measure):
        pass
    budget = settings.budget
    runs = budget.warmup + budget.repeats
    # The time budget is per unit; a run times every unit.
    per_run = _Budget(budget.warmup, budget.repeats, None if budget.seconds is None else budget.seconds * len(pieces),
                      budget.now)
    samples = _time_pieces(pieces, per_run, settings.clock, lambda r: settings.progress(
        _bar(r, runs, f"microbatch {b}: timing run {r + 1}/{runs} ({budget.warmup} warm-up)")))
    for row, piece_samples in zip(rows, samples):
        row.update(_summary(piece_samples))
    live = live_values(pipe)
    by_name = {n.name: n for n in gm.graph.nodes}
    value_bytes = {v.name: storage_bytes(tensors_in(env[by_name[v.name]])) for v in live}
    edge_rows = [{"src": s, "dst": d, "microbatch_size": b, "bytes": n} for (s, d), n in sorted(edges.items())]
    return rows, edge_rows, live, value_bytes


def _model_output(gm: fx.GraphModule, env: dict[fx.Node, Any], last: fx.Node, out: Any) -> Any:
    """The split graph's output with `out` as the last piece's value: an encoder-decoder model also returns the
    encoder's output (T5's `encoder_last_hidden_state`), which an earlier piece made, so the last piece alone does
    not hold every tensor of the model's output."""
    def value(node: fx.Node) -> Any:
        if node is last:
            return out
        if node.op == "call_function":
            return node.target(*fx.node.map_arg(node.args, value))  # type: ignore[operator]
        return env[node]
    result = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return fx.node.map_arg(result, value)


def _bar(done: int, total: int, text: str, width: int = 20) -> str:
    filled = width * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {text}"


def _whole_model(mf: ModelFile, model: nn.Module, b: int, settings: _Settings) -> float:
    """Median time of one forward, loss and backward of the unsplit model on a microbatch of `b`."""
    inputs, target = _to(mf.sample_batch(b), settings.clock.device, settings.dtype)
    times = []
    for timed in settings.budget.runs():
        _, t = settings.clock.time(lambda: mf.loss_fn(model(*inputs), target).backward())
        if timed:
            times.append(t)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _optimizer(name: str, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return (torch.optim.Adam if name == "adam" else torch.optim.AdamW)(params, lr=1e-3)


def _optimizer_step(model: nn.Module, settings: _Settings) -> float:
    """Median time of what a pipeline rank does to its parameters once per step after the backward: scale the
    gradients by the microbatch count (torch's `scale_grads`), the optimizer's step, zero_grad; over the whole
    model, with gradients present as after a backward. The model's parameters are restored afterwards."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    optimizer = _optimizer(settings.optimizer, params)

    def step() -> None:
        for p in params:
            p.grad.div_(2)  # type: ignore[union-attr]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for timed in settings.budget.runs():
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        _, t = settings.clock.time(step)
        if timed:
            times.append(t)
    with torch.no_grad():
        for p, s in zip(params, saved):
            p.copy_(s)
    return statistics.median(times)


def _live_meta(live: list[LiveValue], bytes_by_size: dict[int, dict[str, int]]) -> list[dict[str, Any]]:
    """The live values of the split graph: producer, readers, what a runner should do with each, bytes per size."""
    out = []
    for v in live:
        action = "recompute" if v.recomputable else ("relay" if v.relayed_over else "send")
        out.append({"name": v.name, "src": v.src, "dsts": list(v.dsts), "action": action,
                    "relayed_over": list(v.relayed_over), "needs_grad": v.needs_grad, "reads": list(v.reads),
                    "bytes": {str(b): sizes.get(v.name, 0) for b, sizes in sorted(bytes_by_size.items())}})
    return out


def profile_model(path: str | Path, microbatch_sizes: Iterable[int] = (1, 4), optimizer: str = "sgd",
                  warmup: int = 2, repeats: int = 5, threads: int = 1,
                  progress: Progress = lambda _msg: None, time_budget_s: float | None = None,
                  dtype: str = "float32", device: str = "cpu", compare_whole: bool = True, co_runners: int = 0,
                  clock: Clock | None = None) -> Profile:
    """Profile the model file at `path`: per-unit medians of up to `repeats` timed runs after `warmup` (stopping
    early once `time_budget_s` is spent on a unit), then one whole-model step to check the units add up. With
    `co_runners`, that many processes train the model beside every timing (autopp.corun): the other pipeline ranks
    of a CPU host, which share its memory bus and caches. Every time (and the time budget) is read from `clock`
    (default: time.perf_counter on CPU, CUDA events on a GPU); tests pass a fake clock to get exact times."""
    sizes = sorted(set(int(b) for b in microbatch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"microbatch sizes must be positive integers, got {sizes}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if co_runners < 0:
        raise ValueError(f"co_runners must be >= 0, got {co_runners}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch.cuda.is_available() is False")
    torch.set_num_threads(threads)
    allocator = keep_freed_memory()
    dev = torch.device(device)
    mf = load_model_file(path)
    model = mf.build()
    check_forward(mf, model)
    units = discover_units(mf, model)
    if len(units) < 2:
        raise mf.error(f"found {len(units)} unit(s); a pipeline needs >= 2: define SPLIT_POINTS (see README.md)")
    model_fingerprint = fingerprint(model, units)
    model = model.to(dev, DTYPES[dtype])
    budget = _Budget(warmup, repeats, time_budget_s, clock or time.perf_counter)
    settings = _Settings(optimizer, DTYPES[dtype], budget, _Clock(dev, clock), progress, co_runners=co_runners)
    rows: list[dict[str, Any]] = []
    edge_rows: list[dict[str, Any]] = []
    value_bytes: dict[int, dict[str, int]] = {}
    live: list[LiveValue] = []
    whole = []
    optimizer_step_s = 0.0
    for b in sizes:
        with settings.beside(mf, b):  # one start of the co-runners per size, for everything timed at that size
            r, e, at_b, value_bytes[b] = _measure_size(mf, model, units, b, settings)
            if compare_whole:
                progress(_bar(1, 1, f"microbatch {b}: whole model"))
                units_s = sum(row["forward_s"] + row["backward_s"] for row in r)
                whole_s = _whole_model(mf, model, b, settings)
                whole.append({"microbatch_size": b, "whole_s": whole_s, "units_s": units_s,
                              "gap": units_s / whole_s - 1})
            if b == sizes[0]:
                progress(_bar(1, 1, "optimizer step"))
                optimizer_step_s = _optimizer_step(model, settings)
        live = live or at_b
        rows += r
        edge_rows += e
    table = pd.DataFrame(rows)
    table.insert(1, "name", [units[i].name for i in table.unit])
    table.insert(2, "modules", [" ".join(units[i].modules) for i in table.unit])
    extra: dict[str, Any] = {"allocator": allocator}
    if settings.peaks:
        extra["cuda_peak_bytes"] = settings.peaks
    meta = ProfileMeta(
        model_path=str(mf.path), fingerprint=model_fingerprint,
        unit_names=tuple(u.name for u in units), split_points=tuple(u.split_point or "" for u in units[1:]),
        microbatch_sizes=tuple(sizes), device=_describe_device(dev), torch_version=torch.__version__,
        num_threads=threads, optimizer=optimizer, repeats=repeats, warmup=warmup, extra=extra,
        dtype=dtype, time_budget_s=time_budget_s, whole_model=tuple(whole), optimizer_step_s=optimizer_step_s,
        co_runners=co_runners,
        live_values=tuple(_live_meta(live, value_bytes)),
        tied_parameters=tuple({"names": list(g.names), "units": list(g.units), "bytes": g.bytes}
                              for g in tied_groups(model, [u.modules for u in units])))
    return Profile(meta, table[list(UNIT_COLUMNS)], pd.DataFrame(edge_rows, columns=list(EDGE_COLUMNS)))


def _describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({platform.processor() or platform.machine()})"

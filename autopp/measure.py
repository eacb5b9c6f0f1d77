"""Measure each unit of a model (forward and backward time, parameter, activation and boundary bytes) into a Profile."""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
import torch
from torch import fx, nn

from .modelfile import ModelFile, check_forward, discover_units, fingerprint, load_model_file
from .profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from .split import split_model

__all__ = ["OPTIMIZER_STATES", "profile_model", "tensors_in", "storage_bytes"]

#: Optimizer state kept per parameter, in multiples of the parameter's bytes (fp32 states).
OPTIMIZER_STATES: dict[str, int] = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}

Progress = Callable[[str], None]


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


def _leaf_inputs(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """Detached copies of the inputs; floating-point ones require grad, like a received pipeline activation."""
    def leaf(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().requires_grad_(v.is_floating_point())
        return v
    return tuple(leaf(v) for v in values)


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


def _time_unit(run: Callable[[], Any], warmup: int, repeats: int) -> tuple[list[float], list[float]]:
    """Forward and backward wall times of `repeats` runs after `warmup` runs."""
    fwd: list[float] = []
    bwd: list[float] = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        outs = [t for t in tensors_in(out) if t.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return fwd, bwd


def _source(node: fx.Node, piece_index: dict[str, int]) -> int | None:
    """The piece (or -1 for a model input) that produced `node`, following getitem."""
    while node.op == "call_function":
        node = node.args[0]  # type: ignore[assignment]
    if node.op == "placeholder":
        return -1
    return piece_index.get(str(node.target))


def _measure_size(mf: ModelFile, model: nn.Module, points: list[str], b: int, optimizer: str,
                  warmup: int, repeats: int, progress: Progress) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    inputs, target = mf.sample_batch(b)
    pipe = split_model(model, inputs, points)
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    unit_rows: list[dict[str, Any]] = []
    edges: dict[tuple[int, int], int] = defaultdict(int)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(placeholders)
        elif node.op == "call_function":
            env[node] = node.target(*fx.node.map_arg(node.args, lambda a: env[a]))  # type: ignore[operator]
        elif node.op == "call_module":
            i = piece_index[str(node.target)]
            progress(f"microbatch {b}: unit {i + 1}/{len(calls)}")
            args = fx.node.map_arg(node.args, lambda a: env[a])
            for arg in node.all_input_nodes:
                src = _source(arg, piece_index)
                if src is not None:
                    edges[(src, i)] += storage_bytes(tensors_in(env[arg]))
            piece = gm.get_submodule(str(node.target))
            last = i == len(calls) - 1
            run = lambda: _run_piece(piece, args, last, mf, target)  # noqa: E731
            fwd, bwd = _time_unit(run, warmup, repeats)
            params = {p.untyped_storage().data_ptr() for p in piece.parameters()}
            with torch.no_grad():
                out = piece(*args)
            env[node] = out
            param_bytes = sum(p.numel() * p.element_size() for p in piece.parameters())
            grad_bytes = sum(p.numel() * p.element_size() for p in piece.parameters() if p.requires_grad)
            unit_rows.append({
                "unit": i, "microbatch_size": b,
                "forward_s": statistics.median(fwd), "forward_spread_s": max(fwd) - min(fwd),
                "backward_s": statistics.median(bwd), "backward_spread_s": max(bwd) - min(bwd),
                "param_bytes": param_bytes, "grad_bytes": grad_bytes,
                "optimizer_bytes": OPTIMIZER_STATES[optimizer] * grad_bytes,
                "activation_bytes": _saved_bytes(run, params),
                "output_bytes": 0 if last else storage_bytes(tensors_in(out)),
            })
    edge_rows = [{"src": s, "dst": d, "microbatch_size": b, "bytes": n} for (s, d), n in sorted(edges.items())]
    return unit_rows, edge_rows


def _run_piece(piece: nn.Module, args: tuple[Any, ...], last: bool, mf: ModelFile, target: Any) -> Any:
    out = piece(*_leaf_inputs(args))
    return mf.loss_fn(out, target) if last else out


def profile_model(path: str | Path, microbatch_sizes: Iterable[int] = (1, 4), optimizer: str = "sgd",
                  warmup: int = 2, repeats: int = 5, threads: int = 1,
                  progress: Progress = lambda _msg: None) -> Profile:
    """Profile the model file at `path`: per-unit medians of `repeats` timed runs after `warmup`, on CPU."""
    sizes = sorted(set(int(b) for b in microbatch_sizes))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"microbatch sizes must be positive integers, got {sizes}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}")
    torch.set_num_threads(threads)
    mf = load_model_file(path)
    model = mf.build()
    check_forward(mf, model)
    units = discover_units(mf, model)
    if len(units) < 2:
        raise mf.error(f"found {len(units)} unit(s); a pipeline needs >= 2: define SPLIT_POINTS (see README.md)")
    points = [u.split_point for u in units[1:] if u.split_point is not None]
    rows: list[dict[str, Any]] = []
    edge_rows: list[dict[str, Any]] = []
    for b in sizes:
        r, e = _measure_size(mf, model, points, b, optimizer, warmup, repeats, progress)
        rows += r
        edge_rows += e
    table = pd.DataFrame(rows)
    table.insert(1, "name", [units[i].name for i in table.unit])
    table.insert(2, "modules", [" ".join(units[i].modules) for i in table.unit])
    meta = ProfileMeta(
        model_path=str(mf.path), fingerprint=fingerprint(model, units),
        unit_names=tuple(u.name for u in units), split_points=tuple(points), microbatch_sizes=tuple(sizes),
        device=f"cpu ({platform.processor() or platform.machine()})", torch_version=torch.__version__,
        num_threads=threads, optimizer=optimizer, repeats=repeats, warmup=warmup)
    return Profile(meta, table[list(UNIT_COLUMNS)], pd.DataFrame(edge_rows, columns=list(EDGE_COLUMNS)))

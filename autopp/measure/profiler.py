"""Measure each unit of a model (forward, backward split into input and weight gradients, recompute; parameter,
activation and boundary bytes) into a Profile, and compare the units' sum with one whole-model step."""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch
from torch import nn

from ..model.contract import ModelFile, check_forward, load_model_file
from ..model.split import LiveValue, tied_groups
from ..model.units import discover_units, fingerprint
from ..data.profile import EDGE_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from .allocator import keep_freed_memory
from .options import DTYPES, OPTIMIZER_STATES, make_optimizer
from .pieces import measure_pieces
from .settings import Progress, Settings, progress_bar
from .timing import Budget, Clock, Timer

__all__ = ["profile_model"]


def _whole_model(mf: ModelFile, model: nn.Module, b: int, settings: Settings) -> float:
    """Median time of one forward, loss and backward of the unsplit model on a microbatch of `b`."""
    inputs, target = settings.batch(mf, b)
    times = []
    for timed in settings.budget.runs():
        _, t = settings.clock.time(lambda: mf.loss_fn(model(*inputs), target).backward())
        if timed:
            times.append(t)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def _optimizer_step(model: nn.Module, settings: Settings) -> float:
    """Median time of what a pipeline rank does to its parameters once per step after the backward: scale the
    gradients by the microbatch count (torch's `scale_grads`), the optimizer's step, zero_grad; over the whole
    model, with gradients present as after a backward. The model's parameters are restored afterwards."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    optimizer = make_optimizer(settings.optimizer, params)

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


def _live_meta(live: list[LiveValue], bytes_by_size: dict[int, dict[str, int]]) -> list[LiveValue]:
    """The live values of the split graph with their bytes at each microbatch size."""
    return [replace(v, bytes={b: sizes.get(v.name, 0) for b, sizes in sorted(bytes_by_size.items())}) for v in live]


def profile_model(path: str | Path, microbatch_sizes: Iterable[int] = (1, 4), optimizer: str = "sgd",
                  warmup: int = 2, repeats: int = 5, threads: int = 1,
                  progress: Progress = lambda _msg: None, time_budget_s: float | None = None,
                  dtype: str = "float32", device: str = "cpu", compare_whole: bool = True, co_runners: int = 0,
                  clock: Clock | None = None) -> Profile:
    """Profile the model file at `path`: per-unit medians of up to `repeats` timed runs after `warmup` (stopping
    early once `time_budget_s` is spent on a unit), then one whole-model step to check the units add up. With
    `co_runners`, that many processes train the model beside every timing (autopp.measure.corun): the other
    pipeline ranks of a CPU host, which share its memory bus and caches. Every time (and the time budget) is read from `clock`
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
    budget = Budget(warmup, repeats, time_budget_s, clock or time.perf_counter)
    settings = Settings(optimizer, DTYPES[dtype], budget, Timer(dev, clock), progress, co_runners=co_runners)
    rows: list[dict[str, Any]] = []
    edge_rows: list[dict[str, Any]] = []
    value_bytes: dict[int, dict[str, int]] = {}
    live: list[LiveValue] = []
    whole = []
    optimizer_step_s = 0.0
    for b in sizes:
        with settings.beside(mf, b):  # one start of the co-runners per size, for everything timed at that size
            r, e, at_b, value_bytes[b] = measure_pieces(mf, model, units, b, settings)
            if compare_whole:
                progress(progress_bar(1, 1, f"microbatch {b}: whole model"))
                units_s = sum(row["forward_s"] + row["backward_s"] for row in r)
                whole_s = _whole_model(mf, model, b, settings)
                whole.append({"microbatch_size": b, "whole_s": whole_s, "units_s": units_s,
                              "gap": units_s / whole_s - 1})
            if b == sizes[0]:
                progress(progress_bar(1, 1, "optimizer step"))
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
        tied_parameters=tuple(tied_groups(model, [u.modules for u in units])))
    return Profile(meta, table[list(UNIT_COLUMNS)], pd.DataFrame(edge_rows, columns=list(EDGE_COLUMNS)))


def _describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({platform.processor() or platform.machine()})"

"""Measure each unit of a model (forward, backward split into input and weight gradients, recompute; parameter,
activation and boundary bytes) into a Profile, and compare the units' sum with one whole-model step."""

from __future__ import annotations

import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
import torch
from torch import nn

from ..model.contract import ModelFile, load_model_file
from ..model.meta import MetaModel, build_units
from ..model.split import LiveValue, tied_groups
from ..model.units import Unit
from ..data.profile import EDGE_COLUMNS, OPTIONAL_UNIT_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from .allocator import keep_freed_memory, release_large_allocations
from .memory import PEAK_HOW
from .options import DTYPES, check_options
from .pieces import SizeResult, measure_pieces
from .pieces import optimizer_step_s as optimizer_step_s_of
from .settings import Progress, Settings, progress_bar
from .timing import Budget, Clock, Timer
from .tp_rows import measured_tp_rows, tp_meta, tp_setup

__all__ = ["profile_model", "physical_memory_bytes"]

log = logging.getLogger(__name__)


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


def _live_meta(live: list[LiveValue], bytes_by_size: dict[int, dict[str, int]]) -> list[LiveValue]:
    """The live values of the split graph with their bytes at each microbatch size."""
    return [replace(v, bytes={b: sizes.get(v.name, 0) for b, sizes in sorted(bytes_by_size.items())}) for v in live]


def physical_memory_bytes() -> int:
    """This machine's physical memory (sysconf)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _check_args(sizes: list[int], optimizer: str, dtype: str, co_runners: int, device: str) -> None:
    check_options(sizes, optimizer, dtype)
    if co_runners < 0:
        raise ValueError(f"co_runners must be >= 0, got {co_runners}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch.cuda.is_available() is False")


def _whole_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Parameters and their gradients of the whole model in `dtype` (a tied weight once)."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in model.parameters())


def profile_model(path: str | Path | ModelFile, microbatch_sizes: Iterable[int] = (1, 4), optimizer: str = "sgd",
                  warmup: int = 2, repeats: int = 5, threads: int = 1,
                  progress: Progress = lambda _msg: None, time_budget_s: float | None = None,
                  dtype: str = "float32", device: str = "cpu", compare_whole: bool = True, co_runners: int = 0,
                  clock: Clock | None = None, measure_every_unit: bool = False,
                  memory_limit_bytes: int | None = None, tp_degrees: Iterable[int] = ()) -> Profile:
    """Profile the model file at `path` (or a loaded one, e.g. built from an HF config): per-unit medians of up to
    `repeats` timed runs after `warmup` (stopping early once `time_budget_s` is spent on a unit), then one
    whole-model step to check the units add up. With `co_runners`, that many processes train the model beside every
    timing (autopp.measure.corun): the other pipeline ranks of a CPU host, which share its memory bus and caches.
    Every time (and the time budget) is read from `clock` (default: time.perf_counter on CPU, CUDA events on a
    GPU); tests pass a fake clock to get exact times.

    The model is built on the meta device (autopp.model.meta) and never materialized whole unless its parameters
    and gradients fit in `memory_limit_bytes` (default: a quarter of physical memory). When they fit, the pieces
    are materialized together and timed together as before; else one piece at a time. The whole-model comparison,
    the whole-model optimizer step and co-runners need the whole model: without it the comparison is skipped
    (logged and recorded in `extra.whole_model_skipped`), the optimizer step is the sum of the pieces' steps, and
    co-runners are refused. An optimizer step over more than `OPTIMIZER_SLICE_NUMEL` elements is timed on a slice
    and scaled (autopp.measure.pieces.optimizer_step_s). Units of one structure and input shapes are measured once
    (`source` "shared", `same_as`) unless `measure_every_unit`. With `tp_degrees` (each >= 2), the profile gets
    tp.csv rows too (autopp.measure.tp_rows): per degree, tensor-parallel rank 0's local shard measured like the
    units, and each unit's TP collectives counted; the model needs a TP plan (autopp.model.tp)."""
    sizes = sorted(set(int(b) for b in microbatch_sizes))
    _check_args(sizes, optimizer, dtype, co_runners, device)
    torch.set_num_threads(threads)
    allocator = keep_freed_memory()
    dev = torch.device(device)
    mf = path if isinstance(path, ModelFile) else load_model_file(path)
    meta, units, model_fingerprint = build_units(mf, DTYPES[dtype])
    tp = tp_setup(mf, meta.model, tp_degrees)  # before measuring: a bad plan or degree fails at once
    limit = physical_memory_bytes() // 4 if memory_limit_bytes is None else memory_limit_bytes
    whole_bytes = _whole_bytes(meta.model, DTYPES[dtype])
    fits = whole_bytes <= limit
    if not fits:  # one unit at a time: a freed unit's large tensors must not stay resident (allocator.py)
        allocator = release_large_allocations()
    if co_runners and not fits:
        raise mf.error(f"--co-runners {co_runners} needs the whole model in each co-runner, but its parameters and "
                       f"gradients take {whole_bytes} bytes > the limit of {limit} bytes (a quarter of physical "
                       f"memory): profile with --co-runners 0")
    budget = Budget(warmup, repeats, time_budget_s, clock or time.perf_counter)
    settings = Settings(optimizer, DTYPES[dtype], budget, Timer(dev, clock), progress, co_runners=co_runners)
    found = _Found({"allocator": allocator})
    if not fits and compare_whole:
        found.extra["whole_model_skipped"] = (f"parameters and gradients {whole_bytes} bytes > limit {limit} bytes "
                                              f"(a quarter of physical memory): not materialized whole")
        log.info("whole-model comparison skipped: %s", found.extra["whole_model_skipped"])
    for b in sizes:
        with settings.beside(mf, b):  # one start of the co-runners per size, for everything timed at that size
            at_b = measure_pieces(mf, meta, units, b, settings, limit_bytes=limit if fits else 0,
                                  every_unit=measure_every_unit, optimizer_per_piece=not fits and b == sizes[0])
            if not fits and b == sizes[0]:
                found.optimizer_step_s = at_b.optimizer_step_s
            if fits and (compare_whole or b == sizes[0]):
                _on_the_whole_model(mf, meta, at_b, b, settings, found, compare_whole, b == sizes[0])
        found.add(b, at_b)
    tp_units = measured_tp_rows(mf, meta, units, tp, sizes, settings, limit if fits else 0, measure_every_unit)
    found.extra.update(peak_bytes=found.peaks, peak_bytes_how=PEAK_HOW[dev.type],
                       materialized_peak_bytes=meta.peak_materialized_bytes)
    meta_info = ProfileMeta(
        model_path=str(mf.path), fingerprint=model_fingerprint,
        unit_names=tuple(u.name for u in units), split_points=tuple(u.split_point or "" for u in units[1:]),
        microbatch_sizes=tuple(sizes), device=_describe_device(dev), torch_version=torch.__version__,
        num_threads=threads, optimizer=optimizer, repeats=repeats, warmup=warmup, extra=found.extra,
        dtype=dtype, time_budget_s=time_budget_s, whole_model=tuple(found.whole),
        optimizer_step_s=found.optimizer_step_s, co_runners=co_runners,
        live_values=tuple(_live_meta(found.live, found.value_bytes)),
        tied_parameters=tuple(tied_groups(meta.model, [u.modules for u in units])), **tp_meta(tp))
    return Profile(meta_info, found.table(units), pd.DataFrame(found.edges, columns=list(EDGE_COLUMNS)), tp_units)


@dataclass
class _Found:
    """What the microbatch sizes measured, gathered for the profile."""

    extra: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    value_bytes: dict[int, dict[str, int]] = field(default_factory=dict)
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    live: list[LiveValue] = field(default_factory=list)
    whole: list[dict[str, Any]] = field(default_factory=list)
    optimizer_step_s: float = 0.0

    def add(self, b: int, at_b: SizeResult) -> None:
        self.live = self.live or at_b.live
        self.rows += at_b.rows
        self.edges += at_b.edges
        self.value_bytes[b] = at_b.value_bytes
        for u, n in at_b.peaks.items():
            self.peaks.setdefault(str(u), {})[str(b)] = n

    def table(self, units: list[Unit]) -> pd.DataFrame:
        """The unit rows with the units' names and modules, in the profile's column order."""
        table = pd.DataFrame(self.rows)
        table.insert(1, "name", [units[i].name for i in table.unit])
        table.insert(2, "modules", [" ".join(units[i].modules) for i in table.unit])
        return table[list(UNIT_COLUMNS) + list(OPTIONAL_UNIT_COLUMNS)]


def _on_the_whole_model(mf: ModelFile, meta: MetaModel, at_b: SizeResult, b: int, settings: Settings,
                        found: _Found, compare_whole: bool, step: bool) -> None:
    """With the whole model materialized: one whole-model step beside the units' sum (when `compare_whole`), and
    the whole model's optimizer step (when `step`)."""
    meta.load(meta.model, settings.clock.device, settings.dtype)
    try:
        if compare_whole:
            settings.progress(progress_bar(1, 1, f"microbatch {b}: whole model"))
            units_s = sum(row["forward_s"] + row["backward_s"] for row in at_b.rows)
            whole_s = _whole_model(mf, meta.model, b, settings)
            found.whole.append({"microbatch_size": b, "whole_s": whole_s, "units_s": units_s,
                                "gap": units_s / whole_s - 1})
        if step:
            settings.progress(progress_bar(1, 1, "optimizer step"))
            found.optimizer_step_s = optimizer_step_s_of(list(meta.model.parameters()), settings)
    finally:
        meta.unload(meta.model)


def _describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({platform.processor() or platform.machine()})"

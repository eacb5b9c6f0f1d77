"""Measure each unit of a model (forward, backward split into input and weight gradients, recompute; parameter,
activation and boundary bytes) into a Profile, and compare the units' sum with one whole-model step."""

from __future__ import annotations

import logging
import os
import platform
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import nn

from ..model.contract import ModelFile, batch_norms, load_model_file
from ..model.experts import moe_facts
from ..model.meta import MetaModel, build_units
from ..model.split import LiveValue, tied_groups
from ..model.units import Unit
from ..model.vocab import vocab_facts
from ..data.profile import EDGE_COLUMNS, OPTIONAL_UNIT_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from ..schedule.activation import POLICY_COLUMNS
from ..progress import Overall, Progress
from .allocator import keep_freed_memory, release_large_allocations
from .memory import PEAK_HOW
from .options import MeasureOptions, ProfileOptions
from .pieces import OPTIMIZER_SLICE_NUMEL, SizeResult, measure_pieces
from .pieces import optimizer_step_s as optimizer_step_s_of
from .runtime import runtime_cost
from .settings import Settings
from .tp_rows import measured_tp_rows, tp_meta, tp_setup

__all__ = ["profile_model", "physical_memory_bytes", "default_memory_limit"]

log = logging.getLogger(__name__)


def _whole_model(mf: ModelFile, model: nn.Module, b: int, settings: Settings) -> float:
    """Median time of one forward, loss and backward of the unsplit model on a microbatch of `b`."""
    inputs, target = settings.batch(mf, b)
    times = []
    for timed in settings.budget.runs():
        _, t = settings.timer.time(lambda: mf.loss_fn(model(*inputs), target).backward())
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


def default_memory_limit(device: str) -> int:
    """The whole model is materialized only below this: a quarter of the memory it would live in (physical memory
    on CPU, the GPU's own on CUDA: a host's RAM can be many times its GPU's, and the model sits on the GPU)."""
    limit = physical_memory_bytes() // 4
    if device == "cuda":
        limit = min(limit, torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory // 4)
    return limit


def _check_device(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch.cuda.is_available() is False")


def _whole_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """Parameters and their gradients of the whole model in `dtype` (a tied weight once)."""
    size = torch.empty((), dtype=dtype).element_size()
    return 2 * sum(p.numel() * (size if p.is_floating_point() else p.element_size()) for p in model.parameters())


def profile_model(path: str | Path | ModelFile, options: ProfileOptions = ProfileOptions(),
                  measuring: MeasureOptions = MeasureOptions(), *,
                  progress: Progress = lambda _msg: None) -> Profile:
    """Profile the model file at `path` (or a loaded one, e.g. built from an HF config) for `options`: per-unit
    medians of up to `measuring.repeats` timed runs after `warmup` (stopping early once `time_budget_s` is spent on
    a unit), then one whole-model step to check the units add up. With `co_runners`, that many processes train the
    model beside every timing (autopp.measure.corun): the other pipeline ranks of a CPU host, which share its memory
    bus and caches. Every time (and the time budget) is read from `measuring.clock` (default: time.perf_counter on
    CPU, CUDA events on a GPU); tests pass a fake clock to get exact times.

    The model is built on the meta device (autopp.model.meta) and never materialized whole unless its parameters
    and gradients fit in `memory_limit_bytes` (default: `default_memory_limit`). When they fit, the pieces
    are materialized together and timed together as before; else one piece at a time. The whole-model comparison,
    the whole-model optimizer step and co-runners need the whole model: without it the comparison is skipped
    (logged and recorded in `extra.whole_model_skipped`), the optimizer step is the sum of the pieces' steps, and
    co-runners are refused. An optimizer step over more than `OPTIMIZER_SLICE_NUMEL` elements is timed on a slice
    and scaled (autopp.measure.pieces.optimizer_step_s); likewise, without the whole model, a head whose weight has
    more elements is measured on two slices of its vocabulary and extrapolated (autopp.measure.head; recorded in
    `extra.head_slice`). Units of one structure and input shapes are measured once
    (`source` "shared", `same_as`) unless `measure_every_unit`. With `options.tp_degrees` (each >= 2), the profile
    gets tp.csv rows too (autopp.measure.tp_rows): per degree, tensor-parallel rank 0's local shard measured like
    the units, and each unit's TP collectives counted; the model needs a TP plan (autopp.model.tp). On CPU,
    torch's pipelining runtime's own time per F and B action and the extra time of an action after a wait are
    measured once (autopp.measure.runtime) into the meta's `runtime_forward_s`, `runtime_backward_s` and
    `resume_s`, which the cost model adds to every stage's actions (the last: to those that follow a wait)."""
    _check_device(measuring.device)
    torch.set_num_threads(measuring.threads)
    allocator = keep_freed_memory()
    mf = path if isinstance(path, ModelFile) else load_model_file(path)
    meta, units, model_fingerprint = build_units(mf, options.torch_dtype)
    tp = tp_setup(mf, meta.model, options.tp_degrees)  # before measuring: a bad plan or degree fails at once
    limit = default_memory_limit(measuring.device) if measuring.memory_limit_bytes is None \
        else measuring.memory_limit_bytes
    whole_bytes = _whole_bytes(meta.model, options.torch_dtype)
    fits = whole_bytes <= limit
    if not fits:  # one unit at a time: a freed unit's large tensors must not stay resident (allocator.py)
        allocator = release_large_allocations()
    if measuring.co_runners and not fits:
        raise mf.error(f"--co-runners {measuring.co_runners} needs the whole model in each co-runner, but its "
                       f"parameters and gradients take {whole_bytes} bytes > the limit of {limit} bytes (a quarter "
                       f"of the device's memory): profile with --co-runners 0")
    # one progress line for every walk of the model: each size, then each size per TP degree (a shard's 1/t work)
    walks = [b / t for t in (1, *tp.degrees) for b in options.microbatch_sizes]
    settings = Settings(options, measuring, progress, Overall(progress, walks))
    found = _Found({"allocator": allocator})
    if not fits and measuring.compare_whole:
        found.extra["whole_model_skipped"] = (f"parameters and gradients {whole_bytes} bytes > limit {limit} bytes "
                                              f"(a quarter of the device's memory): not materialized whole")
        log.info("whole-model comparison skipped: %s", found.extra["whole_model_skipped"])
    _measure_sizes(mf, meta, units, settings, found, limit if fits else None)
    runtime = runtime_cost(settings.timer, settings.budget)
    if runtime is None:
        found.extra["runtime_cost_skipped"] = "on a GPU, or inside a process group of several ranks"
    tp_units = measured_tp_rows(mf, meta, units, tp, settings, limit if fits else 0)
    found.extra["vocab"] = vocab_facts(mf, units[0].modules, units[-1].modules, on_meta=meta.model) \
        if fits and len(units) > 2 else {"refused": f"vocabulary parallelism needs an embedding, a body and a head "
                                                    f"({len(units)} units)" if fits else "vocabulary parallelism: not "
                                                    "checked, the model was not materialized whole"}
    found.extra.update(peak_bytes=found.peaks, peak_bytes_how=PEAK_HOW[settings.timer.device.type],
                       materialized_peak_bytes=meta.peak_materialized_bytes,
                       **{k: v for k, v in {"moe": moe_facts(meta.model), "batch_norm": batch_norms(meta.model)}.items()
                          if v})
    if not options.recipe.implied:  # a recipe its dtype does not imply (bf16-pure) is recorded, as analytic ones are
        found.extra["precision"] = options.recipe.name
    meta_info = ProfileMeta(
        model_path=str(mf.path), fingerprint=model_fingerprint,
        unit_names=tuple(u.name for u in units), split_points=tuple(u.split_point or "" for u in units[1:]),
        microbatch_sizes=options.microbatch_sizes, device=_describe_device(settings.timer.device),
        torch_version=torch.__version__, num_threads=measuring.threads, optimizer=options.optimizer,
        repeats=measuring.repeats, warmup=measuring.warmup, extra=found.extra, dtype=options.dtype,
        time_budget_s=measuring.time_budget_s, whole_model=tuple(found.whole), optimizer_step_s=found.optimizer_step_s,
        co_runners=measuring.co_runners, live_values=tuple(_live_meta(found.live, found.value_bytes)),
        runtime_forward_s=runtime.forward_s if runtime else 0.0,
        runtime_backward_s=runtime.backward_s if runtime else 0.0, resume_s=runtime.resume_s if runtime else 0.0,
        tied_parameters=tuple(tied_groups(meta.model, [u.modules for u in units])), **tp_meta(tp))
    return Profile(meta_info, found.table(units), pd.DataFrame(found.edges, columns=list(EDGE_COLUMNS)), tp_units)


def _measure_sizes(mf: ModelFile, meta: MetaModel, units: list[Unit], settings: Settings, found: _Found,
                   limit: int | None) -> None:
    """Every unit at each microbatch size into `found`: with the whole model materialized when it fits in `limit`
    (None: it does not; one piece at a time, and the optimizer step summed over the pieces at the first size)."""
    sizes, compare_whole = settings.options.microbatch_sizes, settings.measuring.compare_whole
    for b in sizes:
        first = b == sizes[0]
        with settings.beside(mf, b):  # one start of the co-runners per size, for everything timed at that size
            at_b = measure_pieces(mf, meta, units, b, settings, limit_bytes=limit or 0,
                                  optimizer_per_piece=limit is None and first,
                                  head_slice_numel=OPTIMIZER_SLICE_NUMEL if limit is None else None)
            if limit is None and first:
                found.optimizer_step_s = at_b.optimizer_step_s
            if limit is not None and (compare_whole or first):
                _on_the_whole_model(mf, meta, at_b, b, settings, found, compare_whole, first)
        found.add(b, at_b)


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
        if at_b.head_slice is not None:
            self.extra["head_slice"] = at_b.head_slice

    def table(self, units: list[Unit]) -> pd.DataFrame:
        """The unit rows with the units' names and modules, in the profile's column order."""
        table = pd.DataFrame(self.rows)
        table.insert(1, "name", [units[i].name for i in table.unit])
        table.insert(2, "modules", [" ".join(units[i].modules) for i in table.unit])
        return table[list(UNIT_COLUMNS) + list(OPTIONAL_UNIT_COLUMNS) + list(POLICY_COLUMNS)]


def _on_the_whole_model(mf: ModelFile, meta: MetaModel, at_b: SizeResult, b: int, settings: Settings,
                        found: _Found, compare_whole: bool, step: bool) -> None:
    """With the whole model materialized: one whole-model step beside the units' sum (when `compare_whole`), and
    the whole model's optimizer step (when `step`)."""
    meta.load(meta.model, settings.timer.device, settings.options.torch_dtype)
    try:
        if compare_whole:
            settings.say(1.0, f"microbatch {b}: whole model", 1, 1)
            units_s = sum(row["forward_s"] + row["backward_s"] for row in at_b.rows)
            whole_s = _whole_model(mf, meta.model, b, settings)
            found.whole.append({"microbatch_size": b, "whole_s": whole_s, "units_s": units_s,
                                "gap": units_s / whole_s - 1})
        if step:
            settings.say(1.0, "optimizer step", 1, 1)
            found.optimizer_step_s = optimizer_step_s_of(list(meta.model.parameters()), settings)
    finally:
        meta.unload(meta.model)


def _describe_device(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(dev)})"
    return f"cpu ({platform.processor() or platform.machine()})"

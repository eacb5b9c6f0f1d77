"""The analytic profile: a model built on the meta device, split as the profiler splits it, every piece counted under
FakeTensorMode (autopp.measure.counting) and its counts turned into times by the roofline of a catalog device
(autopp.costmodel.roofline), written as the same Profile a measurement gives. Nothing is materialized."""

from __future__ import annotations

import contextlib
import json
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd
import torch
from torch import fx, nn
from torch.distributed.pipelining import Pipe

from ..costmodel.roofline import Calibration, Efficiency, OpCounts, default_efficiency, expert_seconds, phase_time
from ..data.catalog import DeviceSpec, load_device
from ..data.precision import KERNELS, Recipe
from ..data.profile import EDGE_COLUMNS, EXPERT_COLUMNS, OPTIONAL_UNIT_COLUMNS, UNIT_COLUMNS, Profile, ProfileMeta
from ..schedule.activation import POLICY_COLUMNS
from ..errors import AutoppError
from ..model.contract import ModelFile, batch_norms, describe_error, load_model_file
from ..model.experts import moe_facts
from ..model.fake import fake_mode, faking
from ..model.fake_cpu import as_fake_cpu, fake_on_cpu
from ..model.meta import MetaModel, build_meta, build_units, meta_pieces
from ..model.tp import local_model_file
from ..model.split import (LiveValue, live_values, model_output, rebuild_output, source_piece, tied_groups,
                           walk_split_graph)
from ..model.units import Unit
from ..progress import Overall, Progress
from .counting import PieceCounts, attention_tiles, count_piece
from .memory import PEAK_HOW, static_bytes, value_bytes
from .options import OPTIMIZER_STATES, ProfileOptions
from .pieces import piece_key
from .timing import Piece
from .tp_rows import TpSetup, check_same_units, counted_rows, sp_counted, tp_collectives, tp_meta, tp_setup, tp_table

__all__ = ["UnitCount", "ModelCounts", "count_model", "unit_times", "runs_fused_attention", "analytic_profile",
           "counted_tp_rows", "count_outdated"]
#: An analytic profile runs no loss on real values, so vocabulary parallelism is not checked (profile.extra.vocab).
_NO_VOCAB = "vocabulary parallelism: not checked on an analytic profile (the loss needs values): profile it measured"


@dataclass(frozen=True)
class UnitCount:
    """One unit at one microbatch size, counted (or copied from the earlier unit `same_as` of the same structure and
    input shapes)."""

    unit: int
    microbatch_size: int
    counts: PieceCounts
    static: dict[str, int]
    """param_bytes, grad_bytes, optimizer_bytes, tied_param_bytes, recompute_keep_bytes."""
    same_as: int | None = None


@dataclass
class ModelCounts:
    """Everything counted about a model at some microbatch sizes."""

    mf: ModelFile
    units: list[Unit]
    fingerprint: str
    options: ProfileOptions
    """The microbatch sizes, dtype and optimizer counted; no tensor-parallel degree (tp_degrees () here: those are
    `counted_tp_rows`')."""
    rows: list[UnitCount] = field(default_factory=list)
    edges: list[dict[str, Any]] = field(default_factory=list)
    live: list[LiveValue] = field(default_factory=list)
    value_bytes: dict[int, dict[str, int]] = field(default_factory=dict)
    tied: list[Any] = field(default_factory=list)
    optimizer_numel: int = 0
    """Elements of trainable parameters (for the optimizer step's memory traffic)."""
    param_tensors: int = 0
    moe: dict[str, Any] = field(default_factory=dict)
    """The model's routing (autopp.model.experts.moe_facts; {}: no stacked experts), meta.extra["moe"]."""
    batch_norm: list[str] = field(default_factory=list)
    """The model's BatchNorm modules (autopp.model.contract.batch_norms), meta.extra["batch_norm"]."""
    fused_attention: bool = False
    """Attention counted as a GPU's fused kernels run it (`autopp.model.fake_cpu.fused_attention`), not as the CPU
    dispatches it."""
    kernels: str = "eager"
    """The elementwise kernels counted (autopp.data.precision.KERNELS): as eager PyTorch runs them, or fused
    (autopp.measure.fusion)."""


def _edges_into(node: fx.Node, i: int, b: int, env: dict[fx.Node, Any], piece_index: dict[str, int]
                ) -> list[dict[str, Any]]:
    """Edge rows of the values piece `i` (split-graph node `node`) reads from earlier pieces or the model inputs."""
    sources = [(source_piece(arg, piece_index), arg) for arg in node.all_input_nodes]
    return [{"src": src, "dst": i, "microbatch_size": b, "bytes": value_bytes(env[arg])}
            for src, arg in sources if src is not None]


@contextlib.contextmanager
def _naming(mf: ModelFile, what: str) -> Iterator[None]:
    """Any failure inside (torch's, under FakeTensorMode) becomes one line naming the model file and `what`."""
    try:
        yield
    except AutoppError:
        raise
    except Exception as exc:
        raise mf.error(f"{what}: counting on the meta device raised {describe_error(exc)}") from exc


def _counted_unit(c: ModelCounts, b: int, i: int, module: nn.Module, args: tuple[Any, ...], same: int,
                  run: Callable[[], PieceCounts]) -> None:
    """Add unit `i`'s row at size `b` to `c`: counted by `run()`, or copied from the earlier unit `same`."""
    counts = next(r.counts for r in c.rows if r.unit == same and r.microbatch_size == b) if same != i else run()
    tied = {u: g.bytes for g in c.tied for u in g.units if len(g.units) > 1}
    static = {**static_bytes(module, c.options.optimizer, c.options.recipe), "tied_param_bytes": tied.get(i, 0),
              "recompute_keep_bytes": value_bytes(args)}
    c.rows.append(UnitCount(i, b, counts, static, None if same == i else same))


def _meta_split(c: ModelCounts, meta: MetaModel, b: int) -> tuple[Pipe, Any, Any, Any, Any]:
    """The meta model split at microbatch `b`, made to run as on a CPU on fake tensors: (pipe, output structure,
    fake inputs, fake target, the FakeTensorMode)."""
    points = [u.split_point for u in c.units[1:] if u.split_point is not None]
    with _naming(c.mf, f"splitting at microbatch {b}"):
        pipe, spec, inputs, target = meta_pieces(c.mf, meta, points, b, c.options.torch_dtype)
    mode = fake_mode()
    fake_on_cpu(pipe, mode, c.fused_attention)
    return pipe, spec, as_fake_cpu(mode, inputs), as_fake_cpu(mode, target), mode


def _count_size(c: ModelCounts, meta: MetaModel, b: int, overall: Overall, tag: str) -> None:
    """Split the meta model at microbatch `b` and count every piece (once per signature) into `c`, as the next walk
    of the `overall` progress line (`tag`: which model, e.g. a TP degree's shard)."""
    overall.next_phase()
    pipe, spec, fake_inputs, fake_target, mode = _meta_split(c, meta, b)
    gm = pipe.split_gm
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    piece_index = {str(n.target): i for i, n in enumerate(calls)}
    env: dict[fx.Node, Any] = {}
    seen: dict[str, int] = {}
    named, tiles = dict(meta.model.named_modules()), attention_tiles(c.fused_attention)
    with faking(mode):
        def visit(node: fx.Node, args: tuple[Any, ...]) -> Any:
            i = piece_index[str(node.target)]
            module = gm.get_submodule(str(node.target))
            last = i == len(calls) - 1
            c.edges += _edges_into(node, i, b, env, piece_index)
            grad = tuple(not (isinstance(a, fx.Node) and source_piece(a, piece_index) == -1) for a in node.args)
            finish = ((lambda out: c.mf.loss_fn(rebuild_output(spec, model_output(gm, env, node, out)), fake_target))
                      if last else (lambda out: out))
            same = seen.setdefault(piece_key(module, args, named, (last, grad)), i)
            overall(i / len(calls), f"microbatch {b}{tag}: unit {i + 1}/{len(calls)}"
                    + (f" (as unit {same + 1})" if same != i else " counting"))
            with _naming(c.mf, f"unit {i} ({c.units[i].name}) at microbatch {b}"):
                _counted_unit(c, b, i, module, args, same,
                              lambda: count_piece(Piece(module, args, finish, i == 0, grad), mode, tiles,
                                                  c.kernels == "fused"))
                with torch.no_grad():
                    return module(*args)

        for _ in walk_split_graph(gm, fake_inputs, env, visit):
            pass
        c.live = c.live or live_values(pipe)
        by_name = {n.name: n for n in gm.graph.nodes}
        c.value_bytes[b] = {v.name: value_bytes(env[by_name[v.name]]) for v in live_values(pipe)}
    _merge_edges(c, b)


def _merge_edges(c: ModelCounts, b: int) -> None:
    """One edge row per (src, dst) at size `b`, summing the values `dst` reads from `src`."""
    mine = [e for e in c.edges if e["microbatch_size"] == b]
    others = [e for e in c.edges if e["microbatch_size"] != b]
    summed: dict[tuple[int, int], int] = {}
    for e in mine:
        summed[(e["src"], e["dst"])] = summed.get((e["src"], e["dst"]), 0) + e["bytes"]
    c.edges = others + [{"src": s, "dst": d, "microbatch_size": b, "bytes": n} for (s, d), n in sorted(summed.items())]


def count_model(model: str | Path | ModelFile, options: ProfileOptions = ProfileOptions(),
                progress: Progress | Overall = lambda _msg: None, *, fused_attention: bool = False,
                kernels: str = "eager", tag: str = "") -> ModelCounts:
    """Count every unit of the model at each of `options`' microbatch sizes, on meta and fake tensors only;
    `fused_attention`: attention as a GPU runs it (`autopp.model.fake_cpu.fused_attention`), else as the CPU;
    `kernels`: "fused" counts elementwise chains as one kernel each (autopp.measure.fusion), "eager" op by op.
    `progress`: a callback (its own line, one walk per size) or the `Overall` line of a larger count."""
    mf = model if isinstance(model, ModelFile) else load_model_file(model)
    meta, units, model_fingerprint = build_units(mf, options.torch_dtype)  # as the profiler does
    params = [p for p in meta.model.parameters() if p.requires_grad]
    c = ModelCounts(mf, units, model_fingerprint, replace(options, tp_degrees=()),
                    tied=tied_groups(meta.model, [u.modules for u in units]),
                    optimizer_numel=sum(p.numel() for p in params), param_tensors=len(params),
                    moe=moe_facts(meta.model), batch_norm=batch_norms(meta.model), fused_attention=fused_attention,
                    kernels=_kernels(kernels))
    overall = progress if isinstance(progress, Overall) else Overall.counting(progress, len(options.microbatch_sizes))
    for b in options.microbatch_sizes:
        _count_size(c, meta, b, overall, tag)
    return c


def _kernels(kernels: str) -> str:
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {list(KERNELS)}, got {kernels!r}")
    return kernels


def unit_times(counts: PieceCounts, spec: DeviceSpec, recipe: Recipe, eff: Efficiency) -> dict[str, float]:
    """The profile's time columns of one counted unit on `spec` under `recipe`: every op at its compute peak, linear
    matmuls at theirs (FP8's: `OpCounts.load`), attention at its own efficiency; its expert GEMMs' parts apart."""
    (peak, linear_peak), bw = recipe.peaks(spec), spec.memory_bandwidth_bytes_per_s
    ridge = eff.ridge(peak, bw)

    def t(ops: OpCounts) -> float:
        return phase_time(ops.load(ridge, linear_peak / peak, eff.attention_slowdown), peak, bw, eff)
    times = {"forward": t(counts.forward), "backward": t(counts.backward), "backward_input": t(counts.backward_input),
             "backward_weight": t(counts.backward_weight), "recompute": t(counts.forward),
             "selective_recompute": t(counts.selective_recompute)}
    return {**{col: v for kind, value in times.items() for col, v in ((f"{kind}_s", value), (f"{kind}_spread_s", 0.0))},
            **expert_seconds(counts.passes(), peak, bw, eff, linear_peak / peak)}


def _optimizer_step_s(c: ModelCounts, spec: DeviceSpec, eff: Efficiency) -> float:
    """The step after the backward as memory traffic (`Recipe.step_bytes` per parameter); one op per tensor and
    pass."""
    states = OPTIMIZER_STATES[c.options.optimizer]
    per_element = c.options.recipe.step_bytes(states)
    ops = c.param_tensors * (2 + states)
    return c.optimizer_numel * per_element / (spec.memory_bandwidth_bytes_per_s * eff.memory) + ops * eff.op_overhead_s


def runs_fused_attention(spec: DeviceSpec) -> bool:
    """Whether `spec`'s attention is counted as a GPU's fused kernels run it (`count_model(fused_attention=...)`):
    every device but the catalog's CPU, whose memory is the host's."""
    return not spec.memory_shared


def analytic_profile(model: str | Path | ModelFile, device: str | DeviceSpec,
                     options: ProfileOptions = ProfileOptions(), *, calibration: Calibration | None = None,
                     calibration_path: str | None = None, counts: ModelCounts | None = None,
                     kernels: str = "eager", progress: Progress = lambda _msg: None) -> Profile:
    """The profile of the model on catalog `device` (a name or spec) for `options`, from counts alone (`counts`:
    the model already counted for the same options): the same format as a measured profile, every unit's `source`
    "analytic", the device and `calibration` (read from `calibration_path`; None: the documented assumptions) in
    `meta.extra`; `kernels` the elementwise kernels counted (`count_model`; `extra.analytic.kernels`). With a TP plan
    (autopp.model.tp), tp.csv rows for `options.tp_degrees`, each degree's local shard counted the same way
    (`counted_tp_rows`)."""
    spec = device if isinstance(device, DeviceSpec) else load_device(device)
    dtype, recipe = options.dtype, options.recipe
    recipe.peaks(spec)  # a device without the recipe's peaks fails before any counting
    if calibration is not None:
        calibration.check_dtype(dtype, calibration_path or "calibration")
    eff = calibration.efficiency if calibration is not None else default_efficiency(spec.name)
    if counts is not None and counts.options != replace(options, tp_degrees=()):
        raise ValueError(f"counts were made for {counts.options}, not for {options}")
    fused = runs_fused_attention(spec)
    if counts is not None and counts.fused_attention != fused:
        raise ValueError(f"counts were made with fused_attention={counts.fused_attention}, not for {spec.name}")
    if counts is not None and counts.kernels != kernels:
        raise ValueError(f"counts were made with {counts.kernels} kernels, not {kernels}")
    mf = counts.mf if counts is not None else model if isinstance(model, ModelFile) else load_model_file(model)
    setup, tp_skipped = TpSetup(None, {}, ()), None
    try:  # the degrees first: the progress line spans every walk of the count (issue 26)
        setup = tp_setup(mf, build_meta(mf).model, options.tp_degrees, limit=spec.devices_per_node)
    except AutoppError as exc:  # degrees not asked for: the profile without TP rows, and why
        if options.tp_degrees is not None:
            raise
        tp_skipped = str(exc)
    walks = (counts is None) + len(setup.degrees) * (1 + bool(setup.sequence))  # each degree with SP: twice
    overall = Overall.counting(progress, len(options.microbatch_sizes) * walks)
    c = counts or count_model(mf, options, overall, fused_attention=fused, kernels=kernels)
    try:
        tp_units, tp_fields, tp_peaks = counted_tp_rows(c, spec, eff, setup, overall)
    except AutoppError as exc:
        if options.tp_degrees is not None:
            raise
        tp_units, tp_fields, tp_peaks, tp_skipped = None, {}, {}, str(exc)
    rows = []
    for r in c.rows:
        rows.append({"unit": r.unit, "name": c.units[r.unit].name, "modules": " ".join(c.units[r.unit].modules),
                     "microbatch_size": r.microbatch_size, **unit_times(r.counts, spec, recipe, eff), **r.static,
                     "activation_bytes": r.counts.activation_bytes, "output_bytes": r.counts.output_bytes,
                     "selective_activation_bytes": r.counts.selective_bytes, "source": "analytic",
                     "same_as": -1 if r.same_as is None else r.same_as})
    table = pd.DataFrame(rows).sort_values(["microbatch_size", "unit"], kind="stable").reset_index(drop=True)
    columns = [*UNIT_COLUMNS, *OPTIONAL_UNIT_COLUMNS, *POLICY_COLUMNS, *(EXPERT_COLUMNS if c.moe else ())]
    live = [replace(v, bytes={b: c.value_bytes[b].get(v.name, 0) for b in c.options.microbatch_sizes})
            for v in c.live]
    peaks: dict[str, dict[str, int]] = {str(r.unit): {} for r in c.rows}
    for r in c.rows:
        peaks[str(r.unit)][str(r.microbatch_size)] = r.counts.peak_bytes
    extra = {"analytic_device": spec.name, "precision": recipe.name,
             "analytic": {"device": spec.name, "model": spec.model, "device_source": spec.source,
                          "calibration": calibration_path, "compute_efficiency": eff.compute,
                          "memory_efficiency": eff.memory, "op_overhead_s": eff.op_overhead_s,
                          "call_overhead_s": eff.call_overhead_s, "attention_efficiency": eff.attention,
                          "attention_tiles": asdict(attention_tiles(c.fused_attention)), "kernels": c.kernels,
                          **({"fused_saved": FUSED_SAVED} if c.kernels == "fused" else {})},
             "peak_bytes": peaks, **({"tp_peak_bytes": tp_peaks} if tp_peaks else {}),
             "peak_bytes_how": f"counted under FakeTensorMode, forward and full backward: {PEAK_HOW['cpu']}",
             **({"tp_skipped": tp_skipped} if tp_skipped else {}), **({"moe": c.moe} if c.moe else {}),
             **({"batch_norm": c.batch_norm} if c.batch_norm else {}),
             "vocab": {"refused": _NO_VOCAB}}
    meta = ProfileMeta(
        model_path=str(c.mf.path), fingerprint=c.fingerprint, unit_names=tuple(u.name for u in c.units),
        split_points=tuple(u.split_point or "" for u in c.units[1:]), microbatch_sizes=c.options.microbatch_sizes,
        device=f"analytic {spec.name} ({spec.model})", torch_version=torch.__version__, num_threads=1,
        optimizer=c.options.optimizer, repeats=0, warmup=0, extra=extra, dtype=dtype,
        optimizer_step_s=_optimizer_step_s(c, spec, eff), live_values=tuple(live), tied_parameters=tuple(c.tied),
        **tp_fields)
    return Profile(meta, table[columns], pd.DataFrame(c.edges, columns=list(EDGE_COLUMNS)), tp_units)


def counted_tp_rows(c: ModelCounts, spec: DeviceSpec, eff: Efficiency, setup: TpSetup, overall: Overall
                    ) -> tuple[pd.DataFrame | None, dict[str, Any], dict[str, dict[str, dict[str, int]]]]:
    """tp.csv's rows counted for `setup`'s degrees (autopp.measure.tp_rows.tp_setup), ProfileMeta's TP fields, and
    each degree's units' peak bytes (`extra.tp_peak_bytes`, {tp: {unit: {size: bytes}}}): each degree's local shard
    counted like the model (`count_model`, more walks on the `overall` line), and again under sequence parallelism
    (`sp_counted`), times from `unit_times`, the collectives counted on the full model."""
    if not setup.degrees:
        return None, {}, {}
    meta = build_meta(c.mf)
    meta.model.to(c.options.torch_dtype)
    comms = {b: tp_collectives(c.mf, meta.model, setup.resolved, c.units, b, c.options.torch_dtype, setup.sequence)
             for b in c.options.microbatch_sizes}
    rows: list[dict[str, Any]] = []
    peaks: dict[str, dict[str, dict[str, int]]] = {}
    count = partial(count_model, options=c.options, progress=overall, fused_attention=c.fused_attention,
                    kernels=c.kernels)
    for t in setup.degrees:
        local = count(local_model_file(c.mf, setup.resolved, t), tag=f" (tp {t})")
        check_same_units(c.mf, t, local.units, c.units)
        rows += counted_rows(local, sp_counted(count, c.mf, setup, t), t, comms,
                             partial(unit_times, spec=spec, recipe=c.options.recipe, eff=eff))
        for r in local.rows:
            peaks.setdefault(str(t), {}).setdefault(str(r.unit), {})[str(r.microbatch_size)] = r.counts.peak_bytes
    return tp_table(rows), tp_meta(setup), peaks


#: How a fused profile counts what its forward keeps for the backward (`extra.analytic.fused_saved`;
#: autopp.measure.fusion.kept_bytes): absent in fused profiles counted before it, which kept eager's saved bytes;
#: "min-cut" in those counted by its first rule (2026-12-06 17:08-17:30 UTC, before in-place writes and the peak's
#: moment were taken into account).
FUSED_SAVED = "min-cut-v2"


def count_outdated(profile: Profile) -> str | None:
    """Why an analytic profile was counted otherwise than `analytic_profile` counts now (None: it was not): with
    attention blocks that are neither kernel's of `attention_tiles` now (`extra.analytic.attention_tiles`; none:
    causal attention counted whole, before its skipped blocks), a mixture of experts without its expert GEMMs'
    columns (expert parallelism cannot re-time it; docs/profile-format.md), TP rows without their peak bytes, no
    bytes for the model's output (the last unit's `output_bytes`, recorded since 2026-12-06), or fused kernels
    counted with eager's saved bytes (`FUSED_SAVED`)."""
    kernels = [json.loads(json.dumps(asdict(attention_tiles(fused)))) for fused in (False, True)]  # as meta.json
    if profile.meta.extra.get("analytic", {}).get("attention_tiles") not in kernels:
        return "it counted causal attention whole, before its kernel's skipped blocks"
    if profile.experts_untimed:
        return "it was counted before the expert GEMMs' columns"
    if profile.meta.tp_degrees and "tp_peak_bytes" not in profile.meta.extra:
        return "its tensor-parallel rows were counted before their working memory (peak bytes)"
    if not (profile.units[profile.units.unit == profile.num_units - 1].output_bytes > 0).any():
        return "it was counted before the model's output bytes (what the last stage holds for the loss)"
    analytic = profile.meta.extra.get("analytic", {})
    if analytic.get("kernels") == "fused" and analytic.get("fused_saved") != FUSED_SAVED:
        return ("its fused kernels kept eager's saved bytes, before the count kept what fused kernels keep" if
                "fused_saved" not in analytic else f"it counted what fused kernels keep by an older rule, "
                f"{analytic['fused_saved']} (now {FUSED_SAVED})")
    return None

"""The field checks of plan JSON (docs/plan-format.md), before any dataclass of autopp.data.plan is built: each a
PlanError naming the file and the field (autopp.data.fields)."""

from __future__ import annotations

from typing import Any

from ..errors import ScheduleError
from ..schedule.actions import Action, parse_action
from ..schedule.activation import FIGURED, Activation, figure_keys
from ..schedule.descriptors import ScheduleName
from ..schedule.seqpipe import ChunkCosts
from .fields import Fields, is_int, is_span
from .layout import LAYOUT_FIELDS
from .precision import KERNELS
from .vocab import VocabVariant

__all__ = ["FIGURE_FIELDS", "NULLABLE", "OMITTED_WHEN_0", "OMITTED_WHEN_NONE", "STAGE_NUMBERS", "check_fields",
           "custom_order", "seq_chunks", "seq_chunks_json", "step_band", "nodes_of"]


#: Integer fields of a plan and their least values (the layout's: `LAYOUT_FIELDS`).
_PLAN_INTS = {"num_microbatches": 1, "microbatch_size": 1, "memory_limit_bytes": 1, "seed": 0, **LAYOUT_FIELDS}
_STAGE_INTS = {"index": 0, "rank": 0, "memory_bytes": 0, "static_bytes": 0, "activation_bytes": 0, "input_bytes": 0,
               "output_bytes": 0}
#: The stage fields of the activation policies' own figures (`figure_keys`: "selective_bytes", "selective_redo_s").
FIGURE_FIELDS = tuple(k for a in FIGURED for k in figure_keys(a))
#: Stage fields not written when 0 (plans without peak data, profiles without a policy's figures).
OMITTED_WHEN_0 = ("transient_bytes", *FIGURE_FIELDS, "comm_s", "sync_s", "resume_s", "scatter_s", "output_bytes")
#: Stage fields not written when null (a stage whose policy recomputes no forward); a 0 is written (a reviewer: a
#: recomputed forward of 0 s read back as none, `forward_s`).
OMITTED_WHEN_NONE = ("recompute_s",)
#: Number fields of a stage (finite, >= 0; the backward's I and W may be null, in plans that predate them).
STAGE_NUMBERS = ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "progress_s",
                 "overhead_s", "transient_bytes", *FIGURE_FIELDS, "comm_s", "sync_s", "resume_s", "scatter_s",
                 "recompute_s")
#: Stage numbers that may be null: I and W in plans that predate them, the recomputed forward where none is.
NULLABLE = ("backward_input_s", "backward_weight_s", "recompute_s")
_PREDICTION_NUMBERS = ("step_time_s", "allreduce_s", "efficiency", "optimizer_s")
#: torch.manual_seed takes seeds below 2**63 (as signed 64-bit integers).
_SEED_LIMIT = 2**63


def _check_prediction(d: Any, f: Fields, prediction: type) -> None:
    f.record(d, prediction)
    for name in _PREDICTION_NUMBERS:
        if name in d:
            f.number(d[name], name)
    f.flag(d.get("fits", True), "fits")
    bubble = d["bubble_fraction"]  # may be -1e-16 by rounding
    if isinstance(bubble, bool) or not isinstance(bubble, (int, float)) or not -1e-9 <= bubble <= 1:
        f.bad("bubble_fraction", "a number in [0, 1]", bubble)
    f.integers(d["peak_memory_bytes"], "peak_memory_bytes")
    units = d.get("stage_units", [])
    if not isinstance(units, (list, tuple)) or not all(is_span(u) for u in units):
        f.fail("field 'stage_units' must be a list of [first, end] unit ranges")


def _check_stage(s: dict[str, Any], i: int, f: Fields) -> None:
    for name, least in _STAGE_INTS.items():
        if name in s:
            f.integer(s[name], name, least)
    for name in STAGE_NUMBERS:
        if s.get(name) is not None or name not in NULLABLE:
            f.number(s.get(name, 0.0), name)
    if s["index"] != i:
        f.fail(f"field 'index' is {s['index']!r}; stages must be listed in order, index 0, 1, ...")
    if not is_span(s["units"]):
        f.bad("units", "[first, end] with 0 <= first < end", s["units"])
    f.strings(s["unit_names"], "unit_names")
    if len(s["unit_names"]) != s["units"][1] - s["units"][0]:
        f.fail(f"{len(s['unit_names'])} unit_names for units {s['units']}")
    if s["split_point"] is not None and not (isinstance(s["split_point"], str) and s["split_point"]):
        f.bad("split_point", "a module name or null", s["split_point"])
    policies = [a.value for a in Activation]
    if s.get("activation", "keep") not in policies:
        f.bad("activation", f"an activation policy, one of {policies}", s["activation"])


def check_fields(data: dict[str, Any], f: Fields, prediction: type) -> None:
    """Type and range of every field, before any dataclass is built: a PlanError naming the file and the field
    (`prediction`: the Prediction dataclass, whose fields the predictions and baselines must have)."""
    for name in ("model_path", "fingerprint", "schedule"):
        f.string(data[name], name)
    if "profile_path" in data:
        f.string(data["profile_path"], "profile_path")
    names = [n.value for n in ScheduleName]
    if data["schedule"] not in names:
        f.fail(f"field 'schedule' is {data['schedule']!r}; expected one of {names}")
    f.integers(data.get("device_order", []), "device_order", noun="device indices")
    for name, least in _PLAN_INTS.items():
        if name in data:
            f.integer(data[name], name, least)
    f.text_map(data.get("tp_plan", {}), "tp_plan", "module-name pattern -> style")
    hf = data.get("hf_config", {})
    if not isinstance(hf, dict) or hf and not (is_int(hf.get("seq_len"), 1) and isinstance(hf.get("task"), str)):
        f.bad("hf_config", '{} or {"seq_len": S >= 1, "task": T}', hf)
    _ = [f.string(data[name], name) for name in ("device", "optimizer", "dtype", "precision")
         if data.get(name) is not None]
    f.flag(data.get("frees_outputs", False), "frees_outputs")
    if data.get("seed", 0) >= _SEED_LIMIT:
        f.bad("seed", "below 2**63", data["seed"])
    f.number(data.get("ideal_step_time_s", 0.0), "ideal_step_time_s")
    if data.get("kernels") is not None and data["kernels"] not in KERNELS:
        f.bad("kernels", f"null or one of {list(KERNELS)}", data["kernels"])
    variants = [v.value for v in VocabVariant]
    if data.get("vocab") is not None and data["vocab"] not in variants:
        f.bad("vocab", f"null or one of {variants}", data["vocab"])
    f.strings(data.get("notes", []), "notes")
    for i, s in enumerate(data["stages"]):
        _check_stage(s, i, f.at(f"stage {i}"))
    _check_prediction(data["predicted"], f.at("predicted"), prediction)
    if not isinstance(data.get("baselines", {}), dict):
        f.fail("field 'baselines' must be an object of named predictions")
    for k, v in data.get("baselines", {}).items():
        _check_prediction(v, f.at(f"baselines.{k}"), prediction)


def custom_order(order: Any, f: Fields) -> tuple[tuple[Action, ...], ...]:
    """The per-rank action lists of field 'custom_order', parsed from text; a PlanError names the bad cell."""
    if not isinstance(order, (list, tuple)) or not all(isinstance(r, (list, tuple)) for r in order):
        f.fail("field 'custom_order' must be a list of per-rank lists of actions like \"0F0\"")
    return tuple(tuple(_action(cell, r, i, f) for i, cell in enumerate(row)) for r, row in enumerate(order))


def _action(cell: Any, rank: int, position: int, f: Fields) -> Action:
    at = f"field 'custom_order' rank {rank} position {position}"
    if not isinstance(cell, str):
        f.fail(f"{at} must be an action like \"0F0\", got {cell!r}")
    try:
        return parse_action(cell)
    except ScheduleError as exc:
        f.fail(f"{at}: {exc}")


def seq_chunks_json(seq: ChunkCosts | None) -> dict[str, list[Any]] | None:
    """`seq_chunks`' JSON form (None: not set)."""
    if seq is None:
        return None
    return {"lengths": list(seq.lengths), "time_share": list(seq.time), "memory_share": list(seq.memory)}


def seq_chunks(value: Any, f: Fields) -> ChunkCosts | None:
    """A plan's `seq_chunks` (Seq1F1B's chunks, `autopp.schedule.seqpipe.ChunkCosts`) from JSON: {"lengths",
    "time_share", "memory_share"}, one entry per chunk (token lengths; shares of a microbatch's time and kept
    bytes)."""
    if value is None:
        return None
    keys = ("lengths", "time_share", "memory_share")
    if not isinstance(value, dict) or sorted(value) != sorted(keys) or not value["lengths"] \
            or any(not isinstance(value[k], list) or len(value[k]) != len(value["lengths"]) for k in keys):
        f.fail("field 'seq_chunks' must be {\"lengths\", \"time_share\", \"memory_share\"}: lists of one entry "
               "per chunk")
    lengths = value["lengths"]
    shares = [x for k in keys[1:] for x in value[k]]
    if not all(isinstance(n, int) and n > 0 for n in lengths) \
            or not all(isinstance(x, (int, float)) and 0 < x <= 1 for x in shares):
        f.fail(f"field 'seq_chunks' needs positive token lengths and shares in (0, 1], got {value}")
    return ChunkCosts(tuple(lengths), tuple(float(x) for x in value["time_share"]),
                      tuple(float(x) for x in value["memory_share"]))


def step_band(band: Any, f: Fields) -> tuple[float, float] | None:
    """Field `step_band_s`: None, or [low, high] seconds with low <= high."""
    if band is None:
        return None
    if not isinstance(band, (list, tuple)) or len(band) != 2:
        f.bad("step_band_s", "[low, high] seconds", band)
    low, high = f.number(band[0], "step_band_s"), f.number(band[1], "step_band_s")
    if low > high:
        f.bad("step_band_s", "[low, high] seconds with low <= high", band)
    return (float(low), float(high))


def nodes_of(nodes: Any, num_ranks: int, f: Fields) -> tuple[int, int] | None:
    """Field `nodes`: None, or [nodes, devices per node] of the cluster planned for, holding its `num_ranks`."""
    if nodes is None:
        return None
    if not isinstance(nodes, (list, tuple)) or len(nodes) != 2:
        f.bad("nodes", "[nodes, devices per node]", nodes)
    count, per_node = f.integer(nodes[0], "nodes", 1), f.integer(nodes[1], "nodes", 1)
    if count * per_node != num_ranks:
        f.fail(f"field 'nodes' is {count} nodes x {per_node} devices (= {count * per_node}), but the plan has "
               f"{num_ranks} ranks")
    return (count, per_node)

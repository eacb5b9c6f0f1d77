"""The Plan: frozen dataclasses that round-trip through plan.json (format in docs/plan-format.md). No torch here."""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import LayoutError, PlanError, ScheduleError
from ..jsonio import read_json, write_json
from ..relpaths import resolved_path, stored_path
from ..schedule.actions import Action, Kind
from ..schedule.activation import FIGURED, Activation, Figures, figure_keys
from ..schedule.descriptors import Pairing, ScheduleName, describe, pairing
from ..schedule.seqpipe import ChunkCosts
from .breakdown import TimeBreakdown, breakdown_of
from .fields import Fields
from .layout import LAYOUT_KEYS, Layout, check_planned, layout_fields, layout_of
from .overlap import Overlap, default_overlap, overlap_of
from .plan_fields import (FIGURE_FIELDS, OMITTED_WHEN_0, OMITTED_WHEN_NONE, check_fields, custom_order, nodes_of,
                          seq_chunks, seq_chunks_json, step_band)
from .plan_version import PLAN_VERSION, READABLE_VERSIONS, upgraded
from .stage_plan import StagePlan, busiest_rank, figure_fields
from .vocab import VocabVariant

__all__ = ["PLAN_VERSION", "READABLE_VERSIONS", "StagePlan", "Prediction", "Plan", "load_plan", "upgraded"]


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of a whole plan (or of a baseline split)."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]  #: one per rank
    bubble_fraction: float
    """Idle fraction of the pipeline: 1 - busy time / (ranks * step time)."""
    stage_units: tuple[tuple[int, int], ...] = ()  #: the split these figures belong to (used by baselines)
    allreduce_s: float = 0.0  #: data-parallel gradient all-reduce time included in step_time_s (0 when dp = 1)
    efficiency: float = 0.0  #: ideal step time (total work / devices) / step_time_s
    optimizer_s: float = 0.0
    """The slowest rank's optimizer step (gradient scaling, step, zero_grad) included in step_time_s."""
    fits: bool = True
    """Every rank's simulated peak fits its device's memory (plans written before the field: true)."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything `autopp run` needs to execute a pipeline, and what the planner predicted for it."""

    model_path: str
    fingerprint: str
    schedule: ScheduleName
    """A named torch.distributed.pipelining schedule, or CUSTOM for a synthesized order given in `custom_order`
    (run through torch's schedule runtime). Stored in JSON as its value ("1F1B", "Custom", ...)."""
    layout: Layout
    """Every parallel degree and the ZeRO stage (autopp.data.layout); in JSON as the fields `num_ranks` (its world
    size), `pp`, `dp`, `virtual_stages` (its v), `tp` and `zero` (written when tp > 1 or ZeRO > 0), `cp` and `ep`
    (written when above 1)."""
    num_microbatches: int
    """Microbatches per pipeline replica per step."""
    microbatch_size: int
    memory_limit_bytes: int
    stages: tuple[StagePlan, ...]
    predicted: Prediction
    baselines: dict[str, Prediction] = field(default_factory=dict)
    seed: int = 0
    ideal_step_time_s: float = 0.0
    """Total work of a step / devices: no schedule can beat it."""
    notes: tuple[str, ...] = ()
    """Assumptions the prediction rests on (e.g. the backward split I = W = B / 2)."""
    custom_order: tuple[tuple[Action, ...], ...] = ()
    """With schedule "Custom": each pipeline rank's compute actions in order; stored in JSON as text ("0F0", "1I0",
    "1W0"), parsed by `from_json`."""
    device_order: tuple[int, ...] = ()
    """Device (index in the cluster file's order, = the launcher's process slot) of each global rank, as CP-SAT chose
    it on a heterogeneous cluster; empty: rank r runs on device r. Written to JSON only when not empty."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """The tensor-parallel plan the stages were costed with: module-name pattern (from the model's root, `*` for one
    name token) -> style (autopp.model.tp); written to JSON only when tp > 1."""
    hf_config: dict[str, Any] = field(default_factory=dict)
    """For a model built from an HF config.json (`model_path`): the `seq_len` and `task` of its profile, so that
    `autopp run` builds the same model and batch. Written to JSON only when not empty."""
    profile_path: str = ""
    """The profile directory the plan was made from (`autopp export` reads module names there), stored relative to
    the plan file like `model_path`; empty (not written): unknown, as for plans made through the Python API."""
    device: str | None = None
    """The catalog name (autopp.data.catalog) of the device kind planned for, the cluster's else the profile's:
    `autopp run` picks its backend by it. None: unknown (older plans); written to JSON only when known."""
    optimizer: str | None = None
    """The profile's optimizer ("sgd", "adam", ...), whose state the memory counts: `autopp run` trains with it.
    None in older plans (run: SGD); written to JSON only when known."""
    dtype: str | None = None
    """The profile's parameter and activation dtype ("bfloat16": mixed precision with fp32 master weights and
    optimizer state, as the profile counted them; "float32"), which the exports write as the trainer's precision
    recipe. None in older plans and plans of the Python API; written to JSON only when known."""
    time_breakdown: TimeBreakdown | None = None
    """Where the predicted step's time goes (autopp.data.breakdown); None in plans that predate it and hand-built
    ones; written to JSON only when known."""
    step_band_s: tuple[float, float] | None = None
    """The predicted step's band (low, high) from the profile's spreads (autopp.solve.search.band): the step with
    every unit's times at the low and at the high end of its spread; (step, step) for a profile without spreads (an
    analytic one). None: not known (older plans, pinned configurations); written to JSON only when known."""
    tied: tuple[str, ...] = ()
    """The other configurations whose predicted steps lie inside that band, each in words with its step: ties with
    the plan, which a tie rule chose among (`PlanRequest.ties`). Written to JSON only when not empty."""
    precision: str | None = None
    """The mixed-precision recipe the profile was counted for (autopp.data.precision's names), which the exports
    spell. None: the recipe of `dtype` (profiles made before recipes); written to JSON only when known."""
    kernels: str | None = None
    """The elementwise kernels an analytic profile counted (`KERNELS`: "eager" or "fused", its
    `extra.analytic.kernels`), which the exports ask the trainer for or note. None: not known (measured profiles,
    which time the kernels that ran; analytic ones counted before the choice); written to JSON only when known."""
    vocab: VocabVariant | None = None
    """Vocabulary parallelism (docs/vocabulary-parallelism.md): the embedding (unit 0) and the head with its loss
    (the last unit) split along the vocabulary over every pipeline rank, with this variant ("vocab-1", "vocab-2" in
    JSON); the stages' units and split points are then the body's split, their times and bytes include the passes.
    None: the first and last stages hold them whole; written to JSON only when set."""
    seq_chunks: ChunkCosts | None = None
    """Sequence pipelining (Seq1F1B; docs/sequence-pipelining.md): the chunks of each microbatch's sequence (JSON:
    `plan_fields.seq_chunks`); set exactly when the schedule splits sequences, written to JSON only when set."""
    overlap: Overlap | None = None
    """The collectives the prediction assumed hidden under compute (autopp.data.overlap), which the exports ask the
    trainer for (docs/export.md); in JSON an object of the switches. None (not written: plans before the field,
    plans built by hand): read as the planner's default (`assumed_overlap`)."""
    nodes: tuple[int, int] | None = None
    """The cluster of nodes planned for: (nodes, devices per node), one rank per device; `autopp run` launches that
    many nodes of that many ranks by default. None: one node, or not known (older plans, plans of a flat cluster);
    written to JSON, as [nodes, devices per node], only when known."""
    frees_outputs: bool = False
    """The prediction counted each stage's outputs freed once sent (`PlanRequest.frees_outputs`: Megatron-LM's
    pipeline frees them), where torch's PipelineStage, which `autopp run` and torchtitan drive, holds them until their
    backward (`StagePlan.output_bytes`). Written to JSON only when true."""
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.schedule, ScheduleName):  # a programming error: from_json parses the name
            raise TypeError(f"Plan.schedule must be a ScheduleName, got {self.schedule!r}")
        if not all(isinstance(a, Action) for row in self.custom_order for a in row):  # from_json parses the text
            raise TypeError(f"Plan.custom_order must hold Actions, got {self.custom_order!r}")
        if not isinstance(self.layout, Layout):  # a programming error: from_json builds the layout
            raise TypeError(f"Plan.layout must be a Layout, got {self.layout!r}")
        try:
            check_planned(self.layout, "field ")
        except LayoutError as exc:
            raise PlanError(str(exc)) from None
        pp = self.layout.pp
        ranks = sorted({s.rank for s in self.stages})
        if ranks != list(range(pp)):
            raise PlanError(f"plan places stages on ranks {ranks} but pp={pp} needs ranks 0..{pp - 1}")
        ends = [s.units for s in self.stages]
        if any(a[1] != b[0] for a, b in zip(ends, ends[1:])) or ends[0][0] != 0:
            raise PlanError(f"stage unit ranges {ends} are not contiguous from unit 0")
        if self.stages[0].split_point is not None or any(s.split_point is None for s in self.stages[1:]):
            raise PlanError("stage 0 must have split_point null and every later stage a module name")
        if self.device_order and sorted(self.device_order) != list(range(self.num_ranks)):
            raise PlanError(f"field 'device_order' must be a permutation of 0..{self.num_ranks - 1} (one device per "
                            f"rank), got {list(self.device_order)}")

    @property
    def num_ranks(self) -> int:
        """World size: the layout's processes."""
        return self.layout.world

    @property
    def global_batch(self) -> int:
        return self.num_microbatches * self.microbatch_size * self.layout.dp

    @property
    def split_points(self) -> list[str]:
        return [s.split_point for s in self.stages[1:] if s.split_point is not None]

    @property
    def mirrored(self) -> bool:
        """Whether each rank also runs another stage's replica of a second pipeline (Chimera: stage s on rank r
        down and on rank pp - 1 - r up)."""
        return describe(self.schedule).mirrored

    @property
    def splits_backward(self) -> bool:
        """Whether the plan runs I and W actions (its schedule's descriptor says; a given order: whether it has
        them)."""
        d = describe(self.schedule)
        return d.splits_backward if not d.given_order else any(
            a.kind in (Kind.I, Kind.W) for row in self.custom_order for a in row)

    @property
    def assumed_overlap(self) -> Overlap:
        """`overlap`, else the planner's default for `device` (the trainers' overlap on a catalog GPU, else none)."""
        return self.overlap if self.overlap is not None else default_overlap(self.device)

    @property
    def pairing(self) -> Pairing | None:
        """The forward-backward pairs its simulation overlaps (`schedule.pairing`: DualPipeV's own; Interleaved1F1B's
        under the `ep_a2a` overlap, Megatron-Core's combined 1F1B, with ep > 1)."""
        return pairing(self.schedule, self.assumed_overlap.ep_a2a and self.layout.ep > 1, self.layout.v)

    def rank_on(self, device: int) -> int:
        """The global rank that runs on device (launcher slot) `device`."""
        return self.device_order.index(device) if self.device_order else device

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        del data["layout"]
        data.update(layout_fields(self.layout))
        data["schedule"] = self.schedule.value
        data["vocab"] = self.vocab.value if self.vocab is not None else None
        data["custom_order"] = tuple(tuple(str(a) for a in row) for row in self.custom_order)
        data["seq_chunks"] = seq_chunks_json(self.seq_chunks)
        if not self.device_order:
            del data["device_order"]  # plans without one stay as they were written before the field existed
        # fields a plan may not know (a model file's hf_config, the API's profile_path, older plans' device and
        # optimizer) are written only when known: plans without them stay as they were written before them
        data = {k: v for k, v in data.items()
                if v or k not in ("hf_config", "profile_path", "device", "optimizer", "dtype", "time_breakdown",
                                  "step_band_s", "tied", "precision", "kernels", "vocab", "seq_chunks",
                                  "overlap", "nodes", "frees_outputs")}
        if self.overlap is not None and not self.overlap.ep_a2a:
            del data["overlap"]["ep_a2a"]  # plans without the combined 1F1B stay as they were written before it
        if self.time_breakdown is not None:
            data["time_breakdown"] = self.time_breakdown.to_json()
        if self.layout.tp == 1:
            del data["tp_plan"]  # pipeline-only plans stay as they were written before 3D parallelism
        data["stages"] = [{**{k: v for k, v in {**st, **figure_fields(s.own)}.items()
                              if k != "own" and (v or k not in OMITTED_WHEN_0)
                              and (v is not None or k not in OMITTED_WHEN_NONE)},
                           "activation": s.activation.value} for st, s in zip(data["stages"], self.stages)]
        return {"version": data.pop("version"), **data}

    def save(self, path: str | Path) -> Path:
        """Write plan JSON atomically: a reader never sees a half-written file. `model_path` is stored relative to
        the plan file's directory (docs/plan-format.md)."""
        return write_json(path, {**self.to_json(), **{k: stored_path(getattr(self, k), Path(path).parent)
                                                      for k in ("model_path", "profile_path") if getattr(self, k)}})

    @staticmethod
    def from_json(data: dict[str, Any], where: str = "plan") -> Plan:
        f = Fields(where, PlanError)
        data = upgraded(data, f)
        _record(data, f)
        if not isinstance(data["stages"], (list, tuple)) or not data["stages"]:
            f.fail("field 'stages' must be a non-empty list")
        for i, s in enumerate(data["stages"]):
            if isinstance(s, dict) and "recompute" in s:  # version 2 with version 1's field
                f.at(f"stage {i}").fail("field 'recompute' is version 1's; version 2 has 'activation' (keep, "
                                        "recompute)")
            f.at(f"stage {i}").keys(s, [*(x.name for x in fields(StagePlan) if x.name != "own"), *FIGURE_FIELDS],
                                    [x.name for x in fields(StagePlan) if x.default is MISSING])
        f.at("predicted").record(data["predicted"], Prediction)
        check_fields(data, f, Prediction)
        order = custom_order(data.get("custom_order", []), f)
        given = data.get("time_breakdown")
        breakdown = None if given is None else breakdown_of(given, f.at("time_breakdown"))
        band = step_band(data.get("step_band_s"), f)
        overlap = overlap_of(data.get("overlap"), f.at("overlap"))
        try:
            stages = tuple(StagePlan(**{**{k: v for k, v in s.items() if k not in FIGURE_FIELDS},
                                        "units": tuple(s["units"]), "unit_names": tuple(s["unit_names"]),
                                        "activation": Activation(s.get("activation", "keep")), "own": _own(s)})
                           for s in data["stages"])
            rest = {k: v for k, v in data.items() if k not in LAYOUT_KEYS}
            plan = Plan(**{**rest, "layout": layout_of(data), "schedule": ScheduleName(data["schedule"]),
                           "stages": stages, "predicted": _prediction(data["predicted"]),
                           "baselines": {k: _prediction(v) for k, v in data.get("baselines", {}).items()},
                           "notes": tuple(data.get("notes", ())),
                           "step_band_s": band,
                           "tied": tuple(data.get("tied", ())),
                           "vocab": VocabVariant(data["vocab"]) if data.get("vocab") is not None else None,
                           "overlap": overlap,
                           "custom_order": order, "seq_chunks": seq_chunks(data.get("seq_chunks"), f),
                           "device_order": tuple(data.get("device_order", ())), "time_breakdown": breakdown,
                           "nodes": nodes_of(data.get("nodes"), layout_of(data).world, f)})
            _check_consistent(plan)
            return plan
        except (PlanError, LayoutError) as exc:  # LayoutError: the layout's fields do not add up
            raise PlanError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: malformed plan: {type(exc).__name__}: {exc}") from exc


def _own(stage: dict[str, Any]) -> tuple[tuple[Activation, Figures], ...]:
    """A JSON stage's policy figures (`figure_keys`), for the policies it gives any of."""
    return tuple((a, Figures(*(stage.get(k, 0) for k in keys))) for a in FIGURED
                 for keys in [figure_keys(a)] if any(k in stage for k in keys))


def _check_consistent(plan: Plan) -> None:
    """The schedule, stage count and microbatch count agree with each other and with the plan's own prediction."""
    d, pp, v = describe(plan.schedule), plan.layout.pp, plan.layout.v
    if not d.given_order and len(plan.stages) != pp * v:  # a given order: any placement
        raise PlanError(f"{len(plan.stages)} stages for pp {pp} x virtual_stages {v} (= {pp * v})")
    if d.given_order:
        if len(plan.custom_order) != pp:
            raise PlanError(f"schedule {plan.schedule.value!r} needs custom_order with one row per pipeline rank "
                            f"({pp}), got {len(plan.custom_order)}")
    else:
        try:
            d.stages_per_rank(v)
        except ScheduleError as exc:
            raise PlanError(f"field 'virtual_stages': {exc}; re-plan with `autopp plan ... --schedule "
                            f"{plan.schedule.value}`, which sets it") from None
        try:
            d.validate(pp, plan.num_microbatches, v)
        except ScheduleError as exc:
            raise PlanError(f"field 'num_microbatches': {exc}; re-plan with `autopp plan ... --microbatches M`") \
                from None
    if (plan.seq_chunks is not None) != d.sequence_chunks:
        raise PlanError(f"field 'seq_chunks' is {'set' if plan.seq_chunks else 'missing'} under schedule "
                        f"{plan.schedule.value!r}: it is set exactly for sequence chunks; re-plan with `autopp plan`")
    if plan.vocab is not None and (pp < 2 or plan.layout.world != pp):
        raise PlanError(f"field 'vocab' {plan.vocab.value!r} splits the vocabulary over pp >= 2 pipeline ranks "
                        f"and no other axis (pp {pp}, {plan.layout.world} ranks)")
    _check_step_time(plan)


def _check_step_time(plan: Plan) -> None:
    """Every rank runs each of its stages' forward and backward once per microbatch, so the predicted step cannot be
    shorter than num_microbatches x the busiest rank's least per-microbatch work (`stage_plan.busiest_rank`, with
    what an overlapping schedule hides). A file edited by hand (a microbatch count changed after planning) breaks
    that; its ranks would run for as long as the count says. Checked on plans the planner made
    (ideal_step_time_s > 0); hand-built plans without one are taken as they are."""
    if plan.ideal_step_time_s <= 0:
        return
    rank, per_mb = busiest_rank(plan.stages, plan.schedule, plan.layout.pp, plan.layout.v,
                                plan.assumed_overlap.ep_a2a and plan.layout.ep > 1)
    least = plan.num_microbatches * per_mb
    if least > plan.predicted.step_time_s * (1 + 1e-6) + 1e-12:
        raise PlanError(f"field 'num_microbatches' is {plan.num_microbatches}, but {plan.num_microbatches} "
                        f"microbatches of rank {rank}'s stages take at least {least:.3g} s, and the plan predicts a "
                        f"{plan.predicted.step_time_s:.3g} s step, which fits at most "
                        f"{int(plan.predicted.step_time_s / per_mb)}: the file was edited after planning; re-plan "
                        "with `autopp plan ... --microbatches M` instead")


def _record(data: dict[str, Any], f: Fields) -> None:
    """`Fields.record` for the plan's JSON, whose layout fields (`LAYOUT_KEYS`, `num_ranks` required) stand for
    `Plan.layout`."""
    f.keys(f.obj(data), None, ("num_ranks",))
    f.record({k: v for k, v in data.items() if k not in LAYOUT_KEYS} | {"layout": None}, Plan)


def _prediction(d: dict[str, Any]) -> Prediction:
    return Prediction(**{**d, "peak_memory_bytes": tuple(d["peak_memory_bytes"]),
                         "stage_units": tuple(tuple(u) for u in d.get("stage_units", ()))})


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan JSON file; its `model_path` comes back absolute (a relative one is taken from the plan
    file's directory)."""
    p = Path(path)
    if not p.exists():
        raise PlanError(f"{p}: no such plan file; create one with `autopp plan MODEL.py --devices N --memory SIZE`")
    plan = Plan.from_json(read_json(p, "plan JSON file", PlanError, "re-plan with `autopp plan`"), str(p))
    return replace(plan, model_path=resolved_path(plan.model_path, p.parent),  # stored relative to the plan's dir
                   profile_path=resolved_path(plan.profile_path, p.parent) if plan.profile_path else "")

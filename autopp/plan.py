"""The Plan: frozen dataclasses that round-trip through plan.json (format in docs/plan-format.md). No torch here."""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import PlanError
from .jsonio import write_json

__all__ = ["PLAN_VERSION", "StagePlan", "Prediction", "Plan", "load_plan"]

PLAN_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class StagePlan:
    """One pipeline stage: the units [first, end) of the profile, placed on `rank`."""

    index: int
    rank: int
    units: tuple[int, int]
    """Half-open range of unit indices."""
    unit_names: tuple[str, ...]
    split_point: str | None
    """Module before which this stage begins (None for stage 0)."""
    forward_s: float
    """Predicted forward time of one microbatch."""
    backward_s: float
    """Predicted backward time of one microbatch."""
    memory_bytes: int
    """Predicted peak memory of the rank that runs this stage (all its stages together), from the simulator."""
    recompute: bool = False
    """This stage re-runs its forward in the backward instead of keeping its activations."""
    backward_input_s: float | None = None
    """Input-gradient pass (I) of split-backward schedules; None in plans that predate it (then I = W =
    backward_s / 2)."""
    backward_weight_s: float | None = None
    """Weight-gradient pass (W); I + W usually exceeds the full backward. None in plans that predate it (then
    W = backward_s - I)."""
    static_bytes: int = 0
    """Parameters + gradients + optimizer state of this stage."""
    activation_bytes: int = 0
    """Bytes saved for backward by one microbatch's forward."""
    input_bytes: int = 0
    """Bytes of this stage's input per microbatch (kept instead of activations when recomputing)."""
    send_s: float = 0.0
    """Predicted time to send one microbatch's output to the next stage (0 on the same rank or for the last)."""
    progress_s: float = 0.0
    """Longest this stage's output (and the gradient coming back to it) waits for its sender to stop computing
    (the link's `progress_s`; 0 on the same rank or for the last stage)."""
    overhead_s: float = 0.0
    """Time the rank spends on this stage's messages to and from other ranks per F and per B (or I) action, besides
    compute and waiting (the links' `overhead_s`, once per message); the simulator adds it to both."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "send_s", "overhead_s",
                     "progress_s"):
            value = getattr(self, name)
            if value is None and name in ("backward_input_s", "backward_weight_s"):
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise PlanError(f"stage {self.index}: {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted figures of a whole plan (or of a baseline split)."""

    step_time_s: float
    peak_memory_bytes: tuple[int, ...]
    """One per rank."""
    bubble_fraction: float
    """Idle fraction of the pipeline: 1 - busy time / (ranks * step time)."""
    stage_units: tuple[tuple[int, int], ...] = ()
    """The split these figures belong to (used by baselines)."""
    allreduce_s: float = 0.0
    """Data-parallel gradient all-reduce time included in step_time_s (0 when dp = 1)."""
    efficiency: float = 0.0
    """Ideal step time (total work / devices) / step_time_s."""
    optimizer_s: float = 0.0
    """The slowest rank's optimizer step (gradient scaling, step, zero_grad) included in step_time_s."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Everything `autopp run` needs to execute a pipeline, and what the planner predicted for it."""

    model_path: str
    fingerprint: str
    schedule: str
    """Name of a torch.distributed.pipelining schedule (an autopp.schedule.ScheduleName value), or "Custom" for a
    synthesized order given in `custom_order` (run through torch's schedule runtime)."""
    num_ranks: int
    """World size: pp x dp processes."""
    num_microbatches: int
    """Microbatches per pipeline replica per step."""
    microbatch_size: int
    memory_limit_bytes: int
    stages: tuple[StagePlan, ...]
    predicted: Prediction
    baselines: dict[str, Prediction] = field(default_factory=dict)
    seed: int = 0
    pp: int = 0
    """Pipeline ranks per replica; 0 in a file means num_ranks // dp (plans written before the field existed)."""
    dp: int = 1
    """Data-parallel replicas; each runs the whole pipeline on global_batch / dp samples."""
    virtual_stages: int = 1
    """Stages per pipeline rank (2 for V schedules, v for interleaved ones)."""
    ideal_step_time_s: float = 0.0
    """Total work of a step / devices: no schedule can beat it."""
    notes: tuple[str, ...] = ()
    """Assumptions the prediction rests on (e.g. the backward split I = W = B / 2)."""
    custom_order: tuple[tuple[str, ...], ...] = ()
    """With schedule "Custom": each pipeline rank's compute actions in order, as text ("0F0", "1I0", "1W0")."""
    version: int = PLAN_VERSION

    def __post_init__(self) -> None:
        if self.pp == 0:
            object.__setattr__(self, "pp", self.num_ranks // max(self.dp, 1))
        if self.pp * self.dp != self.num_ranks:
            raise PlanError(f"dp({self.dp}) * pp({self.pp}) != num_ranks ({self.num_ranks})")
        ranks = sorted({s.rank for s in self.stages})
        if ranks != list(range(self.pp)):
            raise PlanError(f"plan places stages on ranks {ranks} but pp={self.pp} needs ranks 0..{self.pp - 1}")
        ends = [s.units for s in self.stages]
        if any(a[1] != b[0] for a, b in zip(ends, ends[1:])) or ends[0][0] != 0:
            raise PlanError(f"stage unit ranges {ends} are not contiguous from unit 0")
        if self.stages[0].split_point is not None or any(s.split_point is None for s in self.stages[1:]):
            raise PlanError("stage 0 must have split_point null and every later stage a module name")

    @property
    def global_batch(self) -> int:
        return self.num_microbatches * self.microbatch_size * self.dp

    @property
    def split_points(self) -> list[str]:
        return [s.split_point for s in self.stages[1:] if s.split_point is not None]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        return {"version": data.pop("version"), **data}

    def save(self, path: str | Path) -> Path:
        """Write plan JSON atomically: a reader never sees a half-written file."""
        return write_json(path, self.to_json())

    @staticmethod
    def from_json(data: dict[str, Any], where: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            version = data.get("version") if isinstance(data, dict) else None
            raise PlanError(f"{where}: plan version {version!r} is not supported (expected {PLAN_VERSION})")
        _require(data, Plan, where)
        if not isinstance(data["stages"], (list, tuple)) or not data["stages"]:
            raise PlanError(f"{where}: field 'stages' must be a non-empty list")
        for i, s in enumerate(data["stages"]):
            _require(s, StagePlan, f"{where}: stage {i}")
        _require(data["predicted"], Prediction, f"{where}: predicted")
        try:
            stages = tuple(StagePlan(**{**s, "units": tuple(s["units"]), "unit_names": tuple(s["unit_names"])})
                           for s in data["stages"])
            return Plan(**{**data, "stages": stages, "predicted": _prediction(data["predicted"]),
                           "baselines": {k: _prediction(v) for k, v in data.get("baselines", {}).items()},
                           "notes": tuple(data.get("notes", ())),
                           "custom_order": tuple(tuple(r) for r in data.get("custom_order", ()))})
        except PlanError as exc:
            raise PlanError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{where}: malformed plan: {type(exc).__name__}: {exc}") from exc


def _require(data: Any, cls: type, where: str) -> None:
    """A PlanError naming the first field of `cls` without a default that `data` lacks, or unknown fields."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in fields(cls)}
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise PlanError(f"{where}: missing field {missing[0]!r}")
    unknown = sorted(set(data) - names)
    if unknown:
        raise PlanError(f"{where}: unknown field {unknown[0]!r}")


def _prediction(d: dict[str, Any]) -> Prediction:
    return Prediction(**{**d, "peak_memory_bytes": tuple(d["peak_memory_bytes"]),
                         "stage_units": tuple(tuple(u) for u in d.get("stage_units", ()))})


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan JSON file."""
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"{p}: no such plan file; create one with `autopp plan MODEL.py --devices N --memory SIZE`")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise PlanError(f"{p}:{exc.lineno}: not valid JSON: {exc.msg}") from exc
    return Plan.from_json(data, str(p))

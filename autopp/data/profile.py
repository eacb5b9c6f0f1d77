"""The Profile: a pandas table of per-unit costs at each microbatch size, its metadata, and its networkx graph.

Stored as a directory (documented in docs/profile-format.md): `units.csv`, `edges.csv`, `meta.json`, `graph.json`,
and optionally `tp.csv` (tensor-parallel rows, autopp.data.profile_tp).
This module imports no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import networkx as nx
import numpy as np
import pandas as pd

from ..errors import AutoppError, ProfileError
from ..jsonio import read_json, shared_mode
from .fields import Fields
from ..preflight import check_output_dir
from .profile_values import REPROFILE as _REPROFILE
from .profile_values import LiveValue, TiedGroup, ValueAction
from .profile_tp import TP_COLUMNS, TP_FILE, check_numbers, check_tp_meta, validate_tp
from ..relpaths import resolved_path, stored_path
from ..schedule.activation import POLICY_COLUMNS

__all__ = ["PROFILE_VERSION", "UNIT_COLUMNS", "OPTIONAL_UNIT_COLUMNS", "UNIT_SOURCES", "EXPERT_PASSES",
           "EXPERT_PARTS", "EXPERT_COLUMNS", "expert_column", "EDGE_COLUMNS", "TP_COLUMNS", "ValueAction", "LiveValue",
           "TiedGroup", "ProfileMeta", "Profile", "load_profile"]

PROFILE_VERSION = 1

#: Columns of units.csv, one row per (unit, microbatch size). Times in seconds, sizes in bytes.
UNIT_COLUMNS: dict[str, str] = {
    "unit": "int",  # unit index, 0-based, in execution order
    "name": "str",  # unit name (its first module)
    "modules": "str",  # module names in the unit, separated by ' '
    "microbatch_size": "int",
    "forward_s": "float",  # median forward time of one microbatch
    "forward_spread_s": "float",  # max - min over the repeats
    "backward_s": "float",  # median full backward time (input and weight gradients)
    "backward_spread_s": "float",
    "backward_input_s": "float",  # input gradients only (torch's stage_backward_input); 0 for the first unit
    "backward_input_spread_s": "float",
    "backward_weight_s": "float",  # weight gradients after the input ones (stage_backward_weight)
    "backward_weight_spread_s": "float",
    "recompute_s": "float",  # forward again without saving for backward (the cost of activation recomputation)
    "recompute_spread_s": "float",
    "param_bytes": "int",
    "grad_bytes": "int",
    "optimizer_bytes": "int",  # optimizer state (and an fp32 master copy below float32)
    "tied_param_bytes": "int",  # part of param_bytes that is a copy of a weight tied with another unit
    "activation_bytes": "int",  # bytes autograd saves for backward, per microbatch (shared storage counted once)
    "output_bytes": "int",  # bytes of the unit's outputs, per microbatch
    "recompute_keep_bytes": "int",  # bytes kept per microbatch when the unit recomputes: its inputs
}
#: Columns of units.csv added within version 1, with the value a profile written before them gets: `source`, how
#: the row was obtained (UNIT_SOURCES), and `same_as`, for a "shared" row the unit whose measurement it copies, for
#: an "analytic" row the unit whose counts it copies (-1 otherwise); `expert_param_bytes`, the part of param_bytes in
#: stacked-experts modules (what expert parallelism divides by ep), and `moe_layers`, how many the unit has
#: (autopp.model.experts.expert_bytes; 0 in profiles before them).
OPTIONAL_UNIT_COLUMNS: dict[str, tuple[str, Any]] = {"source": ("str", "measured"), "same_as": ("int", -1),
                                                     "expert_param_bytes": ("int", 0), "moe_layers": ("int", 0)}
#: The passes whose expert GEMMs an analytic profile of a mixture of experts times apart (the recomputed forward runs
#: the forward's), and the three parts of each (docs/profile-format.md): `flop`, their FLOPs at the roofline's
#: compute peak; `weights`, the bytes of the stacked expert weights (or their gradients) they read or write at its
#: bandwidth; `other`, their other bytes (routed rows in and out). What expert parallelism re-times
#: (autopp.costmodel.experts): optional, absent from measured profiles and from analytic ones counted before them.
EXPERT_PASSES = ("forward", "backward", "backward_input", "backward_weight", "selective_recompute")
EXPERT_PARTS = ("flop", "weights", "other")


def expert_column(phase: str, part: str) -> str:
    """The units.csv column of the expert GEMMs' `part` (EXPERT_PARTS) in pass `phase` (EXPERT_PASSES)."""
    return f"expert_{part}_{phase}_s"


EXPERT_COLUMNS: dict[str, str] = {expert_column(p, part): "float" for p in EXPERT_PASSES for part in EXPERT_PARTS}
#: Values of the `source` column: measured on the unit itself; copied from the measured unit `same_as` of the same
#: structure and input shapes; computed by the analytic cost model (autopp.measure.analytic).
UNIT_SOURCES = ("measured", "shared", "analytic")
#: Columns of edges.csv: tensors live across cuts. src -1 is the model input.
EDGE_COLUMNS: dict[str, str] = {"src": "int", "dst": "int", "microbatch_size": "int", "bytes": "int"}


@dataclass(frozen=True)
class ProfileMeta:
    """Where and how a profile was measured."""

    model_path: str
    fingerprint: str
    unit_names: tuple[str, ...]
    split_points: tuple[str, ...]  # split point of units 1..n-1 (unit 0 starts the model)
    microbatch_sizes: tuple[int, ...]
    device: str
    torch_version: str
    num_threads: int
    optimizer: str
    repeats: int
    warmup: int
    version: int = PROFILE_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    """Parameter and activation dtype while measuring."""
    time_budget_s: float | None = None
    """Timed runs per unit stopped early once this much time was spent (None: always `repeats`)."""
    whole_model: tuple[dict[str, Any], ...] = ()
    """Per microbatch size: `whole_s` (one unsplit forward + loss + backward), `units_s` (sum of the units' forward
    and backward medians) and `gap` (units_s / whole_s - 1)."""
    live_values: tuple[LiveValue, ...] = ()
    """Values read by a later unit, each once."""
    tied_parameters: tuple[TiedGroup, ...] = ()
    """Parameters shared between units (held once in the model, a copy per unit when cut)."""
    co_runners: int = 0
    """Processes that trained the model beside the timing (the other ranks of a CPU host; 0: timed alone)."""
    optimizer_step_s: float = 0.0
    """One step's work on the whole model's parameters after the backward: torch's gradient scaling by the
    microbatch count, the optimizer's step and zero_grad (median; 0 in profiles that predate it). A rank takes the
    share of its parameter bytes."""
    runtime_forward_s: float = 0.0
    """torch's pipelining runtime's own time in each forward action of a stage, around its compute (with the last
    stage's loss call; autopp.measure.runtime): once per F of every stage, however many units it has (0 in profiles
    that predate it, analytic ones and GPU ones)."""
    runtime_backward_s: float = 0.0
    """The same in each backward action (B, or I where the backward is split)."""
    resume_s: float = 0.0
    """Extra time of an action that starts after its rank waited (idle) for its input, against one run back to
    back as the units were timed (autopp.measure.runtime; `StageCost.resume_s`): 0 in profiles that predate it,
    analytic ones and GPU ones."""
    tp_plan: dict[str, str] = field(default_factory=dict)
    """The tensor-parallel plan the TP rows were made with: module-name pattern -> style ({}: none)."""
    tp_plan_source: str = ""
    """Where the plan came from (autopp.model.tp.TpPlan.source)."""
    tp_degrees: tuple[int, ...] = ()
    """The degrees >= 2 that tp.csv has rows of (Profile.tp_units); () without TP rows."""

    def to_json(self) -> dict[str, Any]:
        plain = replace(self, live_values=(), tied_parameters=())
        return {**asdict(plain), "live_values": [v.to_json() for v in self.live_values],
                "tied_parameters": [g.to_json() for g in self.tied_parameters]}

    @staticmethod
    def from_json(data: dict[str, Any], where: str) -> ProfileMeta:
        f = Fields(where, ProfileError, _REPROFILE)
        if f.obj(data).get("version") != PROFILE_VERSION:
            f.fail(f"profile version {data.get('version')!r} is not {PROFILE_VERSION}")
        f.record(data, ProfileMeta)
        _check_meta_types(data, f)
        check_tp_meta(data, f)
        listed = ("unit_names", "split_points", "microbatch_sizes", "whole_model", "tp_degrees")
        tuples: dict[str, Any] = {k: tuple(data.get(k, ())) for k in listed}
        return replace(ProfileMeta(**data), **tuples,
                       live_values=tuple(LiveValue.from_json(v, where)
                                         for v in f.entries(data.get("live_values", []), "live_values")),
                       tied_parameters=tuple(TiedGroup.from_json(g, where)
                                             for g in f.entries(data.get("tied_parameters", []), "tied_parameters")))


def _check_meta_types(data: dict[str, Any], f: Fields) -> None:
    """The fields that the planner reads, typed: strings, lists of names, positive sizes."""
    for name in ("model_path", "fingerprint"):
        f.string(data[name], name)
    for name in ("unit_names", "split_points"):
        f.strings(data[name], name, noun="module names")
    f.integers(data["microbatch_sizes"], "microbatch_sizes", 1, non_empty=True)
    for name in ("runtime_forward_s", "runtime_backward_s", "resume_s"):
        if name in data:
            f.number(data[name], name)


@dataclass(frozen=True)
class Profile:
    """Measured costs of a model's units."""

    meta: ProfileMeta
    units: pd.DataFrame
    edges: pd.DataFrame
    tp_units: pd.DataFrame | None = None
    """tp.csv's rows (autopp.data.profile_tp.TP_COLUMNS), one per (unit, size, degree of `meta.tp_degrees`)."""

    def __post_init__(self) -> None:
        missing = {c: default for c, (_, default) in OPTIONAL_UNIT_COLUMNS.items() if c not in self.units.columns}
        if missing:  # a profile written before these columns, or a table built without them
            object.__setattr__(self, "units", self.units.assign(**missing))
        _validate(self.meta, self.units, self.edges, f"profile of {self.meta.model_path}")
        validate_tp(self.tp_units, self.num_units, self.meta.microbatch_sizes, self.meta.tp_degrees,
                    f"profile of {self.meta.model_path}")

    def unit_peak_bytes(self, tp: int = 1) -> dict[int, dict[int, int]]:
        """The peak bytes allocated during each unit's forward and backward, {unit: {microbatch size: bytes}}, as
        measured (`extra.peak_bytes`; `extra.cuda_peak_bytes` before it), with `tp` > 1 on a TP rank's shard
        (`extra.tp_peak_bytes`, counted with the tp.csv rows); empty when not measured or counted."""
        stored = self.meta.extra.get("peak_bytes", self.meta.extra.get("cuda_peak_bytes", {})) if tp == 1 else \
            self.meta.extra.get("tp_peak_bytes", {}).get(str(tp), {})
        return {int(u): {int(b): int(n) for b, n in per.items()} for u, per in stored.items()}

    @property
    def num_units(self) -> int:
        return len(self.meta.unit_names)

    @property
    def experts_untimed(self) -> bool:
        """A mixture of experts (a unit with `moe_layers`) whose profile does not time its expert GEMMs apart
        (EXPERT_COLUMNS absent: measured, or counted before them): expert parallelism keeps their ep-1 times."""
        return bool((self.units.moe_layers > 0).any()) and not all(c in self.units.columns for c in EXPERT_COLUMNS)

    def unit_modules(self) -> list[list[str]]:
        """Each unit's module names, in unit order (the `modules` column, one entry per unit)."""
        units = self.units.drop_duplicates("unit").sort_values("unit")
        return [str(m).split() for m in units["modules"]]

    def graph(self, microbatch_size: int | None = None) -> nx.DiGraph:
        """Units as nodes (attributes: the table's columns), live tensors as edges (attribute `bytes`)."""
        b = microbatch_size or self.meta.microbatch_sizes[0]
        g: nx.DiGraph[int] = nx.DiGraph(fingerprint=self.meta.fingerprint, microbatch_size=b)
        for row in self.units[self.units.microbatch_size == b].to_dict("records"):
            g.add_node(int(row["unit"]), **row)
        g.add_node(-1, name="input")
        for row in self.edges[self.edges.microbatch_size == b].to_dict("records"):
            g.add_edge(int(row["src"]), int(row["dst"]), bytes=int(row["bytes"]))
        return g

    def cut_bytes(self, microbatch_size: float, recompute: bool = False) -> list[int]:
        """Bytes live across the cut before unit k, for k = 1..n-1 (index k-1): every value produced by a unit < k
        and read by a unit >= k, counted once however many units read it (a non-neighbour value is relayed across
        every cut it spans). With `recompute`, values the profile marks recomputable are left out."""
        sizes = self.meta.microbatch_sizes
        out = []
        for k in range(1, self.num_units):
            if self.meta.live_values:
                per_size = [float(sum(v.bytes[b] for v in self.meta.live_values
                                      if 0 <= v.src and v.crosses(k)
                                      and not (recompute and v.action is ValueAction.RECOMPUTE))) for b in sizes]
            else:
                per_size = [float(self.edges[(self.edges.microbatch_size == b) & (self.edges.src < k)
                                             & (self.edges.src >= 0) & (self.edges.dst >= k)].bytes.sum())
                            for b in sizes]
            out.append(int(round(_interp(sizes, per_size, microbatch_size))))
        return out

    def cut_values(self, k: int) -> list[LiveValue]:
        """The live values crossing the cut before unit k (entries of `meta.live_values`)."""
        return [v for v in self.meta.live_values if v.crosses(k)]

    def save(self, directory: str | Path) -> Path:
        """Write the four files into `directory` atomically: into a temporary sibling, then swapped into place by
        `_swap_in` (a complete profile stays on disk at every moment). `model_path` is stored relative to
        `directory` (docs/profile-format.md)."""
        target = Path(directory)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:  # the CLI's own check (preflight): new, empty, or an earlier profile
            check_output_dir(target, marker="meta.json", kind="profile")
        except AutoppError as exc:
            raise ProfileError(str(exc)) from None
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        shared_mode(tmp, directory=True)
        meta = {**self.meta.to_json(), "model_path": stored_path(self.meta.model_path, target)}
        try:
            self.units.to_csv(tmp / "units.csv", index=False)
            self.edges.to_csv(tmp / "edges.csv", index=False)
            if self.tp_units is not None:
                self.tp_units.to_csv(tmp / TP_FILE, index=False)
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            graph = nx.node_link_data(self.graph(), edges="edges")
            (tmp / "graph.json").write_text(json.dumps(graph, sort_keys=True) + "\n")
            _swap_in(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return target


#: Name prefix of a replaced profile while its successor is renamed into place (see `_swap_in`).
ASIDE_PREFIX = ".old."


def _swap_in(new: Path, target: Path) -> None:
    """Move the complete directory `new` to `target`, replacing a profile there without a moment when neither is
    on disk: (1) rename the old profile aside (`.old.NAME.*`), (2) rename `new` into place, (3) delete the old one.
    A failure in (2) renames the old one back; a kill between (1) and (2) leaves it aside, where `load_profile`'s
    error points to it. Each rename is atomic (same directory)."""
    if not target.exists():
        os.replace(new, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f"{ASIDE_PREFIX}{target.name}.", dir=target.parent))
    os.replace(target, aside)  # (1) onto the empty directory just made: POSIX rename replaces an empty directory
    try:
        os.replace(new, target)  # (2)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)  # (3)


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = 0
    while i < len(xs) - 2 and x > xs[i + 1]:
        i += 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))




def _read_meta(path: Path) -> ProfileMeta:
    """meta.json as ProfileMeta; a ProfileError naming the file (and line) when it is not readable JSON."""
    return ProfileMeta.from_json(read_json(path, "profile meta.json", ProfileError, _REPROFILE), str(path))


def _read_csv(path: Path, **kwargs: Any) -> pd.DataFrame:
    """A profile table; a ProfileError naming the file when it is missing or not CSV."""
    try:
        return pd.read_csv(path, **kwargs)
    except FileNotFoundError:
        raise ProfileError(f"{path}: missing from the profile directory: {_REPROFILE}") from None
    except (OSError, ValueError) as exc:  # pandas' EmptyDataError and ParserError are ValueErrors
        raise ProfileError(f"{path}: cannot read ({str(exc).strip().splitlines()[0]}): {_REPROFILE}") from None


def _validate(meta: ProfileMeta, units: pd.DataFrame, edges: pd.DataFrame, where: str) -> None:
    """Reject missing columns, non-numeric, NaN, infinite or negative values, and rows that miss a (unit, size)."""
    for table, columns, name in ((units, UNIT_COLUMNS, "units.csv"), (edges, EDGE_COLUMNS, "edges.csv")):
        check_numbers(table, columns, where, name)
    if any(c in units.columns for c in POLICY_COLUMNS):  # the activation policies' own figures (optional)
        check_numbers(units, POLICY_COLUMNS, where, "units.csv")
    if any(c in units.columns for c in EXPERT_COLUMNS):  # the expert GEMMs' parts (optional, all or none)
        check_numbers(units, EXPERT_COLUMNS, where, "units.csv")
    n = len(meta.unit_names)
    expected = {(u, b) for u in range(n) for b in meta.microbatch_sizes}
    got = [(int(u), int(b)) for u, b in zip(units.unit, units.microbatch_size)]
    if sorted(got) != sorted(expected):
        raise ProfileError(f"{where}/units.csv: {len(got)} rows do not cover units 0..{n - 1} at microbatch sizes "
                           f"{list(meta.microbatch_sizes)} exactly once each (the file is damaged or cut short): "
                           f"{_REPROFILE}")
    if len(meta.split_points) != n - 1:
        raise ProfileError(f"{where}/meta.json: {len(meta.split_points)} split points for {n} units")
    if all(c in units.columns for c in ("source", "same_as")):  # absent: a profile before them (filled in)
        _validate_sources(units, where)
    if "moe_layers" in units.columns and units.moe_layers.any() and not isinstance(
            (meta.extra.get("moe") or {}).get("num_experts"), int):  # autopp.model.experts.moe_facts
        raise ProfileError(f"{where}/meta.json: units.csv counts MoE layers but extra.moe records no num_experts "
                           f"(the file is damaged): {_REPROFILE}")


def _validate_sources(units: pd.DataFrame, where: str) -> None:
    """`source` is one of UNIT_SOURCES; a "shared" row's `same_as` names a measured unit, an "analytic" row's is -1
    or names an analytic unit that was counted itself (`same_as` -1); a "measured" row's is -1."""
    source = units.source.to_numpy()
    bad = ~np.isin(source, UNIT_SOURCES)
    if bad.any():
        row = int(bad.nonzero()[0][0])
        raise ProfileError(f"{where}/units.csv: line {int(units.index[row]) + 2}, column source: "
                           f"{source[row]!r} is not one of {list(UNIT_SOURCES)}: {_REPROFILE}")
    same = pd.to_numeric(units.same_as, errors="coerce").to_numpy(dtype=float, na_value=np.nan)
    copy = (source == "shared") | (source == "analytic") & (same != -1)
    originals = units.unit.to_numpy()[(source != "shared") & (same == -1)].astype(int)
    wrong = copy & ~np.isin(same, originals) | (source == "measured") & (same != -1)
    if wrong.any():
        row = int(wrong.nonzero()[0][0])
        raise ProfileError(f"{where}/units.csv: line {row + 2}, column same_as: {units.same_as.iloc[row]} must be "
                           f"a unit that is no copy itself when source is 'shared' (or 'analytic', where -1 is "
                           f"also allowed), else -1: {_REPROFILE}")


def load_profile(directory: str | Path, fingerprint: str | None = None) -> Profile:
    """Read a profile directory; reject missing files, bad columns, NaN or negative values, a foreign fingerprint."""
    d = Path(directory)
    if not (d / "meta.json").is_file():
        raise ProfileError(f"{d}: not a profile directory (no meta.json); {_recovery_hint(d)}")
    try:
        meta = _read_meta(d / "meta.json")
        meta = replace(meta, model_path=resolved_path(meta.model_path, d))  # stored relative to `d`
        units = _read_csv(d / "units.csv", keep_default_na=False, na_values=[""],
                          dtype={"modules": str, "name": str, "source": str})
        edges = _read_csv(d / "edges.csv")
        tp_units = _read_csv(d / TP_FILE) if meta.tp_degrees or (d / TP_FILE).exists() else None
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{d}: cannot read profile: {exc}") from exc
    if fingerprint is not None and meta.fingerprint != fingerprint:
        raise ProfileError(f"{d}: profile fingerprint {meta.fingerprint} does not match the model ({fingerprint}); "
                           "the model changed since profiling: run `autopp profile` again")
    _validate(meta, units, edges, str(d))
    validate_tp(tp_units, len(meta.unit_names), meta.microbatch_sizes, meta.tp_degrees, str(d))
    return Profile(meta, units, edges, tp_units)


def _recovery_hint(d: Path) -> str:
    """What to do about a missing profile: rename back the one a killed save left aside, or create one."""
    asides = sorted(d.parent.glob(f"{ASIDE_PREFIX}{d.name}.*/meta.json")) if d.parent.is_dir() else []
    if asides and not d.exists():
        return f"a save was interrupted: the previous profile is {asides[-1].parent}; rename it to {d}"
    return "create one with `autopp profile MODEL.py`"

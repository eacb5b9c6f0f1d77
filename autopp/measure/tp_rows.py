"""A profile's tensor-parallel rows (tp.csv), measured or counted: the model's plan (autopp.model.tp) resolved and
checked against the degrees asked for, each degree's local shard measured (autopp.measure.pieces) or counted
(autopp.measure.analytic) as a model of its own (counted also under sequence parallelism, autopp.model.tp_sequence),
and each unit's TP collectives per microbatch counted from one forward of the full model on fake tensors."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

import pandas as pd
import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..data.profile_tp import SP_COLUMNS, SP_TIME_COLUMNS, TP_COLUMNS
from ..errors import AutoppError, TpPlanError
from ..model.contract import ModelFile
from ..model.fake import run_fake
from ..model.meta import MetaModel, build_units
from ..model.tp import TpPlan, check_degree, find_tp_plan, local_model_file, resolve, sequence_modules, tp_degrees
from ..model.tp_collectives import TpCollectives, unit_collectives
from ..model.tp_sequence import sequence_model_file
from ..model.units import Unit
from .counting import PieceCounts
from .pieces import measure_pieces
from .settings import Settings

__all__ = ["TpSetup", "tp_setup", "tp_meta", "tp_collectives", "tp_row", "tp_table", "sp_counted", "counted_rows",
           "local_units", "check_same_units", "measured_tp_rows"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class TpSetup:
    """The plan, its modules, and the degrees (>= 2) to make rows of."""

    plan: TpPlan | None
    resolved: dict[str, str]
    degrees: tuple[int, ...]
    sequence: tuple[str, ...] = ()
    """The modules sequence parallelism shards (autopp.model.tp.sequence_modules), whose inputs the rows count."""


def tp_setup(mf: ModelFile, model: nn.Module, degrees: Iterable[int] | None, limit: int = 8) -> TpSetup:
    """The model's plan resolved on `model`, and the degrees: those asked for (1 dropped, none left: no rows; each
    checked to divide every sharded dimension), or with None every degree in 2..`limit` that divides them (none
    without a plan).
    TpPlanError when degrees are asked for and the model has no plan."""
    asked = None if degrees is None else sorted({int(t) for t in degrees} - {1})
    if asked == []:  # no degree >= 2 asked for: no rows, and the plan is not even looked at
        return TpSetup(None, {}, ())
    plan = find_tp_plan(mf, model, counting=True)
    if plan is None:
        if asked:
            raise TpPlanError(f"{mf.path}: tensor parallelism (tp {', '.join(map(str, asked))}) needs a TP plan, and "
                              "the model has none (no TP_PLAN in the model file, no Hugging Face base_model_tp_plan); "
                              "define TP_PLAN (README.md) or leave out --tp")
        return TpSetup(None, {}, ())
    resolved = resolve(plan, model)
    sequence = tuple(sequence_modules(plan, model, resolved))
    if asked is None:
        return TpSetup(plan, resolved, tuple(t for t in tp_degrees(model, resolved, limit) if t > 1), sequence)
    for t in asked:
        check_degree(model, resolved, t)
    return TpSetup(plan, resolved, tuple(asked), sequence)


def tp_meta(setup: TpSetup) -> dict[str, Any]:
    """ProfileMeta's TP fields for the rows made with `setup` (none without rows)."""
    if not setup.degrees or setup.plan is None:
        return {}
    return {"tp_plan": dict(setup.plan.patterns), "tp_plan_source": setup.plan.source, "tp_degrees": setup.degrees}


def tp_collectives(mf: ModelFile, model: nn.Module, resolved: dict[str, str], units: list[Unit], b: int,
                   dtype: torch.dtype, sequence: tuple[str, ...] = ()) -> list[TpCollectives]:
    """Each unit's TP collectives per microbatch of `b` (autopp.model.tp_collectives.unit_collectives), and its
    `sequence` modules' input bytes, from one forward of the full `model` (on meta, in `dtype`) on fake tensors."""
    inputs, _ = mf.sample_batch(b)
    inputs = pytree.tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                             inputs)
    with torch.no_grad():
        return unit_collectives(model, resolved, [u.modules for u in units],
                                lambda: run_fake(lambda *i: model(*i), *inputs), sequence)


def tp_row(row: dict[str, Any], t: int, comm: TpCollectives, sp: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tp.csv row from a unit's row of the local shard (measured or counted) at degree `t`; with `sp`, the same
    unit's row of the shard under sequence parallelism, whose times fill `SP_TIME_COLUMNS`."""
    values = {**row, "tp": t, **comm.columns(), **{f"sp_{k}": v for k, v in (sp or {}).items()}}
    return {c: values[c] for c in (*TP_COLUMNS, *SP_COLUMNS, *(SP_TIME_COLUMNS if sp is not None else ()))}


def tp_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """tp.csv's table of `rows`, sorted; the `SP_TIME_COLUMNS` only when every row has them (a degree whose shard
    under SP could not be counted leaves them out for all: plans with SP then keep the times without it)."""
    sp = bool(rows) and all(c in r for r in rows for c in SP_TIME_COLUMNS)
    table = pd.DataFrame(rows, columns=[*TP_COLUMNS, *SP_COLUMNS, *(SP_TIME_COLUMNS if sp else ())])
    return table.sort_values(["tp", "microbatch_size", "unit"], kind="stable").reset_index(drop=True)


def sp_counted(count: Callable[..., T], mf: ModelFile, setup: TpSetup, t: int) -> T | None:
    """`count(the local shard at degree t under sequence parallelism, tag=its progress tag)`: None without sequence-wise
    modules, or when torch fails on that shard (logged; the rows then lack the SP times, `tp_table`)."""
    if not setup.sequence:
        return None
    try:
        return count(sequence_model_file(mf, setup.resolved, setup.sequence, t), tag=f" (tp {t}, sp)")
    except AutoppError as exc:
        log.warning("tp %d under sequence parallelism not counted (plans with sp keep the times without it): %s",
                    t, exc)
        return None


def counted_rows(local: Any, sp: Any | None, t: int, comms: dict[int, list[TpCollectives]],
                 times: Callable[[PieceCounts], dict[str, float]]) -> list[dict[str, Any]]:
    """tp.csv's rows of degree `t` counted: each unit of the `local` shard's counts (autopp.measure.analytic.
    ModelCounts, not imported: it imports this module), its times (`times`, the roofline's), its collectives (`comms`
    by microbatch size, by unit), and its times under SP from `sp` (the shard counted under sequence parallelism,
    `sp_counted`; None: not counted)."""
    under_sp = {(r.unit, r.microbatch_size): times(r.counts) for r in (sp.rows if sp is not None else ())}
    return [tp_row({**times(r.counts), **r.static, "unit": r.unit, "microbatch_size": r.microbatch_size,
                    "activation_bytes": r.counts.activation_bytes}, t, comms[r.microbatch_size][r.unit],
                   under_sp.get((r.unit, r.microbatch_size))) for r in local.rows]


def local_units(mf: ModelFile, resolved: dict[str, str], t: int, units: list[Unit], dtype: torch.dtype
                ) -> tuple[ModelFile, MetaModel, list[Unit]]:
    """The local shard at degree `t` as a model file, built on meta, with its units, which must be the model's."""
    local = local_model_file(mf, resolved, t)
    meta, found, _ = build_units(local, dtype)
    check_same_units(mf, t, found, units)
    return local, meta, found


def check_same_units(mf: ModelFile, t: int, found: list[Unit], units: list[Unit]) -> None:
    """TpPlanError unless the local shard at degree `t` has the model's units (`found` against `units`)."""
    if [u.modules for u in found] != [u.modules for u in units]:
        raise TpPlanError(f"{mf.path}: the tensor-parallel shard at degree {t} splits into {len(found)} units, the "
                          f"model into {len(units)}; a TP plan must keep the module structure")


def measured_tp_rows(mf: ModelFile, meta: MetaModel, units: list[Unit], setup: TpSetup, settings: Settings,
                     limit_bytes: int) -> pd.DataFrame | None:
    """tp.csv's rows measured: each degree's local shard timed and sized like the units (shared units stay shared),
    the collectives counted on the full meta model."""
    if not setup.degrees:
        return None
    sizes, dtype = settings.options.microbatch_sizes, settings.options.torch_dtype
    comms = {b: tp_collectives(mf, meta.model, setup.resolved, units, b, dtype, setup.sequence) for b in sizes}
    rows = []
    for t in setup.degrees:
        local, local_meta, local_found = local_units(mf, setup.resolved, t, units, dtype)
        for b in sizes:
            with settings.beside(mf, b):
                at_b = measure_pieces(local, local_meta, local_found, b, settings, limit_bytes=limit_bytes)
            rows += [tp_row(r, t, comms[b][r["unit"]]) for r in at_b.rows]
    return pd.DataFrame(rows, columns=[*TP_COLUMNS, *SP_COLUMNS])

"""A published run's memory at its peak rank, term by term, from autopp's own arrays (quoted in docs/published.md).

For each run of scripts/published.py asked for, the pinned configuration is planned as that script plans it (with the
memory its reason says works when it does not fit the run's GPUs), and the peak rank's bytes are split into the terms
autopp counts: per stage on that rank the static bytes (`autopp.costmodel.parallel.static_terms`: the weights
computed with, FSDP2's sharded parameters, gradients, optimizer state with the master copy), what each in-flight
microbatch keeps (per-unit recomputation: the stage's input as received and the inputs its units make for each other,
`UnitArrays.checkpoint_inputs`) times the microbatches in flight at the peak of the rank's order, what a backward
re-materialises at that moment, and the largest working memory of its units (autopp.schedule.effects, TRANSIENT).

    PYTHONPATH=$PWD .venv/bin/python scripts/memory_terms.py --runs titan-1f1b,titan-interleaved,automodel-qwen3-30b
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autopp.costmodel import group_table  # noqa: E402
from autopp.costmodel.parallel import STATIC_TERMS, static_terms  # noqa: E402
from autopp.data.plan import Plan  # noqa: E402
from autopp.predict import plan_order, plan_stage_costs  # noqa: E402
from autopp.schedule import Activation, policy  # noqa: E402
from autopp.schedule.actions import COMPUTE_KINDS, Kind  # noqa: E402
from autopp.schedule.effects import added_at_start, footprint, freed_at_end, transient_peak  # noqa: E402
from autopp.sizes import parse_size  # noqa: E402

GIB = 1 << 30


def _published() -> ModuleType:
    """scripts/published.py as a module (its runs and how it plans them)."""
    spec = importlib.util.spec_from_file_location("published", ROOT / "scripts" / "published.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["published"] = module
    spec.loader.exec_module(module)
    return module


def pinned_plan(pub: ModuleType, run: object) -> tuple[Plan, str]:
    """The run's pinned plan as published.py makes it, and a note: at the run's memory, or at the memory autopp's
    reason says works when it does not fit."""
    profile = pub.profile_for(run, run.tp_degrees, run.precision, run.kernels)  # type: ignore[attr-defined]
    cluster = pub.cluster_of(run)
    request = pub.pinned_request(run, cluster)
    plan, why, _ = pub._plan(profile, request)
    if plan is not None:
        return plan, f"at the run's {cluster.memory_bytes / GIB:.1f} GiB usable"
    if "`memory_bytes` " not in why:
        raise SystemExit(f"{run.key}: no plan and no memory that works: {why}")  # type: ignore[attr-defined]
    need = parse_size(why.split("`memory_bytes` ")[1].split()[0])
    plan, why, _ = pub._plan(profile, replace(request, cluster=replace(cluster, memory_bytes=need)))
    if plan is None:
        raise SystemExit(f"{run.key}: no plan at {need / GIB:.1f} GiB either: {why}")  # type: ignore[attr-defined]
    return plan, f"does not fit the run's {cluster.memory_bytes / GIB:.1f} GiB: planned with {need / GIB:.1f} GiB"


def peak_moment(plan: Plan, rank: int) -> tuple[int, dict[int, int], dict[int, int]]:
    """Walk `rank`'s compute actions as `autopp.schedule.effects.rank_peak` does: the most bytes held beyond the
    static ones, and at that moment, per stage, the microbatches in flight and the backwards re-materialising."""
    costs, acts = plan_stage_costs(plan), [s.activation for s in plan.stages]
    held = best = 0
    live: dict[int, int] = {}
    redoing: dict[int, int] = {}
    at: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for s, kind, _ in (a for a in plan_order(plan)[rank] if a.kind in COMPUTE_KINDS):
        f = footprint(costs[s], acts[s])
        held += added_at_start(kind, f)
        live[s] = live.get(s, 0) + (kind is Kind.F)
        redoing[s] = redoing.get(s, 0) + (kind in (Kind.B, Kind.I) and f.redone > 0)
        if held > best:
            best, at = held, (dict(live), dict(redoing))
        held -= freed_at_end(kind, f)
        if kind in (Kind.B, Kind.W):
            live[s] -= 1
            redoing[s] -= f.redone > 0
    return best, at[0], at[1]


def terms(plan: Plan, profile: object) -> tuple[list[tuple[str, float]], list[str]]:
    """(term, bytes) at the plan's peak rank, summing to its walked peak, and notes on how autopp counted them
    before 2026-12-05."""
    rank = int(np.argmax(plan.predicted.peak_memory_bytes))
    mine = [s for s in plan.stages if s.rank == rank]
    view = plan.layout.unit_view()
    a = group_table(profile, view).arrays(plan.microbatch_size)  # type: ignore[arg-type]
    parts = static_terms(a, view)
    out = [(f"{name} ({len(mine)} stage{'s' * (len(mine) > 1)})",
            float(sum(parts[name][s.units[0]:s.units[1]].sum() for s in mine))) for name in STATIC_TERMS]
    extra = sum(s.static_bytes for s in mine) - sum(b for _, b in out)
    if abs(extra) > 1:
        out.append(("other static (vocabulary passes, rounding)", float(extra)))
    _, live, redoing = peak_moment(plan, rank)
    costs = plan_stage_costs(plan)
    for s in mine:
        i, j = s.units
        f = footprint(costs[s.index], s.activation)
        n = live.get(s.index, 0)
        what = f"stage {s.index} (units {i}-{j - 1}, {s.activation.value}): {n} in flight x {f.kept / GIB:.3f} GiB"
        if s.activation in (Activation.BLOCKS, Activation.SELECTIVE_UNITS):
            whole = float(a.cut[i:j].sum())
            what += (f" (input {a.cut[i] / GIB:.3f} + made inside {(a.checkpoint_inputs(i, j) - a.cut[i]) / GIB:.3f};"
                     f" each cut whole: {whole / GIB:.3f})")
        out.append((what, float(n * f.kept)))
        if redoing.get(s.index, 0):
            out.append((f"stage {s.index}: a backward re-materialising ({policy(s.activation).summary})",
                        float(redoing[s.index] * f.redone)))
    out.append(("largest working memory of the rank's units (TRANSIENT)",
                float(transient_peak((s.index for s in mine), costs))))
    e = a.expert
    whole = e.params if e is not None and e.replicas == 1 and view.fsdp else np.zeros(a.n)
    experts = float(sum(whole[s.units[0]:s.units[1]].sum() for s in mine))
    copy = static_terms(replace(a, master=False), view)["sharded parameters"] - whole
    before = float(sum(copy[s.units[0]:s.units[1]].sum() for s in mine))
    notes = [f"FSDP2's sharded parameters beside the master copy, as counted before 2026-12-05: {before / GIB:.2f} GiB"
             if a.master else "no master copy in the recipe: the sharded parameters are the weights the optimizer "
                              "steps (of which the experts' with ep = dp, whole on their rank: "
                              f"{experts / GIB:.2f} GiB)"]
    if experts and a.master:
        notes.append(f"the experts' weights with ep = dp under FSDP2, counted whole and persistent until 2026-12-05 "
                     f"(now FSDP2 over one rank, gathered per unit as working memory): {experts / GIB:.2f} GiB")
    return out, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", required=True, help="comma-separated keys of scripts/published.py's runs")
    args = parser.parse_args()
    pub = _published()
    runs = {r.key: r for r in pub.RUNS}
    for key in args.runs.split(","):
        run = runs[key]
        plan, note = pinned_plan(pub, run)
        rows, notes = terms(plan, pub.profile_for(run, run.tp_degrees, run.precision, run.kernels))
        peak = max(plan.predicted.peak_memory_bytes)
        print(f"\n{key}: {pub.describe_config(plan)}, {note}; simulated peak {peak / GIB:.2f} GiB, rank "
              f"{int(np.argmax(plan.predicted.peak_memory_bytes))} of {plan.layout.pp}\n")
        print("| term at the peak rank | GiB |\n|---|---:|")
        for name, value in rows:
            print(f"| {name} | {value / GIB:.2f} |")
        print(f"| sum (the order walk's peak) | {sum(v for _, v in rows) / GIB:.2f} |")
        print("", *notes, sep="\n", flush=True)


if __name__ == "__main__":
    main()

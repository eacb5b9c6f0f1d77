"""torch's per-rank action CSV (`compute_only`), as `_PipelineScheduleRuntime._load_csv` reads it."""

from __future__ import annotations

import csv
import io

from ..data.plan import Plan
from ..predict import plan_order
from .layers import ExportError
from ..schedule import describe, to_csv_rows
from .common import Exported, outputs_notes

__all__ = ["csv_text", "to_torch_csv"]


def csv_text(plan: Plan) -> str:
    """Row r = pipeline rank r, cells like `0F0`, `1I0`, `1W0` (the named schedule's order, or the custom one)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_csv_rows(plan_order(plan)))
    return out.getvalue()


def to_torch_csv(plan: Plan, where: str = "plan") -> Exported:
    """The CSV and how to load it; an ExportError for a schedule torch's runtime cannot run from one action list
    (Chimera's two pipelines: the same stage indices on mirrored ranks, `autopp.run.bidirectional`; Seq1F1B's
    sequence chunks, which autopp's runner splits, autopp.run.seq_chunks)."""
    if describe(plan.schedule).mirrored:
        raise ExportError(f"{where}: the plan's schedule is {plan.schedule.value}, whose two pipelines torch's "
                          f"_PipelineScheduleRuntime cannot run from one per-rank CSV (the same stages on mirrored "
                          f"ranks); run it with `autopp run`, or re-plan with --schedule 1F1B")
    if plan.seq_chunks is not None:
        raise ExportError(f"{where}: the plan's schedule is {plan.schedule.value}, whose microbatches run in "
                          f"{len(plan.seq_chunks.lengths)} sequence chunks each (seq_chunks), its CSV numbering "
                          "chunks, not microbatches: torch's _PipelineScheduleRuntime splits the batch, and runs them "
                          "only with autopp's chunking and K/V cache (autopp.run.seq_chunks); run it with `autopp "
                          "run`, or re-plan with --schedule 1F1B")
    note = (f"torch-csv: load with _PipelineScheduleRuntime(stages, n_microbatches={plan.num_microbatches}, ...)"
            "._load_csv(path, format='compute_only'); stages placed as in the plan")
    return Exported(csv_text(plan), {}, (note, *outputs_notes(plan, "torchtitan", "torch's PipelineStage")))

"""torch's per-rank action CSV (`compute_only`), as `_PipelineScheduleRuntime._load_csv` reads it."""

from __future__ import annotations

import csv
import io

from ..data.plan import Plan
from ..predict import plan_order
from ..schedule import to_csv_rows
from .common import Exported

__all__ = ["csv_text", "to_torch_csv"]


def csv_text(plan: Plan) -> str:
    """Row r = pipeline rank r, cells like `0F0`, `1I0`, `1W0` (the named schedule's order, or the custom one)."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_csv_rows(plan_order(plan)))
    return out.getvalue()


def to_torch_csv(plan: Plan) -> Exported:
    note = (f"torch-csv: load with _PipelineScheduleRuntime(stages, n_microbatches={plan.num_microbatches}, ...)"
            "._load_csv(path, format='compute_only'); stages placed as in the plan")
    return Exported(csv_text(plan), {}, (note,))

"""A profile's optional tensor-parallel rows (`tp.csv`, docs/profile-format.md): one row per (unit, microbatch size,
degree >= 2) with one TP rank's compute at sharded shapes, its bytes and its TP collectives per microbatch; their
metadata fields checked; and the table checks shared with units.csv. No torch here."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..errors import ProfileError
from .fields import Fields
from .profile_values import REPROFILE

__all__ = ["TP_FILE", "TP_COLUMNS", "SP_COLUMNS", "SP_TIME_COLUMNS", "check_numbers", "check_tp_meta", "validate_tp"]

#: The file name of the tensor-parallel rows in a profile directory.
TP_FILE = "tp.csv"
#: Columns of tp.csv, one row per (unit, microbatch size, tp) for tp >= 2: times of the rank's own compute at the
#: sharded shapes (collectives excluded), bytes per rank, and per microbatch the unit's TP collectives: the bytes S
#: of nccl-tests' formulas summed over them, and how many (for the latency term).
TP_COLUMNS: dict[str, str] = {
    "unit": "int", "microbatch_size": "int", "tp": "int",
    "forward_s": "float", "backward_s": "float", "backward_input_s": "float", "backward_weight_s": "float",
    "recompute_s": "float",
    "param_bytes": "int", "grad_bytes": "int", "optimizer_bytes": "int", "activation_bytes": "int",
    "tp_forward_allreduce_bytes": "int",  # rowwise and embedding_rowwise outputs; colwise_loss_parallel's 3 per token
    "tp_backward_allreduce_bytes": "int",  # input gradients of colwise modules, one per distinct input tensor
    "tp_forward_allgather_bytes": "int",  # colwise_gather_output outputs (full size)
    "tp_forward_collectives": "int",
    "tp_backward_collectives": "int",
}
#: Optional columns of tp.csv for sequence parallelism (profiles made before them lack them, and then SP is not
#: offered): the bytes of the inputs of the unit's sequence-wise modules (the norms between the sharded projections,
#: autopp.model.tp.sequence_modules), per rank at tp without SP; SP keeps 1/tp of them (Korthikanti et al. 2022).
SP_COLUMNS: dict[str, str] = {"sp_sequence_bytes": "int"}
#: Optional columns of tp.csv: the rank's compute times under sequence parallelism, its local shard counted with the
#: residual stream (norms, residual adds) on 1/tp of the sequence (autopp.model.tp_sequence); the plain time columns
#: count that stream whole on every rank, as DTensor TP without SP runs it. Without them (measured profiles, profiles
#: made before them) SP keeps the plain times, an upper bound.
SP_TIME_COLUMNS: dict[str, str] = {f"sp_{c}": "float" for c in ("forward_s", "backward_s", "backward_input_s",
                                                                  "backward_weight_s", "recompute_s")}


def check_numbers(table: pd.DataFrame, columns: dict[str, str], where: str, name: str) -> None:
    """Reject missing columns and non-numeric, NaN, infinite or negative values (but in `src`) of `table`, naming
    file `name`, the line and the column."""
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ProfileError(f"{where}/{name}: lacks column(s) {missing}; the file is damaged, cut short or from "
                           f"another version: {REPROFILE}")
    for c in (c for c, t in columns.items() if t != "str"):
        column = table[c]
        # A column read as numbers (the common case) is checked on its array; any other is coerced first.
        numeric = column if pd.api.types.is_numeric_dtype(column) else pd.to_numeric(column, errors="coerce")
        values = numeric.to_numpy(dtype=float, na_value=np.nan)
        bad = ~np.isfinite(values)
        if bad.any():
            row = int(bad.nonzero()[0][0])
            raw = column.iloc[row]
            shown = "an empty cell" if pd.isna(raw) else repr(str(raw))
            raise ProfileError(f"{where}/{name}: line {row + 2}, column {c}: {shown} is not a finite number; the "
                               f"file is damaged or cut short: {REPROFILE}")
        if c != "src" and (values < 0).any():
            row = int((values < 0).nonzero()[0][0])
            raise ProfileError(f"{where}/{name}: line {row + 2}, column {c}: {column.iloc[row]} is negative; "
                               f"{REPROFILE}")


def check_tp_meta(data: dict[str, Any], f: Fields) -> None:
    """meta.json's TP fields, when present: `tp_plan` an object of string -> string, `tp_plan_source` a string,
    `tp_degrees` a list of distinct integers >= 2."""
    f.text_map(data.get("tp_plan", {}), "tp_plan", "module-name pattern -> style")
    if not isinstance(data.get("tp_plan_source", ""), str):
        f.bad("tp_plan_source", "a string", data["tp_plan_source"])
    f.integers(data.get("tp_degrees", []), "tp_degrees", 2, distinct=True)


def validate_tp(tp_units: pd.DataFrame | None, units: int, sizes: tuple[int, ...], degrees: tuple[int, ...],
                where: str) -> None:
    """tp.csv's columns and values, and its rows covering units 0..`units`-1 at each microbatch size of `sizes`
    and each degree of `degrees` exactly once (no rows, no degrees: a profile without TP rows)."""
    if tp_units is None:
        if degrees:
            raise ProfileError(f"{where}/{TP_FILE}: missing, but meta.json lists tp_degrees {list(degrees)}: "
                               f"{REPROFILE}")
        return
    check_numbers(tp_units, TP_COLUMNS | {c: k for c, k in (SP_COLUMNS | SP_TIME_COLUMNS).items()
                                          if c in tp_units.columns}, where, TP_FILE)
    expected = sorted((u, b, t) for u in range(units) for b in sizes for t in degrees)
    got = sorted((int(u), int(b), int(t)) for u, b, t in zip(tp_units.unit, tp_units.microbatch_size, tp_units.tp))
    if got != expected:
        raise ProfileError(f"{where}/{TP_FILE}: {len(got)} rows do not cover units 0..{units - 1} at microbatch "
                           f"sizes {list(sizes)} and tp degrees {list(degrees)} (meta.json's tp_degrees) exactly once "
                           f"each: {REPROFILE}")

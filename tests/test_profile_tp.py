"""autopp.data.profile_tp: a profile's tp.csv rows and TP metadata saved and loaded back, old profiles without them,
and every damaged tp.csv or TP field refused in one line naming the file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from autopp.data.profile import TP_COLUMNS, Profile, load_profile
from autopp.errors import ProfileError

PLAN = {"h.*.mlp.0": "colwise", "h.*.mlp.2": "rowwise"}


def _tp_rows(profile: Profile, degrees: tuple[int, ...]) -> pd.DataFrame:
    """Rows for every unit, size and degree: the units' values divided by t, one all-reduce each way."""
    rows = []
    for t in degrees:
        for r in profile.units.to_dict("records"):
            row = {c: r[c] / t for c in TP_COLUMNS if c in r}
            row.update(unit=r["unit"], microbatch_size=r["microbatch_size"], tp=t, param_bytes=r["param_bytes"] // t,
                       grad_bytes=r["grad_bytes"] // t, optimizer_bytes=r["optimizer_bytes"] // t,
                       activation_bytes=r["activation_bytes"] // t, tp_forward_allreduce_bytes=r["output_bytes"],
                       tp_backward_allreduce_bytes=r["output_bytes"], tp_forward_allgather_bytes=0,
                       tp_forward_collectives=1, tp_backward_collectives=1)
            rows.append(row)
    return pd.DataFrame(rows, columns=list(TP_COLUMNS))


def _with_tp(profile: Profile, degrees: tuple[int, ...] = (2, 4)) -> Profile:
    meta = replace(profile.meta, tp_plan=PLAN, tp_plan_source="TP_PLAN in gpt.py", tp_degrees=degrees)
    return replace(profile, meta=meta, tp_units=_tp_rows(profile, degrees))


def test_tp_rows_round_trip(shipped_gpt: Profile, tmp_path: Path) -> None:
    profile = _with_tp(shipped_gpt)
    back = load_profile(profile.save(tmp_path / "p"))
    assert back.meta == profile.meta and back.meta.tp_degrees == (2, 4)
    assert back.tp_units is not None
    pd.testing.assert_frame_equal(back.tp_units, profile.tp_units, check_dtype=False)
    assert list(pd.read_csv(tmp_path / "p" / "tp.csv").columns) == list(TP_COLUMNS)


def test_a_profile_without_tp_rows_has_none(shipped_gpt: Profile, tmp_path: Path) -> None:
    assert shipped_gpt.tp_units is None and shipped_gpt.meta.tp_degrees == () and shipped_gpt.meta.tp_plan == {}
    shipped_gpt.save(tmp_path / "p")
    assert not (tmp_path / "p" / "tp.csv").exists()
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    for key in ("tp_plan", "tp_plan_source", "tp_degrees"):  # as a profile written before them
        del meta[key]
    (tmp_path / "p" / "meta.json").write_text(json.dumps(meta))
    assert load_profile(tmp_path / "p").tp_units is None


def _damaged(profile: Profile, tmp_path: Path, table: pd.DataFrame | None = None, **meta: object) -> str:
    d = _with_tp(profile).save(tmp_path / "p")
    if table is not None:
        table.to_csv(d / "tp.csv", index=False)
    data = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**data, **meta}))
    with pytest.raises(ProfileError) as info:
        load_profile(d)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_missing_row_or_degree_is_refused(shipped_gpt: Profile, tmp_path: Path) -> None:
    rows = _tp_rows(shipped_gpt, (2, 4))
    assert "tp.csv: 31 rows do not cover units 0..7 at microbatch sizes [1, 4] and tp degrees [2, 4]" in \
        _damaged(shipped_gpt, tmp_path, rows.iloc[1:])
    assert "tp.csv: 32 rows do not cover" in _damaged(shipped_gpt, tmp_path, rows, tp_degrees=[2, 8])
    (tmp_path / "q").mkdir()
    assert "tp.csv: 32 rows" in _damaged(shipped_gpt, tmp_path / "q", rows, tp_degrees=[])


def test_a_bad_value_names_line_and_column(shipped_gpt: Profile, tmp_path: Path) -> None:
    rows = _tp_rows(shipped_gpt, (2, 4))
    rows.loc[3, "tp_backward_allreduce_bytes"] = -1
    assert "/tp.csv: line 5, column tp_backward_allreduce_bytes: -1 is negative" in \
        _damaged(shipped_gpt, tmp_path, rows)
    assert "lacks column(s) ['tp_forward_collectives']" in \
        _damaged(shipped_gpt, tmp_path / "p", _tp_rows(shipped_gpt, (2, 4)).drop(columns="tp_forward_collectives"))


def test_missing_tp_csv_and_bad_meta_fields_are_refused(shipped_gpt: Profile, tmp_path: Path) -> None:
    d = _with_tp(shipped_gpt).save(tmp_path / "p")
    (d / "tp.csv").unlink()
    with pytest.raises(ProfileError, match=r"tp.csv: missing from the profile directory"):
        load_profile(d)
    bad = (("tp_degrees", [1, 2], "'tp_degrees' must be a list of distinct integers >= 2"),
           ("tp_degrees", [2, 2], "'tp_degrees' must be a list of distinct integers >= 2"),
           ("tp_plan", {"a": 1}, "'tp_plan' must be an object of module-name pattern -> style"),
           ("tp_plan_source", 3, "'tp_plan_source' must be a string"))
    for i, (field, value, message) in enumerate(bad):
        (tmp_path / str(i)).mkdir()
        assert message in _damaged(shipped_gpt, tmp_path / str(i), None, **{field: value})

"""Profile storage: exact round trip, interpolation, and rejection of damaged files with a message saying which."""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import pandas as pd
import pytest

from autopp.errors import ProfileError
from autopp.profile import Profile, load_profile


def test_round_trip_is_identical(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "p")
    back = load_profile(tmp_path / "p")
    assert back.meta == gpt_profile.meta
    pd.testing.assert_frame_equal(back.units, gpt_profile.units)
    pd.testing.assert_frame_equal(back.edges, gpt_profile.edges)
    stored = nx.node_link_graph(json.loads((tmp_path / "p" / "graph.json").read_text()), edges="edges")
    assert nx.utils.graphs_equal(stored, back.graph())


def test_interpolation_between_and_beyond_sizes(gpt_profile: Profile) -> None:
    rows = gpt_profile.units.set_index(["unit", "microbatch_size"])
    f1, f2 = rows.loc[(1, 1)].forward_s, rows.loc[(1, 2)].forward_s
    assert gpt_profile.costs(1)[1].forward_s == pytest.approx(f1)
    assert gpt_profile.costs(1.5)[1].forward_s == pytest.approx((f1 + f2) / 2)
    assert gpt_profile.costs(4)[1].forward_s == pytest.approx(max(0.0, f1 + 3 * (f2 - f1)))
    a1, a2 = rows.loc[(1, 1)].activation_bytes, rows.loc[(1, 2)].activation_bytes
    assert gpt_profile.costs(4)[1].activation_bytes == a1 + 3 * (a2 - a1)


def _damage(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    load_profile(src).save(dst)
    table = pd.read_csv(dst / "units.csv")
    edit(table).to_csv(dst / "units.csv", index=False)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.drop(columns=["backward_s"]), r"bad/units\.csv: lacks column\(s\) \['backward_s'\]"),
    (lambda t: t.assign(forward_s=float("nan")), r"bad/units\.csv: column forward_s row 1: .* is not a finite number"),
    (lambda t: t.assign(forward_s="abc"), r"column forward_s row 1: 'abc' is not a finite number"),
    (lambda t: t.assign(forward_s=float("inf")), r"column forward_s row 1: .* is not a finite number"),
    (lambda t: t.assign(param_bytes=-1), r"bad/units\.csv: column param_bytes has negative values"),
    (lambda t: t.iloc[1:], r"bad/units\.csv: rows do not cover units"),
])
def test_damaged_profiles_are_rejected(gpt_profile: Profile, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    gpt_profile.save(tmp_path / "src")
    with pytest.raises(ProfileError, match=message):
        load_profile(_damage(tmp_path / "src", tmp_path / "bad", edit))


def test_foreign_fingerprint_rejected(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "p")
    with pytest.raises(ProfileError, match="does not match the model"):
        load_profile(tmp_path / "p", fingerprint="0" * 16)


def test_not_a_profile(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="no meta.json"):
        load_profile(tmp_path)


SHIPPED = Path(__file__).resolve().parent.parent / "profiles"


@pytest.mark.parametrize("name", ["gpt", "mlp"])
def test_shipped_profiles_load_and_round_trip(name: str, tmp_path: Path) -> None:
    profile = load_profile(SHIPPED / name)
    assert profile.meta.whole_model and profile.meta.live_values
    profile.save(tmp_path / name)
    back = load_profile(tmp_path / name)
    assert back.meta == profile.meta
    pd.testing.assert_frame_equal(back.units, profile.units)


def test_shipped_gpt_profile_costs_and_cuts() -> None:
    profile = load_profile(SHIPPED / "gpt")
    costs = profile.costs(2)
    assert all(c.backward_input_s + c.backward_weight_s > 0 for c in costs)
    assert costs[0].backward_input_s == 0.0  # the first unit's inputs are the model's token ids
    assert all(c.recompute_keep_bytes > 0 for c in costs)
    # A chain: each cut carries one batch x context x width float32 activation.
    assert profile.cut_bytes(4) == [4 * 64 * 128 * 4] * (profile.num_units - 1)


def test_new_columns_are_required(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "src")
    with pytest.raises(ProfileError, match=r"lacks column\(s\) \['backward_input_s'\]"):
        load_profile(_damage(tmp_path / "src", tmp_path / "bad", lambda t: t.drop(columns=["backward_input_s"])))

"""Profile storage: exact round trip and rejection of damaged files with a message saying which (interpolation
between profiled sizes: tests/costmodel/test_units.py)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

import networkx as nx
import pandas as pd
import pytest

from autopp.errors import ProfileError
from autopp.data.profile import Profile, load_profile

from .conftest import ONE_PIPELINE


def test_round_trip_is_identical(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "p")
    back = load_profile(tmp_path / "p")
    assert back.meta == gpt_profile.meta
    pd.testing.assert_frame_equal(back.units, gpt_profile.units)
    pd.testing.assert_frame_equal(back.edges, gpt_profile.edges)
    stored = nx.node_link_graph(json.loads((tmp_path / "p" / "graph.json").read_text()), edges="edges")
    assert nx.utils.graphs_equal(stored, back.graph())


def _damage(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    load_profile(src).save(dst)
    table = pd.read_csv(dst / "units.csv")
    edit(table).to_csv(dst / "units.csv", index=False)
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.drop(columns=["backward_s"]),
     r"bad/units\.csv: lacks column\(s\) \['backward_s'\]; the file is damaged, cut short or from another version: "
     r"re-profile"),
    (lambda t: t.assign(forward_s=float("nan")),
     r"bad/units\.csv: line 2, column forward_s: an empty cell is not a finite number; .* re-profile"),
    (lambda t: t.assign(forward_s="abc"), r"line 2, column forward_s: 'abc' is not a finite number"),
    (lambda t: t.assign(forward_s=float("inf")), r"line 2, column forward_s: 'inf' is not a finite number"),
    (lambda t: t.assign(param_bytes=-1), r"bad/units\.csv: line 2, column param_bytes: -1 is negative"),
    (lambda t: t.iloc[1:], r"bad/units\.csv: \d+ rows do not cover units .* re-profile"),
])
def test_damaged_profiles_are_rejected(gpt_profile: Profile, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    gpt_profile.save(tmp_path / "src")
    with pytest.raises(ProfileError, match=message):
        load_profile(_damage(tmp_path / "src", tmp_path / "bad", edit))


def test_the_runtime_cost_per_action_round_trips_and_is_0_in_profiles_before_it(tmp_path: Path) -> None:
    shipped = load_profile(SHIPPED / "gpt")
    assert (shipped.meta.runtime_forward_s, shipped.meta.runtime_backward_s) == (0.0, 0.0)
    costly = replace(shipped, meta=replace(shipped.meta, runtime_forward_s=1e-4, runtime_backward_s=2e-4))
    costly.save(tmp_path / "p")
    back = load_profile(tmp_path / "p")
    assert (back.meta.runtime_forward_s, back.meta.runtime_backward_s) == (1e-4, 2e-4)
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    (tmp_path / "p" / "meta.json").write_text(json.dumps({**meta, "runtime_backward_s": "fast"}))
    with pytest.raises(ProfileError, match="runtime_backward_s"):
        load_profile(tmp_path / "p")


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
    rows = profile.units[profile.units.microbatch_size == 4].sort_values("unit")
    assert all(rows.backward_input_s + rows.backward_weight_s > 0)
    assert rows.backward_input_s.iloc[0] == 0.0  # the first unit's inputs are the model's token ids
    assert all(rows.recompute_keep_bytes > 0)
    # A chain: each cut carries one batch x context x width float32 activation.
    assert profile.cut_bytes(4) == [4 * 64 * 128 * 4] * (profile.num_units - 1)


def test_new_columns_are_required(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "src")
    with pytest.raises(ProfileError, match=r"lacks column\(s\) \['backward_input_s'\]"):
        load_profile(_damage(tmp_path / "src", tmp_path / "bad", lambda t: t.drop(columns=["backward_input_s"])))


# Paths (issue 13, point 10): model_path is stored relative to the profile directory and resolved on load.


def test_model_path_is_stored_relative_and_follows_a_moved_tree(tmp_path: Path) -> None:
    shipped = load_profile(SHIPPED / "mlp")
    (tmp_path / "a" / "examples").mkdir(parents=True)
    model = tmp_path / "a" / "examples" / "mlp.py"
    profile = replace(shipped, meta=replace(shipped.meta, model_path=str(model)))
    profile.save(tmp_path / "a" / "profiles" / "mlp")
    assert json.loads((tmp_path / "a" / "profiles" / "mlp" / "meta.json").read_text())["model_path"] == \
        "../../examples/mlp.py"
    assert load_profile(tmp_path / "a" / "profiles" / "mlp").meta.model_path == str(model)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert load_profile(tmp_path / "b" / "profiles" / "mlp").meta.model_path == str(tmp_path / "b" / "examples" / "mlp.py")


def test_old_absolute_model_path_still_loads(tmp_path: Path) -> None:
    load_profile(SHIPPED / "mlp").save(tmp_path / "p")
    meta = json.loads((tmp_path / "p" / "meta.json").read_text())
    (tmp_path / "p" / "meta.json").write_text(json.dumps({**meta, "model_path": "/elsewhere/examples/mlp.py"}))
    assert load_profile(tmp_path / "p").meta.model_path == "/elsewhere/examples/mlp.py"


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_fresh_clone_plans_from_its_shipped_profiles(name: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A copy of the repository's examples/ and profiles/ elsewhere (a fresh clone): planning from its shipped
    profiles writes a plan that names the copy's model file, whose fingerprint matches the profile."""
    from autopp.cli import main
    from autopp.data.plan import load_plan
    from autopp.run.runner import check_fingerprint
    clone = tmp_path / "clone"
    for part in ("examples", "profiles"):
        shutil.copytree(SHIPPED.parent / part, clone / part)
    out = clone / "plans" / f"{name}.plan.json"
    assert main(["plan", "--profile", str(clone / "profiles" / name), "--devices", "2", "--memory", "1GiB",
                 "--global-batch", "8", *ONE_PIPELINE, "-o", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["model_path"] == f"../examples/{name}.py"
    plan = load_plan(out)
    assert plan.model_path == str(clone / "examples" / f"{name}.py")
    assert check_fingerprint(plan).path == clone / "examples" / f"{name}.py"
    moved = tmp_path / "elsewhere" / "p.json"
    moved.parent.mkdir()
    moved.write_text(json.dumps({**json.loads(out.read_text()), "model_path": plan.model_path}))
    assert load_plan(moved).model_path == plan.model_path  # an absolute path (older plans) is kept as it is


# Crash safety of Profile.save (issue 13, point 12): a complete profile is on disk at every moment.


def _versions_on_disk(target: Path) -> set[int]:
    """The `repeats` of each complete profile at `target` or set aside beside it."""
    found = set()
    for d in [target, *target.parent.glob(f".old.{target.name}.*")]:
        try:
            found.add(load_profile(d).meta.repeats)
        except ProfileError:
            pass
    return found


def _two_versions(tmp_path: Path) -> tuple[Profile, Profile, Path]:
    shipped = load_profile(SHIPPED / "mlp")
    old, new = (replace(shipped, meta=replace(shipped.meta, repeats=r)) for r in (1, 2))
    target = tmp_path / "mlp"
    old.save(target)
    return old, new, target


def test_save_keeps_a_complete_profile_at_every_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before and after each rename and removal (where a kill could land), the old or the new profile is whole."""
    _, new, target = _two_versions(tmp_path)
    real_replace, real_rmtree, seen = os.replace, shutil.rmtree, []

    def checked(real):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(_versions_on_disk(target))
            real(*args, **kwargs)
            seen.append(_versions_on_disk(target))
        return call

    monkeypatch.setattr(os, "replace", checked(real_replace))
    monkeypatch.setattr(shutil, "rmtree", checked(real_rmtree))
    new.save(target)
    monkeypatch.undo()
    assert len(seen) == 6 and all(seen)  # three steps: old aside, new into place, old deleted
    assert seen[0] == {1} and seen[-1] == {2}
    assert load_profile(target).meta.repeats == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["mlp"]


@pytest.mark.parametrize("step, left", [(0, 1), (1, 1), (2, 2)])
def test_save_failing_at_any_step_leaves_a_loadable_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            step: int, left: int) -> None:
    """Steps: 0 rename the old profile aside, 1 rename the new one into place, 2 delete the old one."""
    _, new, target = _two_versions(tmp_path)
    real = {"replace": os.replace, "rmtree": shutil.rmtree}
    calls = []

    def failing(name: str):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(name)
            if len(calls) - 1 == step:
                if kwargs.get("ignore_errors"):
                    return None  # rmtree(ignore_errors=True) swallows its failure: the old copy stays
                raise OSError(f"injected failure at step {step}")
            return real[name](*args, **kwargs)
        return call

    monkeypatch.setattr(os, "replace", failing("replace"))
    monkeypatch.setattr(shutil, "rmtree", failing("rmtree"))
    if step < 2:
        with pytest.raises(OSError, match="injected"):
            new.save(target)
    else:
        new.save(target)  # the new profile is in place; only the old copy's removal failed, and it stays aside
        assert len(list(tmp_path.glob(".old.mlp.*"))) == 1
    monkeypatch.undo()
    assert load_profile(target).meta.repeats == left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".mlp.")]  # no half-written directory left


def test_profile_left_aside_by_a_killed_save_is_named(tmp_path: Path) -> None:
    _, _, target = _two_versions(tmp_path)
    aside = tmp_path / ".old.mlp.x1"
    os.replace(target, aside)  # what a kill between steps 0 and 1 leaves
    with pytest.raises(ProfileError, match=r"mlp: not a profile directory \(no meta.json\); a save was interrupted: "
                                           r"the previous profile is .*\.old\.mlp\.x1; rename it to"):
        load_profile(target)


def test_save_refuses_what_the_cli_refuses_with_the_same_rule(tmp_path: Path) -> None:
    # Review of issue 13.5: "new, empty, or has meta.json" was written twice (Profile.save and
    # preflight.check_output_dir); save now uses preflight's, so both say the same.
    from autopp.errors import AutoppError
    from autopp.preflight import check_output_dir

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(AutoppError) as cli:
        check_output_dir(other, marker="meta.json", kind="profile")
    with pytest.raises(ProfileError) as save:
        load_profile(SHIPPED / "mlp").save(other)
    assert str(save.value) == str(cli.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"] and (other / "notes.txt").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(ProfileError, match=r"file: is a file; give a directory"):
        load_profile(SHIPPED / "mlp").save(tmp_path / "file")


# Issue 16: per-unit `source` and `same_as` (measured, shared from another unit, analytic); added within version 1.


def test_profile_without_source_columns_loads_as_measured(gpt_profile: Profile, tmp_path: Path) -> None:
    gpt_profile.save(tmp_path / "src")
    old = load_profile(_damage(tmp_path / "src", tmp_path / "old", lambda t: t.drop(columns=["source", "same_as"])))
    assert list(old.units.source.unique()) == ["measured"] and list(old.units.same_as.unique()) == [-1]


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.assign(source="guessed"), r"bad/units\.csv: line 2, column source: 'guessed' is not one of"),
    (lambda t: t.assign(source="shared", same_as=1), r"bad/units\.csv: line 2, column same_as: 1 must be a unit"),
    (lambda t: t.assign(same_as=3), r"bad/units\.csv: line 2, column same_as: 3 must be .* else -1"),
])
def test_bad_sources_are_rejected(gpt_profile: Profile, tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    gpt_profile.save(tmp_path / "src")
    with pytest.raises(ProfileError, match=message):
        load_profile(_damage(tmp_path / "src", tmp_path / "bad", edit))


def test_old_cuda_peaks_are_read_as_unit_peaks(gpt_profile: Profile) -> None:
    extra = {k: v for k, v in gpt_profile.meta.extra.items() if not k.startswith("peak_bytes")}
    old = replace(gpt_profile, meta=replace(gpt_profile.meta, extra={**extra, "cuda_peak_bytes": {"0": {"1": 7}}}))
    assert old.unit_peak_bytes() == {0: {1: 7}}
    assert set(gpt_profile.unit_peak_bytes()) == set(range(gpt_profile.num_units))  # measured on CPU now


def test_selective_columns_are_optional_and_checked(tmp_path: Path) -> None:
    """A profile with selective recomputation's columns keeps them through save and load; one without them loads
    without them (not filled in); a negative figure is refused like any other."""
    from autopp.costmodel import unit_arrays
    from autopp.data.profile import load_profile
    from autopp.schedule.activation import Activation, policy
    from autopp.data.synthetic_profile import synthetic_profile
    with_them = load_profile(synthetic_profile(4, selective=True).save(tmp_path / "with"))
    columns = set(policy(Activation.SELECTIVE).columns)
    assert columns <= set(with_them.units.columns)
    assert Activation.SELECTIVE in unit_arrays(with_them, 1).own
    without = load_profile(synthetic_profile(4).save(tmp_path / "without"))
    assert not columns & set(without.units.columns)
    assert Activation.SELECTIVE not in unit_arrays(without, 1).own
    bad = with_them.units.assign(selective_recompute_s=-1.0)
    with pytest.raises(ProfileError, match="selective_recompute_s"):
        replace(with_them, units=bad)


def test_shipped_profiles_name_their_model_relative_to_themselves() -> None:
    """A profile committed under profiles/ must load on any clone: its model_path is stored relative to the profile
    (autopp.relpaths), never a path of the machine that made it (one held a helper's worktree path)."""
    root = Path(__file__).resolve().parents[1] / "profiles"
    absolute = [m.parent.name for m in sorted(root.glob("*/meta.json"))
                if Path(json.loads(m.read_text())["model_path"]).is_absolute()]
    assert absolute == []

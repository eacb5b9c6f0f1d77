"""The parallel axes as descriptors (autopp.data.axes): one per Layout degree, in the mesh's order, with what autopp
plans and each trainer's and the command line's spelling."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest

from autopp.data import axes
from autopp.data.axes import AXES, SWITCHES, TRAINERS, Spelling, group_axes, unplanned
from autopp.data.layout import MESH_AXES, UNPLANNED, Layout, LayoutPins, check_planned
from autopp.errors import LayoutError


def test_one_descriptor_per_degree_of_the_layout_in_mesh_order() -> None:
    assert list(AXES) == ["pp", "dp", "cp", "tp", "ep", "etp"]
    # dp_replicate (HSDP) splits dp's ranks for the ZeRO stage's sharding: no devices, no mesh dimension of its own
    assert set(AXES) == {f.name for f in fields(Layout)} - {"v", "zero", "dp_replicate", *SWITCHES}
    assert [a for a in AXES if a in MESH_AXES] == list(MESH_AXES) and all(a.name == n for n, a in AXES.items())
    assert str(AXES["tp"]) == "tp"


def test_each_switch_is_a_layout_field_of_an_axis_with_every_trainers_spelling() -> None:
    """Sequence parallelism: Megatron's flag when on, torchtitan's written both ways (on is its default, written
    since issue 26 so that the export says it), DeepSpeed refused."""
    assert set(SWITCHES) == {"sp"} and all(s.axis in AXES for s in SWITCHES.values())
    assert all(s.name in {f.name for f in fields(Layout)} for s in SWITCHES.values())
    sp = SWITCHES["sp"]
    assert sp.spelling("megatron", True).extra == ("--sequence-parallel",) and not sp.spelling("megatron", False).extra
    assert sp.spelling("torchtitan", False).extra == ("--parallelism.no_enable_sequence_parallel",)
    assert sp.spelling("torchtitan", True).extra == ("--parallelism.enable_sequence_parallel",)
    assert sp.spelling("deepspeed", True).refusal


def test_unplanned_axes_are_the_descriptors_and_say_their_issue(monkeypatch: pytest.MonkeyPatch) -> None:
    assert unplanned() == UNPLANNED == {}  # ep: planned since issue 30, cp since issue 27
    assert all(AXES[a].flag is not None for a in ("cp", "ep", "etp"))
    monkeypatch.setitem(axes.AXES, "cp", replace(AXES["cp"], unplanned="issue 27"))
    assert unplanned() == {"cp": "context parallelism (issue 27)"}


def test_the_group_axes_multiply_to_the_layouts_group() -> None:
    assert [a.name for a in group_axes()] == ["cp", "tp"]
    for layout in (Layout(tp=4), Layout(dp=2, cp=2, tp=2), Layout(pp=2, cp=4)):
        assert math.prod(getattr(layout, a.name) for a in group_axes()) == layout.group


def test_spellings_name_known_trainers_and_either_a_degree_or_a_refusal() -> None:
    for axis in AXES.values():
        assert set(axis.trainers) <= set(TRAINERS), axis
        for trainer, s in axis.trainers.items():
            assert not (s.degree and s.refusal), (axis, trainer)
            assert s.refusal is None or "re-plan with" in s.refusal
    assert AXES["dp"].spelling("megatron") == Spelling()  # Megatron derives dp from the world size
    assert AXES["tp"].spelling("torchtitan").degree == "parallelism.tensor_parallel_degree"
    assert AXES["cp"].spelling("megatron").degree == "--context-parallel-size"
    assert "all-gather" in AXES["cp"].spelling("torchtitan").note
    assert "Ulysses" in (AXES["cp"].spelling("deepspeed").refusal or "")


def test_check_planned_reads_the_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    check_planned(LayoutPins(dp=2, cp=2))  # planned since issue 27
    monkeypatch.setitem(axes.AXES, "cp", replace(AXES["cp"], unplanned="issue 27"))  # as before it
    with pytest.raises(LayoutError, match=r"^`cp` 2: context parallelism \(issue 27\) is not planned"):
        check_planned(LayoutPins(dp=2, cp=2))
    check_planned(Layout(dp=2, ep=2))  # planned


def test_expert_tensor_parallelism_is_carved_from_dp_and_spelt_by_megatron_alone() -> None:
    """Issue 24's proof axis (issue 30): etp is neither inside a group nor a synchronising axis (its ranks are carved
    from dp beside ep), Megatron writes `--expert-tensor-parallel-size`, torchtitan (whose key took only 1 or tp)
    and DeepSpeed refuse it in one line, and `check_planned` takes it as planned."""
    etp = AXES["etp"]
    assert not etp.in_group and not etp.syncs and etp.unplanned is None and etp.flag is not None and etp.flag.auto
    assert etp.spelling("megatron").degree == "--expert-tensor-parallel-size" and "Folding" in etp.spelling(
        "megatron").note
    for trainer in ("torchtitan", "deepspeed"):
        why = etp.spelling(trainer).refusal
        assert why is not None and "\n" not in why and "re-plan with `etp` 1" in why
    assert "1 or the tensor-parallel degree" in (etp.spelling("torchtitan").refusal or "")
    check_planned(Layout(dp=4, ep=2, etp=2))

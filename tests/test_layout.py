"""The parallel layout (autopp.data.layout): the one rank <-> coordinates map, its groups, its validation with the
numbers, the request's pins, and its JSON fields."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.layout import (MESH_AXES, UNPLANNED, Coords, Layout, LayoutPins, UnitView, check_planned,
                                 layout_fields, layout_of, uses_mesh)
from autopp.data.zero import NO_ZERO, ZERO
from autopp.errors import AutoppError, LayoutError

#: Layouts of every shape the runner builds: one device, pipeline only, pipeline x replicas, with tensor parallelism,
#: with ZeRO, interleaved, with context parallelism (and expert parallelism carved out of it).
LAYOUTS = [Layout(), Layout(pp=4), Layout(pp=4, dp=2), Layout(pp=2, dp=2, tp=2), Layout(pp=3, tp=4),
           Layout(pp=2, dp=2, tp=2, zero=ZERO[1]), Layout(pp=2, v=2, dp=3, zero=ZERO[3]),
           Layout(pp=2, dp=3, cp=2, tp=2, ep=4), Layout(pp=2, dp=8, ep=2, etp=2)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.describe("x"))
def test_rank_and_coords_are_inverse_over_every_rank(layout: Layout) -> None:
    coords = [layout.coords(r) for r in range(layout.world)]
    assert [layout.rank(c) for c in coords] == list(range(layout.world))
    assert len(set(coords)) == layout.world
    for c in coords:
        assert all(0 <= getattr(c, axis) < size for axis, size in zip(MESH_AXES, layout.shape))


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.cp == 1], ids=lambda x: x.describe("x"))
def test_ranks_are_numbered_pipeline_outermost_tensor_innermost(layout: Layout) -> None:
    for pp in range(layout.pp):
        for dp in range(layout.dp):
            for tp in range(layout.tp):
                assert layout.rank(Coords(pp, dp, tp=tp)) == (pp * layout.dp + dp) * layout.tp + tp


def test_coords_of_a_rank_and_out_of_range() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    assert layout.coords(5) == Coords(pp=1, dp=0, cp=0, tp=1)
    assert layout.coords(6) == Coords(pp=1, dp=1, cp=0, tp=0)
    with pytest.raises(LayoutError, match=r"rank 8 is outside 0\.\.7 of pp\(2\) x dp\(2\) x tp\(2\)"):
        layout.coords(8)
    with pytest.raises(LayoutError, match=r"rank -1 is outside 0\.\.7"):
        layout.coords(-1)
    with pytest.raises(LayoutError, match=r"pp coordinate 2 is outside 0\.\.1"):
        layout.rank(Coords(pp=2, dp=0))
    with pytest.raises(LayoutError, match=r"tp coordinate 2 is outside 0\.\.1"):
        layout.rank(Coords(pp=0, dp=0, tp=2))


def test_along_gives_the_group_on_one_axis() -> None:
    layout = Layout(pp=2, dp=2, tp=2)
    assert layout.along("tp", Coords(1, 0)) == (4, 5)  # a tensor-parallel group: consecutive devices
    assert layout.along("dp", Coords(1, 0, tp=1)) == (5, 7)  # the replicas of pipeline rank 1, tp rank 1
    assert layout.along("pp", Coords(0, 1, tp=1)) == (3, 7)  # one pipeline
    assert layout.along("cp", Coords(1, 1, tp=1)) == (7,)  # an axis of 1: the rank alone
    wide = Layout(pp=2, dp=3)
    assert wide.along("dp", Coords(1, 2)) == (3, 4, 5) and wide.along("pp", Coords(0, 2)) == (2, 5)


def test_sizes_and_mesh_axes() -> None:
    layout = Layout(pp=2, v=2, dp=3, cp=2, tp=2)
    assert (layout.world, layout.group, layout.stages, layout.shape) == (24, 4, 4, (2, 3, 2, 2))
    assert layout.mesh_axes == ("pp", "dp", "cp", "tp")
    assert Layout(pp=4, tp=2).mesh_axes == ("pp", "dp", "tp")  # cp only above 1
    assert (Layout().world, Layout().group, Layout().stages) == (1, 1, 1)


def test_check_devices_says_the_product_and_the_devices() -> None:
    Layout(pp=2, dp=2, tp=2).check_devices(8)
    with pytest.raises(LayoutError, match=r"^pp\(2\) \* dp\(2\) \* tp\(2\) = 8 != devices \(4\)$"):
        Layout(pp=2, dp=2, tp=2).check_devices(4)
    with pytest.raises(LayoutError, match=r"^pp\(4\) \* dp\(1\) = 4 != devices \(2\)$"):
        Layout(pp=4).check_devices(2)
    with pytest.raises(LayoutError, match=r"^pp\(1\) \* dp\(2\) \* cp\(2\) = 4 != devices \(8\)$"):
        Layout(dp=2, cp=2).check_devices(8)


def test_describe_leaves_out_axes_of_one_beyond_pp_and_dp() -> None:
    assert Layout(pp=2, dp=2, tp=2).describe() == "pp(2) x dp(2) x tp(2)"
    assert Layout(pp=4).describe() == "pp(4) x dp(1)"
    assert Layout(dp=2, cp=2, ep=4).describe(sep=", ") == "pp(1), dp(2), cp(2), ep(4)"


def test_unit_view_keeps_what_unit_costs_depend_on() -> None:
    # replicas that shard nothing drop out, and so do pp and v
    assert Layout(pp=4, v=2, dp=2, tp=2).unit_view() == UnitView(tp=2, cp=1, ep=1, sync=1, zero=ZERO[0])
    assert Layout(pp=4, dp=2, tp=2, zero=ZERO[1]).unit_view() == UnitView(tp=2, cp=1, ep=1, sync=2, zero=ZERO[1])
    assert Layout(pp=8).unit_view() == Layout().unit_view()
    assert Layout(pp=2, dp=4, ep=4).unit_view().ep == 4  # a valid ep layout's view (ep divides dp x cp x tp there)
    assert Layout(cp=2, tp=2).unit_view().group == 4
    assert Layout(dp=2, cp=2, zero=ZERO[3]).unit_view().sync == 4  # ZeRO shards over dp x cp
    assert Layout(dp=2, cp=2, zero=ZERO[3]).unit_view().sync_per_group == 2  # 2 of them in each group of devices
    assert Layout(dp=2, cp=2).unit_view().sync_per_group == 1  # nothing sharded: no collective of its own


def test_pins_per_group_set_the_group_axes_to_1() -> None:
    pins = LayoutPins(pp=2, dp=None, cp=2, tp=None, zero=None)
    assert pins.per_group() == LayoutPins(pp=2, dp=None, cp=1, tp=1, zero=None)


def test_sync_is_the_gradient_synchronisation_group_dp_x_cp() -> None:
    assert Layout(pp=2, dp=3).sync == 3 and Layout(dp=2, cp=4, tp=2).sync == 8 and Layout(tp=4).sync == 1


def test_a_sharded_views_local_view_drops_only_the_sharding() -> None:
    view = Layout(pp=2, dp=4, tp=2, zero=ZERO[3]).unit_view()
    assert view.sharded and view.local() == Layout(tp=2).unit_view() and not view.local().sharded
    assert not Layout(dp=4).unit_view().sharded


@pytest.mark.parametrize("fields, match", [
    ({"pp": 0}, r"^`pp` must be an integer >= 1, got 0$"),
    ({"dp": True}, r"^`dp` must be an integer >= 1, got True$"),
    ({"tp": 2.0}, r"^`tp` must be an integer >= 1, got 2\.0$"),
    ({"zero": ZERO[1]}, r"^ZeRO 1 shards over data-parallel replicas, and dp is 1: give "),
    ({"dp": 2, "tp": 3, "ep": 4}, r"^ep\(4\) must divide dp\(2\) \* cp\(1\) \* tp\(3\) = 6$"),
    ({"dp": 2, "cp": 2, "ep": 3}, r"^ep\(3\) must divide dp\(2\) \* cp\(2\) \* tp\(1\) = 4$"),
    ({"dp": 4, "ep": 4, "etp": 2}, r"^ep\(4\) x etp\(2\) must divide dp\(4\) \* cp\(1\) \* tp\(1\) = 4$"),
    ({"dp": 4, "etp": 2}, r"^`etp` 2 shards the experts of an ep group, and ep is 1: give `ep` > 1, or `etp` 1$"),
])
def test_an_invalid_layout_is_a_layout_error_with_the_numbers(fields: dict[str, object], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout(**fields)  # type: ignore[arg-type]


def test_valid_edges_of_the_rules_and_the_error_type() -> None:
    assert Layout(dp=2, zero=ZERO[3]).zero is ZERO[3]  # ZeRO needs only dp > 1
    assert Layout(dp=2, tp=3, ep=6).ep == 6 and Layout(dp=2, tp=3, ep=3).ep == 3  # ep divides dp * cp * tp
    with pytest.raises(TypeError, match=r"Layout\.zero must be a ZeroStage, got 1"):  # an int is a programming error
        Layout(dp=2, zero=1)  # type: ignore[arg-type]
    assert issubclass(LayoutError, AutoppError) and not issubclass(LayoutError, ValueError)


def test_pins_check_the_devices_with_the_numbers() -> None:
    LayoutPins(pp=None, dp=2, tp=4).check_devices(8)
    LayoutPins(pp=2, dp=2, tp=2).check_devices(8)
    with pytest.raises(LayoutError, match=r"^tp\(3\) does not divide the 8 devices: give `tp` one of \[1, 2, 4, 8\]$"):
        LayoutPins(tp=3).check_devices(8)
    with pytest.raises(LayoutError, match=r"^pp\(2\) \* dp\(2\) \* tp\(4\) = 16 != devices \(8\)$"):
        LayoutPins(pp=2, dp=2, tp=4).check_devices(8)
    with pytest.raises(LayoutError, match=r"^dp\(4\) \* tp\(4\) = 16 does not divide the 8 devices$"):
        LayoutPins(dp=4, tp=4).check_devices(8)
    LayoutPins(dp=None, tp=None).check_devices(7)  # nothing pinned beyond 1: any count


def test_pins_validate_and_admit() -> None:
    with pytest.raises(LayoutError, match=r"^`dp` must be an integer >= 1, got 0$"):
        LayoutPins(dp=0)
    with pytest.raises(LayoutError, match=r"^ZeRO 3 shards over data-parallel replicas, and dp is 1: give `dp` > 1"):
        LayoutPins(zero=ZERO[3])
    assert LayoutPins(dp=None, zero=ZERO[3]).zero is ZERO[3]
    with pytest.raises(LayoutError, match=r"^ep\(3\) must divide dp\(2\) \* cp\(1\) \* tp\(1\) = 2$"):
        LayoutPins(dp=2, ep=3)
    layout = Layout(pp=2, v=2, dp=2, tp=2, zero=ZERO[1])
    every = LayoutPins.of(layout)
    assert every == LayoutPins(pp=2, v=2, dp=2, cp=1, tp=2, ep=1, zero=ZERO[1])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.describe("x"))
def test_json_fields_round_trip(layout: Layout) -> None:
    assert layout_of(layout_fields(layout)) == layout


def test_json_fields_are_written_only_where_older_files_lack_nothing() -> None:
    assert layout_fields(Layout(pp=4, dp=2)) == {"num_ranks": 8, "pp": 4, "dp": 2, "virtual_stages": 1}
    assert layout_fields(Layout(pp=2, dp=2, tp=2, zero=ZERO[1])) == {
        "num_ranks": 8, "pp": 2, "dp": 2, "virtual_stages": 1, "tp": 2, "zero": 1}
    assert layout_fields(Layout(pp=2, v=2, dp=2, zero=ZERO[3])) == {
        "num_ranks": 4, "pp": 2, "dp": 2, "virtual_stages": 2, "tp": 1, "zero": 3}
    assert layout_fields(Layout(dp=2, cp=2, ep=2)) == {"num_ranks": 4, "pp": 1, "dp": 2, "virtual_stages": 1,
                                                       "cp": 2, "ep": 2}
    hsdp = Layout(dp=4, zero=ZERO[3], dp_replicate=2)  # issue 25: HSDP's replicas, written only above 1
    assert layout_fields(hsdp) == {"num_ranks": 4, "pp": 1, "dp": 4, "virtual_stages": 1, "tp": 1, "zero": 3,
                                   "dp_replicate": 2}
    assert layout_of(layout_fields(hsdp)) == hsdp and hsdp.fsdp and hsdp.shard == 2
    LayoutPins(dp=None, zero=None, dp_replicate=2).check_devices(8)  # dp 4 or 8 remain
    with pytest.raises(LayoutError, match=r"^`dp_replicate` 2 must divide dp and be below it, and the 4 devices "
                                          r"leave dp 2 at most"):
        LayoutPins(pp=2, dp=None, zero=None, dp_replicate=2).check_devices(4)


def test_json_fields_of_older_files_and_mismatches() -> None:
    assert layout_of({"num_ranks": 8, "dp": 2}) == Layout(pp=4, dp=2)  # before `pp` was written
    assert layout_of({"num_ranks": 8, "pp": 0, "dp": 2, "tp": 2}) == Layout(pp=2, dp=2, tp=2)
    assert layout_of({"num_ranks": 3}) == Layout(pp=3)
    with pytest.raises(LayoutError, match=r"^pp\(2\) \* dp\(2\) != num_ranks \(8\)$"):
        layout_of({"num_ranks": 8, "pp": 2, "dp": 2})
    with pytest.raises(LayoutError, match=r"ZeRO stage 5 does not exist"):
        layout_of({"num_ranks": 8, "pp": 4, "dp": 2, "tp": 1, "zero": 5})
    with pytest.raises(LayoutError, match=r"ZeRO 1 shards over data-parallel replicas, and dp is 1"):
        layout_of({"num_ranks": 4, "pp": 2, "dp": 1, "tp": 2, "zero": 1})


def test_uses_mesh_for_tensor_parallelism_or_sharding() -> None:
    assert uses_mesh(Layout(pp=2, tp=2)) and uses_mesh(Layout(dp=2, zero=ZERO[1]))
    assert not uses_mesh(Layout(pp=2, dp=2)) and not uses_mesh(Layout(pp=4, v=2, dp=2, zero=NO_ZERO))


def test_axes_not_planned_yet_are_refused_not_taken_as_1(monkeypatch: pytest.MonkeyPatch) -> None:
    """An axis with a slot in the Layout that the planner, the runner and the exporters do not handle yet (context
    parallelism before issue 27) is refused by name in a request or a plan (the review of issue 24 found that
    they were silently planned, run and exported as 1)."""
    from dataclasses import replace

    from autopp.data import axes
    check_planned(LayoutPins(dp=2, cp=2))  # planned since issue 27
    monkeypatch.setitem(axes.AXES, "cp", replace(axes.AXES["cp"], unplanned="issue 27"))
    with pytest.raises(LayoutError, match=r"^`cp` 2: context parallelism \(issue 27\) is not planned, run or exported "
                                          r"yet; give `cp` 1$"):
        check_planned(LayoutPins(dp=2, cp=2))
    check_planned(Layout(pp=2, dp=4, ep=4))  # expert parallelism: planned since issue 30
    check_planned(LayoutPins(dp=None, tp=None))  # searched degrees are not a request for the axes
    check_planned(Layout(pp=2, dp=2, tp=2))
    assert set(UNPLANNED) == set()


def test_sequence_parallelism_needs_tp_and_is_written_only_when_on() -> None:
    with pytest.raises(LayoutError, match=r"^`sp` \(sequence parallelism\) shards the sequence over the "
                                          r"tensor-parallel ranks, and tp is 1: give `tp` > 1, or `sp` off$"):
        Layout(pp=2, sp=True)
    with pytest.raises(LayoutError, match=r"^`sp` must be true or false, got 1$"):
        Layout(pp=2, tp=2, sp=1)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="and tp is 1"):
        LayoutPins(tp=1, sp=True)
    on = Layout(pp=2, dp=2, tp=2, zero=ZERO[1], sp=True)
    assert layout_fields(on) == {**layout_fields(replace(on, sp=False)), "sp": True}
    assert "sp" not in layout_fields(Layout(pp=2, tp=2)) and layout_of(layout_fields(on)) == on
    assert layout_of({"num_ranks": 4, "pp": 2, "tp": 2}).sp is False  # plans written before the field
    with pytest.raises(LayoutError, match=r"^field 'sp' must be true or false, got 'yes'$"):
        layout_of({"num_ranks": 4, "pp": 2, "tp": 2, "sp": "yes"})
    assert on.describe() == "pp(2) x dp(2) x tp(2)+sp" and on.unit_view().sp
    assert on.unit_view() != replace(on, sp=False).unit_view()  # a different cost-cache key
    assert LayoutPins(tp=None, sp=None).per_group() == LayoutPins(tp=1, sp=False)
    assert LayoutPins.of(on).sp is True


def test_expert_tensor_parallelism_is_carved_beside_ep_and_written_only_above_1() -> None:
    """Issue 24's proof axis: etp adds no devices (the world and the mesh are dp's), its JSON field is written only
    above 1 (plans without it read and write as before), and the unit view carries it with the dp / (ep x etp)
    ranks holding the same expert shard."""
    layout = Layout(pp=2, dp=8, ep=2, etp=2)
    assert layout.world == 16 and layout.mesh_axes == ("pp", "dp", "tp") and layout.describe() == (
        "pp(2) x dp(8) x ep(2) x etp(2)")
    assert layout_fields(layout) == {"num_ranks": 16, "pp": 2, "dp": 8, "virtual_stages": 1, "ep": 2, "etp": 2}
    assert "etp" not in layout_fields(Layout(pp=2, dp=8, ep=2)) and layout_of(layout_fields(layout)) == layout
    view = layout.unit_view()
    assert (view.ep, view.etp, view.ep_replicas) == (2, 2, 2) and Layout(dp=4, ep=2, etp=2).unit_view().ep_replicas == 1
    assert Layout(dp=8, ep=2).unit_view().ep_replicas == 4 and Layout(dp=8, ep=2).unit_view().etp == 1
    assert LayoutPins.of(layout).etp == 2 and LayoutPins(dp=None, ep=2, etp=None).etp is None
    with pytest.raises(LayoutError, match=r"^ep\(2\) x etp\(2\) must divide dp\(2\)"):
        LayoutPins(dp=2, ep=2, etp=2)

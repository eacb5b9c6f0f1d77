"""The step's band from the profile's spreads and the tie rule (autopp.solve.search.band; issue 29, item 4)."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.data.cluster import Cluster
from autopp.data.profile import Profile, load_profile
from autopp.data.synthetic_profile import synthetic_profile
from autopp.solve import PlanRequest, make_plan
from autopp.solve.search.band import SPREAD_KINDS, band, choose, has_spread, shifted
from autopp.solve.search.search import search

GPT = Path(__file__).resolve().parents[2] / "profiles" / "gpt"
GiB = 2**30


def _request(**kw: object) -> PlanRequest:
    """2 devices of 1 GiB, the schedules torchtitan runs (Chimera, which no trainer runs, wins profiles/gpt there
    outright: nothing would be inside its band)."""
    return PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=GiB), global_batch=8,  # type: ignore[arg-type]
                       trainer="torchtitan", **kw)


def test_shifted_moves_every_time_by_half_its_spread_and_stays_at_least_0() -> None:
    gpt = load_profile(GPT)
    low, high = shifted(gpt, -1.0).units, shifted(gpt, 1.0).units
    for k in SPREAD_KINDS:
        half = gpt.units[f"{k}_spread_s"] / 2
        assert (high[f"{k}_s"] - gpt.units[f"{k}_s"] - half).abs().max() < 1e-15
        assert ((low[f"{k}_s"] - (gpt.units[f"{k}_s"] - half).clip(lower=0.0)).abs().max()) < 1e-15
        assert (low[f"{k}_s"] >= 0).all()


def test_a_measured_profile_has_a_band_around_the_step() -> None:
    gpt = load_profile(GPT)
    best = search(gpt, _request())[0]
    assert best is not None and has_spread(gpt)
    b = band(gpt, _request(), best)
    assert b.low_s < best.step_s < b.high_s and b.width_s > 0


def test_a_profile_without_spreads_has_the_step_as_its_band() -> None:
    """An analytic profile (or the synthetic one here) records spreads of 0: the band is the step, not invented."""
    syn = synthetic_profile(8)
    assert not has_spread(syn)
    plan = make_plan(syn, replace(_request(), cluster=Cluster(num_devices=2, memory_bytes=80 * GiB)))
    assert plan.step_band_s == (plan.predicted.step_time_s, plan.predicted.step_time_s) and plan.tied == ()


def test_choose_keeps_fewer_microbatches_then_less_memory_among_ties() -> None:
    gpt = load_profile(GPT)
    tied: list = []
    search(gpt, _request(schedule=None), tied=tied)
    fastest = search(gpt, _request(schedule=None))[0]
    assert fastest is not None and tied, "profiles/gpt has configurations inside the fastest's band"
    every = [fastest, *tied]
    kept, others = choose(every, max(v.step_s for v in every))
    assert kept.candidate.microbatches == min(v.candidate.microbatches for v in every)
    fewest = [v for v in every if v.candidate.microbatches == kept.candidate.microbatches]
    assert max(kept.peak_memory) == min(max(v.peak_memory) for v in fewest)
    assert len(others) == len(every) - 1 and kept not in others
    assert choose(every, max(v.step_s for v in every), ties=False)[0] is fastest  # no tie rule: the fastest
    assert choose(every, fastest.step_s / 2)[0] is fastest  # nothing inside the band: the fastest


def _reprofiled(profile: Profile, seed: int) -> Profile:
    """`profile` as another profiling run might give it: each unit's medians moved within +-1/4 of its spread
    (seeded), the spreads kept."""
    rng = random.Random(seed)
    units = profile.units.copy()
    for k in SPREAD_KINDS:
        units[f"{k}_s"] = [max(0.0, t + rng.uniform(-0.25, 0.25) * s)
                           for t, s in zip(units[f"{k}_s"], units[f"{k}_spread_s"])]
    return replace(profile, units=units)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_profiling_again_within_the_spreads_gives_the_same_configuration(seed: int) -> None:
    """Issue 29's done-when, in miniature: profiles/gpt "profiled again" (medians moved inside their spreads) plans
    the same configuration with the tie rule, and says that its margin is inside the band."""
    gpt = load_profile(GPT)
    request = _request(schedule=None, ties=True)
    first, again = make_plan(gpt, request), make_plan(_reprofiled(gpt, seed), request)
    assert (again.schedule, again.layout, again.num_microbatches) == (first.schedule, first.layout,
                                                                      first.num_microbatches)
    assert first.tied and first.step_band_s is not None
    low, high = first.step_band_s
    assert low < first.predicted.step_time_s < high


def test_the_tied_configurations_are_told_apart() -> None:
    """Each tie names what sets it apart (the ZeRO stage where dp > 1, the microbatch size, a uniform policy other
    than keep): before, three configurations that differ in their ZeRO stage read alike ("GPipe pp(1) x dp(2) v=1
    m=1") at three times."""
    plan = make_plan(load_profile(GPT), _request(schedule=None, ties=True))
    assert plan.tied and len(set(plan.tied)) == len(plan.tied)
    labels = [t.rsplit(": ", 1)[0] for t in plan.tied]
    assert len(set(labels)) == len(labels), labels
    assert all(" m=" in t and "x" in t.split(" m=")[1] for t in plan.tied)
    assert all(("ZeRO " in t) == ("dp(1)" not in t) for t in plan.tied)


@pytest.mark.parametrize("global_batch", [64, 256])
def test_an_extrapolated_microbatch_size_has_a_band_as_wide_as_at_the_profiled_ones(global_batch: int) -> None:
    """Tester: a measured profile planned at a microbatch size past the profiled ones printed "step band: none (the
    profile has no spreads ...)": the line through both sizes' shifted times tilted the other way (profiles/gpt's
    spreads at size 4 are smaller than at 1), so the band was ~0 at 32 and none at 128. The end size's spreads, as
    fractions of its times, now carry the band there."""
    gpt = load_profile(GPT)
    widths = []
    for batch in (8, global_batch):  # microbatch size 4 (profiled), then 32 or 128 (extrapolated)
        req = PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=16 * GiB), global_batch=batch,
                          num_microbatches=2)
        best = search(gpt, req)[0]
        assert best is not None
        b = band(gpt, req, best)
        assert b.low_s < best.step_s < b.high_s
        widths.append(b.width_s / best.step_s)
    assert widths[1] > widths[0] / 2


def test_without_a_band_only_the_same_step_ties_and_the_note_says_so() -> None:
    """Tester: an analytic plan printed "step band: none" beside the note that configurations inside the band are
    ties. GPipe and 1F1B at pp 1 predict the very same step: they tie, and the note and the band line say that."""
    from autopp.data.layout import LayoutPins
    from autopp.display import format_plan
    from autopp.solve.assemble.make import SAME_STEP_NOTE, TIE_NOTE
    syn = synthetic_profile(8)
    plan = make_plan(syn, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=80 * GiB), global_batch=8,
                                      schedule=None, pins=LayoutPins(pp=1, dp=2), ties=True))
    assert plan.tied and plan.step_band_s == (plan.predicted.step_time_s, plan.predicted.step_time_s)
    assert SAME_STEP_NOTE in plan.notes and TIE_NOTE not in plan.notes
    assert "predict the same step (" in format_plan(plan) or "predicts the same step (" in format_plan(plan)

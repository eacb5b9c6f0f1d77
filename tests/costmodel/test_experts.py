"""Expert GEMMs re-timed under expert parallelism (autopp.costmodel.experts): each pass's max(F, W + O) becomes
max(F, W / ep + O), by hand at ep 2 and 4; ExpertTable reads the profile's expert columns, and a profile without
them keeps its ep-1 times."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel.experts import expert_gemms, retimed
from autopp.data.layout import Layout
from autopp.data.profile import EXPERT_COLUMNS, EXPERT_PASSES, Profile, expert_column
from autopp.schedule.activation import Activation

from .arrays import arrays


def test_a_memory_bound_expert_gemm_reads_1_over_ep_of_the_weights() -> None:
    # F 1 s of FLOPs, W 4 s of expert weights, O 1 s of rows: ep 1 charges max(1, 4 + 1) = 5 s
    flop, weight, other = np.array([1.0]), np.array([4.0]), np.array([1.0])
    assert retimed(flop, weight, other, 1) == pytest.approx([0.0])
    assert retimed(flop, weight, other, 2) == pytest.approx([3.0 - 5.0])  # max(1, 2 + 1)
    assert retimed(flop, weight, other, 4) == pytest.approx([2.0 - 5.0])  # max(1, 1 + 1)
    assert retimed(flop, weight, other, 8) == pytest.approx([1.5 - 5.0])  # max(1, 0.5 + 1)
    # compute-bound already at ep 1: nothing to gain; turning compute-bound at ep 4: the FLOPs are the floor
    assert retimed(np.array([10.0]), weight, other, 4) == pytest.approx([0.0])
    assert retimed(np.array([2.5]), weight, other, 4) == pytest.approx([2.5 - 5.0])


def _parts(flop: float, weight: float, other: float, n: int = 2) -> dict[str, tuple[np.ndarray, ...]]:
    """The same parts in every pass, on unit 1 of `n` (unit 0 has no experts)."""
    unit = lambda x: np.array([0.0, x] + [0.0] * (n - 2))  # noqa: E731
    return {phase: (unit(flop), unit(weight), unit(other)) for phase in EXPERT_PASSES}


def test_every_pass_and_selective_recomputation_take_their_own_change() -> None:
    a = arrays([10.0, 10.0], backward=[20.0, 20.0], backward_input=[8.0, 8.0], backward_weight=[12.0, 12.0])
    a = replace(a, own={Activation.SELECTIVE: (np.array([5.0, 5.0]), np.array([3.0, 3.0]))})
    out = expert_gemms(a, _parts(1.0, 4.0, 1.0), 2)  # -2 s in each pass of unit 1
    change = np.array([0.0, -2.0])
    for field in ("forward", "recompute", "backward", "backward_input", "backward_weight"):
        assert np.allclose(getattr(out, field), getattr(a, field) + change), field
    kept, seconds = out.own[Activation.SELECTIVE]
    assert np.array_equal(kept, [5.0, 5.0]) and np.allclose(seconds, [3.0, 1.0])
    assert expert_gemms(a, _parts(1.0, 4.0, 1.0), 1) is a and expert_gemms(a, {}, 4) is a


def test_without_an_input_weight_split_the_backwards_change_is_halved() -> None:
    a = replace(arrays([10.0, 10.0]), split_assumed=True)  # I = W = B / 2 assumed
    out = expert_gemms(a, _parts(1.0, 4.0, 1.0), 4)  # -3 s per pass
    assert np.allclose(out.backward, a.backward + [0.0, -3.0])
    assert np.allclose(out.backward_input, a.backward_input + [0.0, -1.5])
    assert np.allclose(out.backward_weight, a.backward_weight + [0.0, -1.5])


def _moe_profile(timed: bool) -> Profile:
    """A synthetic profile whose blocks (units 1, 2; forward about 8 ms x b) hold one MoE layer; with `timed`, expert
    columns: per pass, per microbatch, F = 1 ms x b, W = 4 ms (the weights, whatever the batch), O = 1 ms x b."""
    from autopp.data.synthetic_profile import synthetic_profile
    p = synthetic_profile(4)
    blocks = p.units.unit.between(1, 2).to_numpy()
    units = p.units.assign(expert_param_bytes=np.where(blocks, p.units.param_bytes * 3 // 4, 0),
                           moe_layers=np.where(blocks, 1, 0))
    if timed:
        b = units.microbatch_size.to_numpy(dtype=float)
        per_part = {"flop": 1e-3 * b, "weights": 4e-3 + 0 * b, "other": 1e-3 * b}
        units = units.assign(**{expert_column(phase, part): np.where(blocks, values, 0.0)
                                for phase in EXPERT_PASSES for part, values in per_part.items()})
    return Profile(replace(p.meta, extra={"moe": {"num_experts": 8, "top_k": 2}}), units, p.edges)


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_table_re_times_the_expert_gemms_at_its_ep(ep: int) -> None:
    """At microbatch 1 a block's expert GEMMs take max(1, 4 + 1) = 5 ms at ep 1; at ep 2 max(1, 2 + 1) = 3 ms, at
    ep 4 max(1, 1 + 1) = 2 ms, in the forward, the recomputed forward and each backward; the embedding and the head,
    without experts, and the plan at ep 1 are unchanged."""
    from autopp.costmodel import ProfileTable, group_table
    profile = _moe_profile(timed=True)
    assert set(EXPERT_COLUMNS) <= set(profile.units.columns) and not profile.experts_untimed
    whole = ProfileTable(profile).arrays(1)
    sharded = group_table(profile, Layout(dp=ep, ep=ep).unit_view()).arrays(1)
    change = {2: 3e-3 - 5e-3, 4: 2e-3 - 5e-3}[ep] * np.array([0, 1, 1, 0])
    for field in ("forward", "recompute", "backward", "backward_input", "backward_weight"):
        assert np.allclose(getattr(sharded, field), getattr(whole, field) + change), field
    # at microbatch 4 the rows grow (F 4 ms, O 4 ms) and the weights do not: ep 4 leaves max(4, 1 + 4) = 5 of 8 ms
    at4 = group_table(profile, Layout(dp=4, ep=4).unit_view()).arrays(4)
    assert np.allclose(at4.forward - ProfileTable(profile).arrays(4).forward, [0, -3e-3, -3e-3, 0])


def test_a_moe_profile_without_the_columns_keeps_its_ep_1_times() -> None:
    from autopp.costmodel import ProfileTable, group_table
    profile = _moe_profile(timed=False)
    assert profile.experts_untimed
    sharded = group_table(profile, Layout(dp=4, ep=4).unit_view()).arrays(1)
    assert np.array_equal(sharded.forward, ProfileTable(profile).arrays(1).forward)
    dense = Profile(profile.meta, profile.units.assign(moe_layers=0), profile.edges)
    assert not dense.experts_untimed  # nothing to re-time


def test_the_expert_columns_load_all_or_none(tmp_path: object) -> None:
    from pathlib import Path

    from autopp.data.profile import load_profile
    from autopp.errors import ProfileError
    profile = _moe_profile(timed=True)
    out = Path(str(tmp_path))
    profile.save(out / "p")
    loaded = load_profile(out / "p")
    column = expert_column("forward", "weights")
    assert np.allclose(loaded.units[column], profile.units[column]) and not loaded.experts_untimed
    with pytest.raises(ProfileError, match=r"lacks column\(s\) \['expert_flop_forward_s'\]"):
        Profile(profile.meta, profile.units.drop(columns=[expert_column("forward", "flop")]), profile.edges)

"""Expert GEMMs re-timed under expert parallelism (autopp.costmodel.experts): each pass's max(F, W + O) becomes
max(F, W / ep + O), by hand at ep 2 and 4; ExpertTable reads the profile's expert columns, and a profile without
them keeps its ep-1 times. Expert tensor parallelism beside ep: max(F, W / (ep x etp) + etp x O), the expert bytes
over ep x etp ranks, and its all-gather + reduce-scatter pairs as the experts' tensor-parallel collectives."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel.experts import expert_gemms, expert_tensor_rows, retimed
from autopp.data.cluster import Cluster, Link
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


def test_etp_reads_its_share_of_the_weights_and_moves_etp_times_the_rows() -> None:
    # the same F 1, W 4, O 1 s: ep 2 x etp 2 reads 1 s of weights and moves 2 s of rows: max(1, 1 + 2) = 3 s
    flop, weight, other = np.array([1.0]), np.array([4.0]), np.array([1.0])
    assert retimed(flop, weight, other, 2, 2) == pytest.approx([3.0 - 5.0])
    assert retimed(flop, np.array([16.0]), other, 2, 2) == pytest.approx([6.0 - 17.0])  # max(1, 4 + 2)
    assert retimed(np.array([10.0]), weight, other, 2, 2) == pytest.approx([0.0])  # compute-bound: the FLOPs stay
    a = arrays([10.0, 10.0])
    assert expert_tensor_rows(a, np.ones(2), np.ones(2), 1) is a


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


def test_etp_shards_the_expert_bytes_and_adds_the_experts_tensor_parallel_collectives() -> None:
    """ep 2 x etp 2 holds the expert bytes of ep 4 and sums its expert gradients over dp / 4 ranks; each MoE layer
    all-gathers and reduce-scatters etp x its routed rows in the forward and again in the backward: per pass an
    all-reduce of S = 2 x routed on a ring of 2, 2 x (1/2) x S / B + 2 x latency, on the critical path, counted as
    tensor-parallel seconds; the gathered rows kept for the backward, 1 x routed per layer, join the activations."""
    from autopp.costmodel import group_table, group_terms
    profile = _moe_profile(timed=True)
    ep2, both, ep4 = Layout(dp=8, ep=2), Layout(dp=8, ep=2, etp=2), Layout(dp=8, ep=4)
    a2, a22, a4 = (group_table(profile, layout.unit_view()).arrays(1) for layout in (ep2, both, ep4))
    assert np.allclose(a22.static, a4.static) and np.allclose(a22.params, a4.params) and a22.static[1] < a2.static[1]
    assert a22.expert is not None and a2.expert is not None and (a22.expert.replicas, a2.expert.replicas) == (2, 4)
    assert a2.ep_comm is not None and a2.tp_comm is None and a22.tp_comm is not None
    layers = np.array([0.0, 1.0, 1.0, 0.0])
    routed = a2.ep_comm.routing.top_k * a2.ep_comm.tokens  # a layer's routed rows: top-k copies of its tokens
    assert np.allclose(a22.tp_comm.forward_allreduce, layers * 2 * routed)
    assert np.allclose(a22.tp_comm.backward_allreduce, layers * 2 * routed)
    assert np.allclose(a22.tp_comm.forward_count, layers) and not a22.tp_comm.forward_allgather.any()
    assert np.allclose(a22.activation - a2.activation, layers * routed)
    assert np.allclose(a22.forward, a2.forward)  # the GEMMs: max(1, 1 + 2) = max(1, 2 + 1) = 3 ms
    link = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)
    cluster = Cluster(num_devices=8, memory_bytes=2**34, link=link)
    t2, t22 = group_terms(a2, ep2.unit_view(), cluster), group_terms(a22, both.unit_view(), cluster)
    pair = 2 * 0.5 * layers * 2 * routed / 1e9 + 2 * 1 * 1e-5 * layers
    for field in ("forward", "recompute", "backward_input", "backward"):
        assert np.allclose(getattr(t22, field) - getattr(t2, field), pair), field
    assert np.allclose(t22.backward_weight, t2.backward_weight)
    assert t22.tp_seconds is not None and np.allclose(t22.tp_seconds[0], 2 * pair)


def test_experts_carved_from_tp_or_cp_are_refused_not_costed() -> None:
    """Review: a Layout may carve ep from dp x cp x tp (torchtitan's rule), but autopp costs and runs experts carved
    from dp only; the search never pairs them (`ep_choices`), and a layout given directly was costed without its tp
    or cp (or divided by 0 replicas): refused, saying what works."""
    from autopp.costmodel import group_table
    from autopp.errors import LayoutError
    profile = _moe_profile(True)
    for layout in (Layout(dp=1, tp=2, ep=2), Layout(dp=2, cp=2, ep=2)):
        with pytest.raises(LayoutError, match=r"is not costed: autopp carves the experts from the data-parallel ranks"):
            group_table(profile, layout.unit_view())
    assert group_table(profile, Layout(dp=2, ep=2).unit_view()).arrays(1).n == profile.num_units

"""Tensor-parallel collectives and ZeRO sharding of unit costs (autopp.costmodel.parallel), and the step's end per
ZeRO stage (terms.sync_time)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import (TpComm, allreduce_time, allreduce_times, data_sharded, gradient_allreduce_time,
                              group_terms, replica_terms, step_end_floor, sync_time, tensor_parallel)
from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout, UnitView
from autopp.data.zero import NO_ZERO, ZERO

from .arrays import arrays

LINK = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9)
FLAT = Cluster(num_devices=8, memory_bytes=2**30, link=LINK)


def _comm(n: int, f_ar: float, b_ar: float, f_ag: float = 0.0) -> TpComm:
    full = lambda x: np.full(n, float(x))  # noqa: E731
    return TpComm(full(f_ar), full(b_ar), full(f_ag), full(2), full(2))


def test_tensor_parallel_adds_ring_collectives_to_forward_and_input_backward() -> None:
    a = replace(arrays([1.0, 1.0], static=[10, 10]), tp_comm=_comm(2, 4e6, 2e6, 1e6))
    out = tensor_parallel(a, Layout(tp=4).unit_view(), LINK)
    # all-reduce 2 (t-1)/t S/B, all-gather (t-1)/t S/B, 2 (t-1) latencies per collective
    f = 2 * 0.75 * 4e6 / 1e9 + 0.75 * 1e6 / 1e9 + 2 * 6 * 1e-5
    b = 2 * 0.75 * 2e6 / 1e9 + 2 * 6 * 1e-5
    assert np.allclose(out.forward - a.forward, f) and np.allclose(out.recompute - a.recompute, f)
    assert np.allclose(out.backward_input - a.backward_input, b) and np.allclose(out.backward - a.backward, b)
    assert np.array_equal(out.backward_weight, a.backward_weight) and np.array_equal(out.static, a.static)
    assert tensor_parallel(a, Layout().unit_view(), LINK) is a


def test_group_terms_are_the_tensor_parallel_collectives_on_the_groups_link() -> None:
    a = replace(arrays([1.0, 1.0], static=[10, 10]), tp_comm=_comm(2, 4e6, 2e6, 1e6))
    nodes = hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=LINK,
                                       inter=Link(latency_s=1e-4, bandwidth_bytes_per_s=1e8)), 2**30)
    for tp in (2, 8):  # inside a node, then across nodes
        view = Layout(pp=8 // tp, tp=tp).unit_view()
        got, expected = group_terms(a, view, nodes), tensor_parallel(a, view, nodes.tp_link(tp))
        assert np.array_equal(got.forward, expected.forward) and np.array_equal(got.backward, expected.backward)
    assert not np.array_equal(group_terms(a, Layout(tp=2).unit_view(), nodes).forward,
                              group_terms(a, Layout(tp=8).unit_view(), nodes).forward)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_replica_terms_shard_over_the_views_sync_ranks_on_the_group_of_pipeline_rank_0(zero: int) -> None:
    a, *_ = _zero_arrays()
    view = Layout(pp=2, dp=4, zero=ZERO[zero]).unit_view()
    got = replica_terms(a, view, FLAT)
    expected = data_sharded(a, view, lambda s: allreduce_times(s, 4, FLAT))
    for name in ("static", "forward", "backward", "optimizer"):
        assert np.array_equal(getattr(got, name), getattr(expected, name)), name


def _zero_arrays() -> tuple:
    a = arrays([1.0, 1.0], static=[16.0, 32.0], grads=[4.0, 8.0], optimizer=[0.5, 1.0])
    return a, a.params, a.grads, a.static - a.params - a.grads


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_static_bytes_follow_the_stage(zero: int) -> None:
    a, p, g, o = _zero_arrays()
    reduce = lambda s: s / 1e9  # noqa: E731
    out = data_sharded(a, Layout(pp=2, dp=4, zero=ZERO[zero]).unit_view(), reduce)
    # stage 3 holds as much as stage 1 at the peak under torch's pipelining (pp > 1: parameters stay gathered after
    # a backward until the next forward)
    expected = {0: p + g + o, 1: p + p / 4 + g + o / 4, 2: p + p / 4 + g / 4 + o / 4, 3: p + p / 4 + g + o / 4}[zero]
    assert np.allclose(out.static, np.round(expected)) and out.zero == ZERO[zero]
    assert np.allclose(out.optimizer, a.optimizer / (4 if zero else 1))
    if zero == 3:  # an all-gather before each forward, not repeated by the recomputed forward
        assert np.allclose(out.forward - a.forward, reduce(p) / 2)
        assert np.array_equal(out.recompute, a.recompute)
    if zero == 2:  # each microbatch's gradients reduce-scattered after its backward
        assert np.allclose(out.backward_weight - a.backward_weight, reduce(g) / 2)
    if zero in (0, 1):
        assert np.array_equal(out.forward, a.forward) and np.array_equal(out.backward, a.backward)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_with_a_master_copy_fsdp2s_sharded_parameter_is_that_copy(zero: int) -> None:
    """The bf16 recipe's optimizer bytes O hold the fp32 master copy (autopp.data.precision); FSDP2's
    MixedPrecisionPolicy keeps the sharded parameter in fp32 and steps it, gathering bf16 copies to compute, so the
    sharded parameter is the master: P + G + O / d at ZeRO 1 (Megatron's distributed optimizer: 6 + 12 / d bytes
    per parameter), not P + P / d + G + O / d. Here P = G = (4, 8), O = (8, 16), d = 4."""
    a, p, g, o = _zero_arrays()
    out = data_sharded(replace(a, master=True), Layout(pp=2, dp=4, zero=ZERO[zero]).unit_view(), lambda s: s * 0.0)
    assert list(out.static) == {1: [4 + 4 + 2, 8 + 8 + 4], 2: [4 + 1 + 2, 8 + 2 + 4], 3: [10, 20]}[zero]
    plain = data_sharded(a, Layout(pp=2, dp=4, zero=ZERO[zero]).unit_view(), lambda s: s * 0.0)
    assert list(plain.static - out.static) == list(p / 4)  # fp32 (no master): the sharded copy is one of its own
    # at pp 1 FSDP2 holds (P' + G + O) / d, P' = 0 with a master copy
    fsdp = data_sharded(replace(a, master=True), Layout(pp=1, dp=4, zero=ZERO[3]).unit_view(), lambda s: s * 0.0)
    assert list(fsdp.static) == list(np.round((g + o) / 4))


def test_zero_without_replicas_changes_nothing() -> None:
    a, *_ = _zero_arrays()
    out = data_sharded(a, UnitView(tp=1, cp=1, ep=1, sync=1, zero=ZERO[3]), lambda s: s)
    assert np.array_equal(out.static, a.static) and out.zero == NO_ZERO


def test_sync_time_per_stage_is_all_reduce_or_scatter_plus_gather() -> None:
    g, p = 8e6, 6e6
    ar = lambda s: allreduce_time(s, 4, FLAT)  # noqa: E731
    assert sync_time(g, p, ZERO[0], 4, FLAT) == pytest.approx(ar(g))
    assert sync_time(g, p, ZERO[1], 4, FLAT) == pytest.approx(ar(g) / 2 + ar(p) / 2)
    assert sync_time(g, p, ZERO[3], 4, FLAT) == pytest.approx(ar(g) / 2 + ar(p) / 2)
    assert sync_time(g, p, ZERO[2], 4, FLAT) == pytest.approx(ar(p) / 2)


def test_allreduce_times_is_the_scalar_formula_per_entry() -> None:
    nodes = Nodes(count=2, devices_per_node=4, intra=LINK, inter=Link(latency_s=5e-6, bandwidth_bytes_per_s=1e8))
    cluster = hierarchical_cluster(nodes, 2**30)
    sizes = np.array([0.0, 1.0, 3e6, 7e7])
    got = allreduce_times(sizes, 8, cluster)
    assert np.allclose(got, [allreduce_time(float(s), 8, cluster) for s in sizes])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_step_end_floor_bounds_every_split(zero: int) -> None:
    rng = np.random.default_rng(zero)
    n = 6
    grads = rng.uniform(1e5, 1e7, n)
    a = arrays([1.0] * n, static=list(4 * grads), grads=list(grads))
    layout = Layout(pp=3, dp=4, zero=ZERO[zero])
    a = data_sharded(a, layout.unit_view(), lambda s: s * 0)  # only the stage matters here
    floor = step_end_floor(a, FLAT, layout)
    for cuts in ((1, 2), (2, 4), (4, 5), (1, 5)):
        ends = (0, *cuts, n)
        bounds = tuple(zip(ends, ends[1:]))
        assert gradient_allreduce_time(a, bounds, [0, 1, 2], layout, FLAT) >= floor - 1e-15


def test_group_table_is_the_rows_of_the_groups_tensor_parallel_degree() -> None:
    from autopp.costmodel import ProfileTable, group_table
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(6, tp_degrees=(2,))
    for tp in (1, 2):
        got, expected = group_table(profile, Layout(tp=tp).unit_view()).arrays(1), ProfileTable(profile, tp).arrays(1)
        assert np.array_equal(got.forward, expected.forward) and np.array_equal(got.static, expected.static)
    assert not np.array_equal(group_table(profile, Layout(tp=2).unit_view()).arrays(1).static,
                              group_table(profile, Layout().unit_view()).arrays(1).static)


def _moe_profile(top_k: int = 2):  # type: ignore[no-untyped-def]
    """A synthetic profile whose blocks hold 3/4 of their parameter bytes in one MoE layer's stacked experts."""
    from autopp.data.profile import Profile
    from autopp.data.synthetic_profile import synthetic_profile
    p = synthetic_profile(4, hidden=64, seq=16)
    blocks = p.units.unit.between(1, 2)
    units = p.units.assign(expert_param_bytes=np.where(blocks, p.units.param_bytes * 3 // 4, 0),
                           moe_layers=np.where(blocks, 1, 0))
    return Profile(replace(p.meta, extra={"moe": {"num_experts": 8, "top_k": top_k}}), units, p.edges)


def test_expert_parallelism_divides_the_expert_bytes_and_keeps_the_dense_gradients_for_the_sync() -> None:
    """ep 2: a block's expert weights and their gradient and optimizer state count half; the step's gradient
    all-reduce (`grads`) carries only the dense gradients (each rank owns its experts); compute is unchanged
    (balanced routing); the dispatch bytes are tokens x hidden x dtype x top-k x (ep - 1) / ep per MoE layer."""
    from autopp.costmodel import ExpertTable, ProfileTable, group_table
    profile = _moe_profile()
    assert type(group_table(profile, Layout(dp=2).unit_view())) is ProfileTable
    table = group_table(profile, Layout(dp=2, ep=2).unit_view())
    assert isinstance(table, ExpertTable)
    whole, sharded = ProfileTable(profile).arrays(2), table.arrays(2)
    kept = np.array([1.0, 1 - 0.75 / 2, 1 - 0.75 / 2, 1.0])
    assert np.allclose(sharded.static, np.round(whole.static * kept), atol=1)
    assert np.allclose(sharded.grads, np.round(whole.grads * np.array([1, 0.25, 0.25, 1])), atol=1)
    assert sharded.optimizer is not None and whole.optimizer is not None
    assert np.allclose(sharded.optimizer, whole.optimizer * kept)
    assert np.array_equal(sharded.forward, whole.forward) and np.array_equal(sharded.backward, whole.backward)
    assert sharded.ep_comm is not None
    tokens = 4 * 16 * 64 * 2  # float32 x seq x hidden x microbatch: the block's output bytes
    assert np.allclose(sharded.ep_comm.tokens, [0, tokens, tokens, 0]) and list(sharded.ep_comm.layers) == [0, 1, 1, 0]
    assert sharded.ep_comm.routing.top_k == 2 and sharded.ep_comm.routing.dispatch_scale == 1.0  # fp32: as computed
    assert np.allclose(table.arrays(2).params, np.round(whole.params * kept), atol=1)


def test_expert_all_to_alls_run_on_the_link_the_ep_group_crosses() -> None:
    """2 + 2 all-to-alls per MoE layer and microbatch, each bytes / bandwidth + (ep - 1) latencies: inside a node
    of 4 devices for ep 4, across nodes for ep 8."""
    from autopp.costmodel import group_table
    profile = _moe_profile()
    inter = Link(latency_s=5e-6, bandwidth_bytes_per_s=1e8)
    nodes = hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=LINK, inter=inter), 2**30)
    for ep, link in ((4, LINK), (8, inter)):
        view = Layout(dp=ep, ep=ep).unit_view()
        a = group_table(profile, view).arrays(2)
        out = group_terms(a, view, nodes)
        assert a.ep_comm is not None
        sent, layers = a.ep_comm.tokens * 2 * (ep - 1) / ep, a.ep_comm.layers  # top-2
        both = 2 * (sent / link.bandwidth_bytes_per_s + layers * (ep - 1) * link.latency_s)
        assert np.allclose(out.forward - a.forward, both) and np.allclose(out.backward_input - a.backward_input, both)
        assert np.allclose(out.backward - a.backward, both) and np.allclose(out.recompute - a.recompute, both)
        assert both[1] > 0 and both[0] == 0 and np.array_equal(out.backward_weight, a.backward_weight)


def test_sequence_parallelism_divides_the_norms_inputs_by_t_and_keeps_the_collectives() -> None:
    """Korthikanti et al. 2022: with SP the LayerNorm inputs (4 of a block's 34 s b h) are held 1/t per rank; the
    reduce-scatter + all-gather replacing each all-reduce move the same bytes in the same time on a ring."""
    from autopp.costmodel import group_table, sp_offered
    from autopp.data.synthetic_profile import synthetic_profile
    from autopp.errors import ProfileError
    profile = synthetic_profile(6, tp_degrees=(2, 4), sp=True)
    assert sp_offered(profile) and not sp_offered(synthetic_profile(6, tp_degrees=(2,)))
    for t in (2, 4):
        off, on = (group_table(profile, Layout(tp=t, sp=sp).unit_view()).arrays(1) for sp in (False, True))
        blocks = slice(1, 5)
        assert np.allclose(on.activation[blocks] / off.activation[blocks],
                           (10 + 24 / t - 4 * (1 - 1 / t)) / (10 + 24 / t), rtol=1e-6)
        assert np.array_equal(on.activation[[0, 5]], off.activation[[0, 5]])  # embedding and head: no norm counted
        assert np.array_equal(on.forward, off.forward) and np.array_equal(on.static, off.static)
        link_terms = [group_terms(a, Layout(tp=t, sp=a is on).unit_view(), FLAT) for a in (off, on)]
        assert np.array_equal(link_terms[0].forward, link_terms[1].forward)
        assert np.array_equal(link_terms[0].backward, link_terms[1].backward)
    with pytest.raises(ProfileError, match=r"has no sequence-parallel bytes \(tp.csv column sp_sequence_bytes, "
                                           r"profiles made before it\): profile it again, or plan with `sp` off$"):
        group_table(synthetic_profile(6, tp_degrees=(2,)), Layout(tp=2, sp=True).unit_view())


def test_sequence_parallelism_computes_with_the_tp_rows_sp_times_where_the_profile_has_them() -> None:
    """Issue 25: the plain tp rows count the norms and residual adds whole on every rank (DTensor TP without SP), so
    a Llama 3 70B block at tp 8 cost 1.84x 1/8 of itself; with SP a rank's compute is the rows' SP times (the shard
    counted with the stream on 1/t of the sequence). A profile without them keeps the plain times (an upper bound)."""
    from autopp.costmodel import group_table
    from autopp.data.profile_tp import SP_TIME_COLUMNS
    from autopp.data.synthetic_profile import synthetic_profile
    plain = synthetic_profile(6, tp_degrees=(4,), sp=True)
    assert plain.tp_units is not None
    rows = plain.tp_units.assign(**{c: plain.tp_units[c.removeprefix("sp_")] * 0.75 for c in SP_TIME_COLUMNS})
    timed = replace(plain, tp_units=rows)
    for profile, share in ((plain, 1.0), (timed, 0.75)):
        on, off = (group_table(profile, Layout(tp=4, sp=sp).unit_view()).arrays(1) for sp in (True, False))
        for field in ("forward", "backward", "backward_input", "backward_weight", "recompute"):
            assert np.allclose(getattr(on, field), share * getattr(off, field), rtol=1e-9), field
        assert np.array_equal(on.static, off.static)


def test_sequence_parallelism_keeps_the_residual_stream_between_a_stages_blocks_sharded() -> None:
    """Inside a stage the residual stream between two norm-holding units stays each rank's sequence shard (the
    runner's SequenceParallel, as torchtitan's blocks receive it), so per-unit recomputation keeps 1/t of each
    block's input but the stage's first (received whole); what the embedding makes for block 1 and the last block
    for the head (units without a norm in the profile's tp rows) stays whole."""
    from autopp.costmodel import group_table
    from autopp.data.profile_values import LiveValue, ValueAction
    from autopp.data.synthetic_profile import synthetic_profile
    profile = synthetic_profile(6, tp_degrees=(4,), sp=True)
    x = 4 * 2048 * 4096  # one hidden state of the synthetic profile, float32, per sample
    chain = tuple(LiveValue(name=f"h{u}", src=u, dsts=(u + 1,), action=ValueAction.SEND, bytes={1: x, 8: 8 * x})
                  for u in range(5))
    profile = replace(profile, meta=replace(profile.meta, live_values=chain))
    off, on = (group_table(profile, Layout(tp=4, sp=sp).unit_view()).arrays(1) for sp in (False, True))
    assert off.born is not None and list(off.born) == [x] * 5 + [0]
    assert on.born is not None and list(on.born) == [x, x / 4, x / 4, x / 4, x, 0]
    assert on.checkpoint_inputs(1, 5) == x + 3 * x / 4 and off.checkpoint_inputs(1, 5) == 4 * x
    assert on.checkpoint_inputs(0, 6) == x + 3 * x / 4 + x and np.array_equal(on.cut, off.cut)


def test_with_ep_below_dp_the_expert_gradients_are_all_reduced_over_their_replicas() -> None:
    """dp 4, ep 2: each expert shard is held by 2 ranks, whose all-reduce of its gradient (ring over r = 2) is
    charged in the step's dp-wide one (`grads`) at ((r - 1) / r) / ((d - 1) / d) = 2/3 of its bytes; the static
    bytes are those of ep 2 whatever dp; ep = dp keeps none (nothing to all-reduce)."""
    from autopp.costmodel import ProfileTable, group_table
    profile = _moe_profile()
    whole = ProfileTable(profile).arrays(2)
    four, two = (group_table(profile, Layout(dp=dp, ep=2).unit_view()).arrays(2) for dp in (4, 2))
    expert = whole.grads * np.array([0, 0.75, 0.75, 0]) / 2  # a rank's expert gradient bytes
    assert np.allclose(four.grads, np.round(whole.grads * np.array([1, 0.25, 0.25, 1]) + expert * 2 / 3), atol=1)
    assert np.allclose(two.grads, np.round(whole.grads * np.array([1, 0.25, 0.25, 1])), atol=1)
    assert np.array_equal(four.static, two.static) and four.expert is not None and four.expert.replicas == 2


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_beside_ep_shards_dense_bytes_over_dp_and_expert_bytes_over_their_replicas(stage: int) -> None:
    """ZeRO 1 (2) with dp 4, ep 2: the dense parameter, gradient and optimizer bytes shard over the 4 dp ranks as
    without ep, a rank's expert ones (1/2 of the stacked experts) over the 2 ranks holding the same experts; the
    optimizer step likewise. ZeRO 3 under a pipeline is refused in one line (at pp 1: tests/costmodel/test_fsdp.py)."""
    from autopp.costmodel import ProfileTable, group_table
    from autopp.errors import LayoutError
    profile = _moe_profile()
    whole = ProfileTable(profile).arrays(2)
    layout = Layout(dp=4, ep=2, zero=ZERO[stage])
    view = layout.unit_view()
    got = data_sharded(group_table(profile, view).arrays(2), view, lambda s: s * 0.0)
    share = np.array([0, 0.75, 0.75, 0])
    p, g = whole.params, whole.grads
    o = whole.static - p - g
    scatter = ZERO[stage].scatters_each_microbatch

    def shard(p, g, o, d):  # type: ignore[no-untyped-def]
        return p + p / d + (g / d if scatter else g) + o / d
    want = shard(p * (1 - share), g * (1 - share), o * (1 - share), 4) + shard(p * share / 2, g * share / 2,
                                                                             o * share / 2, 2)
    assert np.allclose(got.static, np.round(want), atol=2)
    assert whole.optimizer is not None and got.optimizer is not None
    assert np.allclose(got.optimizer, whole.optimizer * ((1 - share) / 4 + share / 2 / 2))
    with pytest.raises(LayoutError, match=r"^`zero` 3 with `ep` 2 and `pp` above 1: .*`pp` 1 or `zero` 1$"):
        view3 = Layout(pp=2, dp=4, ep=2, zero=ZERO[3]).unit_view()
        data_sharded(group_table(profile, view3).arrays(2), view3, lambda s: s * 0.0)


def _fsdp_arrays() -> tuple:
    a = arrays([1.0, 1.0, 1.0], static=[16.0, 32.0, 16.0], grads=[4.0, 8.0, 4.0])
    return a, np.array([0.5, 3.0, 0.5]), np.array([0.25, 0.5, 0.25])


def test_fsdp_at_pp_1_shards_everything_and_holds_one_unit_and_its_neighbour_gathered() -> None:
    """Issue 25 item 3: with pp 1 ZeRO 3 is FSDP2 resharding after forward: static bytes all / d, the working
    memory a unit's gathered parameters and its neighbour's, its gradients and the next unit's being scattered."""
    a, p, g = _zero_arrays()[0], _zero_arrays()[1], _zero_arrays()[2]
    view = Layout(pp=1, dp=4, zero=ZERO[3]).unit_view()
    assert view.fsdp and not Layout(pp=2, dp=4, zero=ZERO[3]).unit_view().fsdp
    assert not Layout(pp=1, dp=4, zero=ZERO[1]).unit_view().fsdp
    out = data_sharded(a, view, lambda s: s / 1e9)
    assert out.fsdp and np.allclose(out.static, np.round(a.static / 4))
    # units 0 and 1: p0 + p1 (the neighbour) + g0 + g1, and p1 + p0 + g1 (no unit after it)
    assert np.allclose(out.transient_bytes(), [p[0] + p[1] + g[0] + g[1], p[1] + p[0] + g[1]])


def test_fsdp_prefetch_hides_each_gather_and_scatter_under_the_neighbours_compute() -> None:
    from autopp.costmodel import fsdp_outside_pipeline
    from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP
    a, gather, scatter = _fsdp_arrays()
    hidden = fsdp_outside_pipeline(replace(a, overlap=TRAINER_OVERLAP), gather, scatter)
    # forward of u under the gather of u + 1, the first gather exposed: max(1, 3) + 0.5, max(1, 0.5), 1
    assert np.allclose(hidden.forward, [3.5, 1.0, 1.0])
    # backward (B = 2) of u under the gather of u - 1 and the scatter of u + 1; unit 0's scatter and the last
    # unit's gather exposed: max(2, 0 + 0.5) + 0.25, max(2, 0.5 + 0.25), max(2, 3 + 0) + 0.5
    assert np.allclose(hidden.backward, [2.25, 2.0, 3.5])
    assert np.allclose(hidden.backward_weight - a.backward_weight, hidden.backward - a.backward)
    assert np.array_equal(hidden.recompute, a.recompute)  # the recomputed forward uses the backward's gather
    total, exposed = hidden.zero_seconds  # type: ignore[misc]
    assert np.allclose(total, 2 * gather + scatter) and np.allclose(exposed.sum(), 2.5 + 0.25 + 1.5)
    exposed_all = fsdp_outside_pipeline(replace(a, overlap=NO_OVERLAP), gather, scatter)
    assert np.allclose(exposed_all.forward, a.forward + gather)
    assert np.allclose(exposed_all.backward, a.backward + gather + scatter)
    assert np.allclose(exposed_all.zero_seconds[1], exposed_all.zero_seconds[0])  # type: ignore[index]


def test_fsdp_at_pp_1_leaves_nothing_for_the_steps_end() -> None:
    a, *_ = _zero_arrays()
    out = data_sharded(a, Layout(pp=1, dp=4, zero=ZERO[3]).unit_view(), lambda s: s / 1e9)
    layout = Layout(pp=1, dp=4, zero=ZERO[3])
    assert gradient_allreduce_time(out, [(0, 2)], [0], layout, FLAT) == 0.0
    assert step_end_floor(out, FLAT, layout) == 0.0


def test_async_tp_leaves_the_first_chunk_and_what_the_compute_cannot_cover() -> None:
    from autopp.data.overlap import Overlap
    a = replace(arrays([1.0, 1e-4], static=[10, 10]), tp_comm=_comm(2, 4e6, 2e6, 1e6))
    plain = tensor_parallel(a, Layout(tp=4, sp=True).unit_view(), LINK)
    fast = tensor_parallel(replace(a, overlap=Overlap(async_tp=True)), Layout(tp=4, sp=True).unit_view(), LINK)
    comm = plain.forward - a.forward
    assert np.allclose(fast.forward - a.forward, comm / 4 + np.maximum(0, comm * 3 / 4 - a.forward))
    assert fast.forward[0] < plain.forward[0] and fast.forward[1] > a.forward[1] + comm[1] * 3 / 4
    total, exposed = fast.tp_seconds  # type: ignore[misc]
    assert np.allclose(total, plain.tp_seconds[0]) and np.all(exposed < total)  # type: ignore[index]
    # without sequence parallelism there is nothing for it to decompose
    no_sp = tensor_parallel(replace(a, overlap=Overlap(async_tp=True)), Layout(tp=4).unit_view(), LINK)
    assert np.array_equal(no_sp.forward, plain.forward)


def test_pure_bf16_shards_the_weights_themselves() -> None:
    """The bf16-pure recipe keeps 2 + 2 + 4 bytes per parameter (bf16 weights, gradients and two Adam moments, no
    master: autopp.data.precision), the synthetic profile's P : G : O = 1 : 1 : 2. Without a master copy the weights
    are what the optimizer steps, so FSDP2's sharded parameter is a bf16 shard of them: at pp 1 over 8 ranks
    (P + G + O) / 8 = 1 byte per parameter; at ZeRO 1 under a pipeline over 4, P + P / 4 + G + O / 4 = 5.5 bytes
    (bf16 mixed precision: 2 + 4 + 12 / 4 = 9)."""
    from autopp.costmodel import ProfileTable
    from autopp.costmodel.parallel import static_terms
    from autopp.data.profile import Profile
    from autopp.data.synthetic_profile import synthetic_profile
    p = synthetic_profile(4, hidden=64, seq=16)
    p = Profile(replace(p.meta, dtype="bfloat16", extra={"precision": "bf16-pure"}), p.units, p.edges)
    a = ProfileTable(p).arrays(2)
    numel = a.params / 2
    assert not a.master and np.allclose(a.grads, 2 * numel) and np.allclose(a.static, 8 * numel)
    fsdp = Layout(pp=1, dp=8, zero=ZERO[3]).unit_view()
    terms = static_terms(a, fsdp)
    assert np.allclose(terms["sharded parameters"], 2 * numel / 8) and np.allclose(terms["weights"], 0)
    assert np.allclose(data_sharded(a, fsdp, lambda s: s * 0.0).static, np.round(numel), atol=1)
    zero1 = data_sharded(a, Layout(pp=2, dp=4, zero=ZERO[1]).unit_view(), lambda s: s * 0.0)
    assert np.allclose(zero1.static, np.round(5.5 * numel), atol=1)

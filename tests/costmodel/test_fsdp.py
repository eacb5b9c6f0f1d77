"""FSDP2 outside a pipeline beside expert parallelism (autopp.costmodel.fsdp): the dense bytes over the d
synchronisation ranks, the experts' over their r = d / ep replicas, term by term, with r = 1 and r > 1 (issue 30)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import ProfileTable, data_sharded, group_table
from autopp.costmodel.fsdp import check_expert_zero
from autopp.costmodel.parallel import STATIC_TERMS, static_terms
from autopp.data.layout import Layout
from autopp.data.zero import ZERO
from autopp.errors import LayoutError

from .test_parallel import _moe_profile

SHARE = np.array([0, 0.75, 0.75, 0])  # the blocks' expert share of their bytes (`_moe_profile`)


def _whole() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    a = ProfileTable(_moe_profile()).arrays(2)
    return a.params, a.grads, a.static - a.params - a.grads, a.optimizer


def _sharded(dp: int, ep: int):  # type: ignore[no-untyped-def]
    view = Layout(pp=1, dp=dp, ep=ep, zero=ZERO[3]).unit_view()
    assert view.fsdp
    a = group_table(_moe_profile(), view).arrays(2)
    return view, a, data_sharded(a, view, lambda s: s / 1e9)


def test_with_ep_equal_to_dp_the_experts_are_fsdp2_over_one_rank_gathered_for_each_use() -> None:
    """dp 4, ep 4 (r = 1): the dense parameters, gradients and optimizer state over the 4 ranks; a rank's experts
    (1/4 of the stacked ones) `fully_shard`-ed over their one rank, as torchtitan wraps them (dp_shard_mod_ep of size
    1): no persistent weights, their sharded parameter (the whole of them; no master copy in the profile), gradients
    and optimizer state whole; the unit's experts gathered (copied, no collective) into its working memory beside the
    dense weights, nothing of them reduce-scattered. Until 2026-12-05 their weights were persistent and not
    gathered."""
    p, g, o, _ = _whole()
    view, a, out = _sharded(4, 4)
    dense, mine = 1 - SHARE, SHARE / 4
    terms = static_terms(a, view)
    assert list(terms) == list(STATIC_TERMS)
    assert np.allclose(terms["weights"], 0)
    assert np.allclose(terms["sharded parameters"], p * dense / 4 + p * mine, atol=1)
    assert np.allclose(terms["gradients"], g * dense / 4 + g * mine, atol=1)
    assert np.allclose(terms["optimizer state"], o * dense / 4 + o * mine, atol=1)
    assert np.allclose(out.static, np.round(sum(terms.values())), atol=1) and out.fsdp
    # working memory: the unit gathered (dense and experts), its prefetched neighbour, its unsharded gradients and the
    # next one's
    held, grads = p * (dense + mine), g * (dense + mine)
    neighbour = np.maximum(np.r_[0, held[:-1]], np.r_[held[1:], 0])
    assert np.allclose(out.transient_bytes() - a.transient_bytes(), held + neighbour + grads + np.r_[grads[1:], 0],
                       atol=2)
    total, _ = out.zero_seconds  # type: ignore[misc]
    assert np.allclose(total, 2 * p * dense / 2e9 + g * dense / 2e9, rtol=1e-6)  # the dense collectives alone


def test_with_ep_equal_to_dp_and_a_master_copy_no_bf16_expert_weights_persist() -> None:
    """The bf16 recipe (`UnitArrays.master`: the optimizer bytes hold the fp32 master) at dp 4 = ep 4: FSDP2's
    sharded expert parameter is that master, so a rank keeps no weights of its experts between uses, only their
    gradients and optimizer state (with the master). By hand, block 1 (1/4 dense, 3/4 experts): (G + O) x (1/4 / 4 +
    3/4 / 4) = (G + O) / 4, its parameter bytes P nowhere."""
    view = Layout(pp=1, dp=4, ep=4, zero=ZERO[3]).unit_view()
    a = replace(group_table(_moe_profile(), view).arrays(2), master=True)
    p, g, o, _ = _whole()
    terms = static_terms(a, view)
    dense, mine = 1 - SHARE, SHARE / 4
    assert np.allclose(terms["weights"], 0) and np.allclose(terms["sharded parameters"], 0)
    assert np.allclose(terms["gradients"] + terms["optimizer state"], (g + o) * (dense / 4 + mine), atol=2)
    out = data_sharded(a, view, lambda s: s / 1e9)
    assert np.allclose(out.static, np.round(sum(terms.values())), atol=1)
    assert out.static[1] == pytest.approx((g[1] + o[1]) / 4, abs=2)


def test_with_ep_below_dp_the_experts_shard_and_gather_over_their_replicas() -> None:
    """dp 4, ep 2 (r = 2): the experts' parameters, gradients and optimizer state over their 2 replicas, gathered
    over them for each use (working memory) and reduce-scattered over them, costed as the dp-wide collective of
    ((r - 1) / r) / ((d - 1) / d) = 2/3 of their bytes; the optimizer steps 1/4 of the dense state and 1/2 of the
    experts'."""
    p, g, o, step = _whole()
    view, a, out = _sharded(4, 2)
    dense, mine = 1 - SHARE, SHARE / 2
    terms = static_terms(a, view)
    assert np.allclose(terms["weights"], 0)
    assert np.allclose(terms["sharded parameters"], p * dense / 4 + p * mine / 2, atol=1)
    assert np.allclose(terms["gradients"], g * dense / 4 + g * mine / 2, atol=1)
    assert np.allclose(terms["optimizer state"], o * dense / 4 + o * mine / 2, atol=1)
    assert np.allclose(out.static, np.round(sum(terms.values())), atol=1)
    held, grads = p * (dense + mine), g * (dense + mine)
    neighbour = np.maximum(np.r_[0, held[:-1]], np.r_[held[1:], 0])
    assert np.allclose(out.transient_bytes() - a.transient_bytes(), held + neighbour + grads + np.r_[grads[1:], 0],
                       atol=2)
    gather = p * dense / 2e9 + 2 / 3 * p * mine / 2e9
    scatter = g * dense / 2e9 + 2 / 3 * g * mine / 2e9
    total, _ = out.zero_seconds  # type: ignore[misc]
    assert np.allclose(total, 2 * gather + scatter, rtol=1e-4)
    assert step is not None and out.optimizer is not None
    assert np.allclose(out.optimizer, step * (dense / 4 + mine / 2))


def test_fsdp_beside_ep_holds_less_than_zero_1_and_gathers_only_what_it_shards() -> None:
    """At the same dp 4 x ep 2 (r = 2), FSDP2 keeps no whole weights between uses: its static bytes are ZeRO 1's less
    the gathered parameters and the gradients' unsharded part; with r = 1 the expert bytes are ZeRO 1's."""
    for ep in (2, 4):
        view, a, fsdp = _sharded(4, ep)
        one = Layout(pp=1, dp=4, ep=ep, zero=ZERO[1]).unit_view()
        zero1 = data_sharded(group_table(_moe_profile(), one).arrays(2), one, lambda s: s / 1e9)
        assert (fsdp.static <= zero1.static).all() and (fsdp.static < zero1.static).any()


def test_zero_3_beside_ep_is_refused_under_a_pipeline_in_one_line() -> None:
    check_expert_zero(ZERO[3], 2, pipelined=False)
    check_expert_zero(ZERO[1], 2, pipelined=True)
    check_expert_zero(ZERO[3], 1, pipelined=True)
    with pytest.raises(LayoutError, match=r"^`zero` 3 with `ep` 2 and `pp` above 1: [^\n]*`pp` 1 or `zero` 1$"):
        check_expert_zero(ZERO[3], 2, pipelined=True)
    view = Layout(pp=2, dp=4, ep=2, zero=ZERO[3]).unit_view()
    with pytest.raises(LayoutError, match="`pp` above 1"):
        static_terms(group_table(_moe_profile(), view).arrays(2), view)


def test_the_experts_collectives_run_over_their_replicas_on_the_link_they_cross() -> None:
    """dp 8 over 2 nodes of 4, ep 2: each expert shard's 4 replicas (ranks 2 apart) span both nodes, so its gathers
    and reduce-scatters are a ring of 4 on the inter-node link (half an all-reduce each: 2 (r - 1) / r x bytes /
    bandwidth + 2 (r - 1) latencies, halved), beside the dense ones over the 8 ranks as without ep."""
    from autopp.costmodel import allreduce_times, replica_terms
    from autopp.costmodel.fsdp import dense_bytes
    from autopp.data.cluster import Link, Nodes, hierarchical_cluster
    intra, inter = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e9), Link(latency_s=5e-6, bandwidth_bytes_per_s=1e8)
    groups = hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=intra, inter=inter), 2**30)
    view = Layout(pp=1, dp=8, ep=2, zero=ZERO[3]).unit_view()
    a = group_table(_moe_profile(), view).arrays(2)
    e = a.expert
    assert e is not None and e.replicas == 4
    out = replica_terms(a, view, groups)
    ring = lambda x: np.where(x > 0, 2 * 3 / 4 * x / 1e8 + 2 * 3 * 5e-6, 0.0)  # noqa: E731
    p, g, _ = dense_bytes(a)
    dense = lambda x: allreduce_times(x, 8, groups)  # noqa: E731
    want = 2 * (dense(p) + ring(e.params)) / 2 + (dense(g) + ring(e.grads)) / 2
    total, _ = out.zero_seconds  # type: ignore[misc]
    assert np.allclose(total, want, rtol=1e-9) and ring(e.params)[1] > 0 and ring(e.params)[0] == 0

"""Expert parallelism's all-to-alls (autopp.costmodel.alltoall): the flat count, DeepSeek-V3's node-limited routing
(each token across nodes once per target node, forwarded inside the node) and its FP8 dispatch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel.alltoall import (AllToAll, Routing, alltoall_time, ep_nodes, routing_of, routing_note,
                                       target_nodes)
from autopp.data.cluster import Link, Nodes, hierarchical_cluster
from autopp.data.profile import Profile
from autopp.data.synthetic_profile import synthetic_profile

INTRA = Link(latency_s=5e-6, bandwidth_bytes_per_s=200e9)
INTER = Link(latency_s=1e-5, bandwidth_bytes_per_s=50e9)
T = 4096 * 7168 * 2.0  # one microbatch of 4,096 tokens, hidden 7,168 in bf16: DeepSeek-V3's at microbatch 1
FP8 = (1 + 4 / 128) / 2
#: DeepSeek-V3's routing (examples/configs/deepseek-v3.json): 256 experts in 8 groups, top-8 within 4 groups.
DEEPSEEK = Routing(top_k=8, num_experts=256, num_groups=8, group_top_k=4)


def _nodes(count: int, per_node: int = 8):  # type: ignore[no-untyped-def]
    return hierarchical_cluster(Nodes(count=count, devices_per_node=per_node, intra=INTRA, inter=INTER), 2**30)


def _one(routing: Routing, layers: int = 1) -> AllToAll:
    return AllToAll(np.array([0.0, layers * T]), np.array([0.0, float(layers)]), routing)


def test_the_flat_count_is_top_k_copies_on_the_group_link() -> None:
    """Not group-limited (Qwen3, Mixtral): 2 all-to-alls of k x (e - 1) / e x T per layer and pass, on the node's
    link for ep 8 in a node of 8, on the inter-node link for ep 16 over 2 nodes; FP8 shrinks the dispatch only."""
    flat = Routing(top_k=8, num_experts=128)
    for ep, link in ((8, INTRA), (16, INTER)):
        got = alltoall_time(_one(flat), ep, 1, _nodes(2))
        want = 2 * (8 * (ep - 1) / ep * T / link.bandwidth_bytes_per_s + (ep - 1) * link.latency_s)
        assert got[0] == 0 and got[1] == pytest.approx(want)
        fp8 = alltoall_time(_one(replace(flat, dispatch_scale=FP8)), ep, 1, _nodes(2))
        assert fp8[1] == pytest.approx((1 + FP8) * 8 * (ep - 1) / ep * T / link.bandwidth_bytes_per_s
                                       + 2 * (ep - 1) * link.latency_s)


def test_node_limited_routing_sends_each_token_across_nodes_once_per_target_node() -> None:
    """DeepSeek-V3 at EP64 over 8 nodes (s.3.2): one group of 32 experts per node, so a token reaches at most 4 of
    the 8 nodes: 4 x 7/8 x T over IB per all-to-all against the flat 8 x 63/64 x T; its NVLink leg (8 x 7/8 x T at
    4x the bandwidth) is the faster, so each all-to-all costs its IB leg; FP8 makes the dispatch's 0.52 of that."""
    cluster = _nodes(8)
    assert ep_nodes(64, 1, cluster) == (8, 8) and target_nodes(DEEPSEEK, 64, 8) == 4
    ib = 4 * 7 / 8 * T / 50e9 + 7 * 1e-5
    nv = 8 * 7 / 8 * T / 200e9 + 7 * 5e-6
    assert nv < ib
    assert alltoall_time(_one(DEEPSEEK), 64, 1, cluster)[1] == pytest.approx(2 * ib)
    flat = alltoall_time(_one(replace(DEEPSEEK, num_groups=None, group_top_k=None)), 64, 1, cluster)[1]
    assert flat == pytest.approx(2 * (8 * 63 / 64 * T / 50e9 + 63 * 1e-5))
    fp8 = alltoall_time(_one(replace(DEEPSEEK, dispatch_scale=FP8), layers=3), 64, 1, cluster)[1]
    assert fp8 == pytest.approx(3 * (FP8 * 4 * 7 / 8 * T / 50e9 + 4 * 7 / 8 * T / 50e9 + 2 * 7 * 1e-5))
    assert fp8 / 3 / flat == pytest.approx(0.322, abs=1e-3)  # with FP8: a third of the flat (7 latencies, not 63)


def test_the_slower_leg_is_costed_where_the_nodes_links_are_close() -> None:
    """With NVLink no faster than IB the intra-node leg (every copy's hop) is the slower one and is charged."""
    slow = hierarchical_cluster(Nodes(count=8, devices_per_node=8, intra=INTER, inter=INTER), 2**30)
    got = alltoall_time(_one(DEEPSEEK), 64, 1, slow)[1]
    assert got == pytest.approx(2 * (8 * 7 / 8 * T / 50e9 + 7 * 1e-5))


@pytest.mark.parametrize("ep, nodes, want", [(16, 2, 2), (32, 4, 4), (64, 8, 4), (128, 16, 8), (256, 32, 8)])
def test_target_nodes_under_the_group_limit(ep: int, nodes: int, want: int) -> None:
    """min(k, n, topk_group x nodes per group): 2 and 4 nodes hold 4 and 2 groups each (at most n nodes); over 16
    and 32 nodes a group spans 2 and 4 nodes, so 4 groups reach 8 nodes, and k = 8 caps it."""
    assert target_nodes(DEEPSEEK, ep, nodes) == want


def test_an_ep_group_inside_one_node_or_over_partial_nodes_keeps_the_flat_count() -> None:
    flat = replace(DEEPSEEK, num_groups=None, group_top_k=None)
    for ep, count, per_node in ((8, 8, 8), (4, 2, 8), (12, 4, 8)):
        cluster = _nodes(count, per_node)
        assert ep_nodes(ep, 1, cluster) is None
        assert alltoall_time(_one(DEEPSEEK), ep, 1, cluster)[1] == alltoall_time(_one(flat), ep, 1, cluster)[1]
    assert ep_nodes(8, 2, _nodes(2)) == (2, 4)  # ep 8 of tp 2 groups: 16 devices, 4 ranks per node


def _moe(extra: dict[str, object], dtype: str = "float32") -> Profile:
    p = synthetic_profile(4, hidden=64, seq=16)
    blocks = p.units.unit.between(1, 2)
    units = p.units.assign(expert_param_bytes=np.where(blocks, p.units.param_bytes // 2, 0),
                           moe_layers=np.where(blocks, 1, 0))
    return Profile(replace(p.meta, dtype=dtype, extra=extra), units, p.edges)


def test_the_routing_comes_from_the_profile_and_its_recipe() -> None:
    """The group facts autopp.model.experts.moe_facts records; an older profile without them: not recorded, flat
    (and the note says so where the ep group spans nodes); the fp8 recipe's dispatch scale."""
    facts = {"num_experts": 256, "top_k": 8, "num_groups": 8, "group_top_k": 4}
    assert routing_of(_moe({"moe": facts, "precision": "fp8"}, "bfloat16")) == replace(DEEPSEEK, dispatch_scale=FP8)
    old = routing_of(_moe({"moe": {"num_experts": 256, "top_k": 8}}))
    assert not old.recorded and not old.group_limited and old.dispatch_scale == 1.0
    none = routing_of(_moe({"moe": {**facts, "num_groups": None, "group_top_k": None}}))
    assert none.recorded and not none.group_limited
    cluster = _nodes(8)
    assert "group-limited (DeepSeek-V3's), profile it again to count them" in routing_note(old, 64, 1, cluster)
    assert routing_note(old, 8, 1, cluster) == routing_note(none, 64, 1, cluster) == ""
    note = routing_note(replace(DEEPSEEK, dispatch_scale=FP8), 64, 1, cluster)
    assert "top-8 within 4 of 8 expert groups" in note and "to at most 4 of the ep group's 8" in note
    assert "dispatch in FP8 (0.52 of the activations' bytes" in note


def test_a_deepseek_shaped_plan_spends_under_a_third_of_the_all_to_all_time() -> None:
    """Plan level: a DeepSeek-shaped MoE (256 experts, top-8 within 4 of 8 groups, fp8) pinned to pp 2 x EP64 over
    8 nodes of H800s: its stages' all-to-all time (`comm_s`, one pass) is the flat count's x (0.52 + 1) x 4 x 7/8 /
    (2 x 8 x 63/64) (plus 7 latencies per all-to-all, not 63), and the notes say what was assumed; the same model
    profiled before the routing groups were recorded (bf16) keeps the flat count and its note says so."""
    from autopp.data.catalog import cluster_from_catalog, load_device
    from autopp.data.layout import LayoutPins
    from autopp.schedule import ScheduleName
    from autopp.solve import PlanRequest, make_plan
    facts = {"num_experts": 256, "top_k": 8, "num_groups": 8, "group_top_k": 4}
    base = synthetic_profile(6, hidden=1024, seq=4096)
    blocks = base.units.unit.between(1, 4)
    units = base.units.assign(expert_param_bytes=np.where(blocks, base.units.param_bytes // 2, 0),
                              moe_layers=np.where(blocks, 1, 0))
    cluster = cluster_from_catalog(load_device("h800"), None, nodes=16, devices_per_node=8, memory_bytes=80 * 2**30)
    request = PlanRequest(cluster=cluster, global_batch=256, schedule=ScheduleName.ONE_F_ONE_B, num_microbatches=4,
                          pins=LayoutPins(pp=2, dp=64, ep=64))
    plans = {name: make_plan(Profile(replace(base.meta, dtype="bfloat16", extra=extra), units, base.edges), request)
             for name, extra in (("limited", {"moe": facts, "precision": "fp8"}),
                                 ("old", {"moe": {"num_experts": 256, "top_k": 8}, "precision": "bf16"}))}
    comm = {name: sum(s.comm_s for s in plan.stages) for name, plan in plans.items()}
    tokens = 4 * 4096 * 1024 * 4.0  # 4 blocks' outputs at microbatch 1 (the synthetic profile's float32 bytes)
    assert comm["old"] == pytest.approx(2 * (8 * 63 / 64 * tokens / 50e9 + 4 * 63 * 10e-6))
    assert comm["limited"] == pytest.approx((FP8 + 1) * 4 * 7 / 8 * tokens / 50e9 + 2 * 4 * 7 * 10e-6)
    assert comm["limited"] / comm["old"] == pytest.approx(0.293, abs=1e-3)  # 0.335 in bytes, fewer latencies
    assert any("to at most 4 of the ep group's 8" in n and "dispatch in FP8" in n for n in plans["limited"].notes)
    assert any("counted before the routing groups" in n for n in plans["old"].notes)

"""Context parallelism's unit costs (autopp.costmodel.context): a rank's share of the sequence, the K/V ring's bytes
and its overlap with one block of attention, on the link the cp x tp devices cross."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import (ContextTable, ProfileTable, attention_shape, check_sequence, context_parallel,
                              group_table, group_terms)
from autopp.costmodel.context import attention_layers, attention_slowdown
from autopp.data.cluster import Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout
from autopp.data.profile import Profile
from autopp.data.synthetic_profile import synthetic_profile
from autopp.errors import ProfileError

HIDDEN, SEQ = 64, 16
ATTENTION = {"heads": 4, "kv_heads": 2, "head_dim": 16, "causal": True}


def _profile(**attention: object) -> Profile:
    """A synthetic GPT-like profile (emb, 4 blocks h.0-h.3, head; float32) made as if from an HF config."""
    p = synthetic_profile(6, hidden=HIDDEN, seq=SEQ, tp_degrees=(2,))
    hf = {"seq_len": SEQ, "task": "causal-lm", "model_type": "llama", "attention": {**ATTENTION, **attention}}
    return replace(p, meta=replace(p.meta, extra={"hf_config": hf}, dtype="float32"))


def test_the_shape_and_the_layers_come_from_the_hf_config_and_the_units_names() -> None:
    shape = attention_shape(_profile())
    assert shape is not None and (shape.heads, shape.kv_heads, shape.head_dim, shape.seq_len) == (4, 2, 16, SEQ)
    assert shape.causal and shape.dtype_bytes == 4
    assert attention_shape(synthetic_profile(4)) is None  # a model file's profile records none
    assert list(attention_layers(_profile())) == [0, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("cp", [2, 4])
def test_a_rank_computes_and_holds_the_rows_of_b_over_cp_samples(cp: int) -> None:
    """Balanced ring attention does 1/cp of the causal attention and of every token-wise op on each rank: the
    profile's rows at b / cp samples of the whole sequence; parameters stay whole."""
    p = _profile()
    got, rows = ContextTable(p, 1, cp).arrays(8), ProfileTable(p).arrays(8 / cp)
    for name in ("forward", "backward", "backward_input", "recompute", "activation", "cut"):
        assert np.array_equal(getattr(got, name), getattr(rows, name)), name
    assert np.array_equal(got.static, ProfileTable(p).arrays(8).static)
    assert np.allclose(got.activation, ProfileTable(p).arrays(8).activation / cp, atol=1)


def test_the_ring_carries_kv_shards_of_the_kv_heads_on_each_tensor_parallel_rank() -> None:
    """A shard is 2 (K and V) x b x s/cp x ceil(kv heads / tp) x head size x dtype bytes, per attention layer; the
    ring's working memory holds two of them beside the profile's."""
    p = _profile()
    for tp, kv_local in ((1, 2), (2, 1)):
        a = ContextTable(p, tp, 4).arrays(8)
        assert a.cp_ring is not None
        shard, layers, block_f, block_b = a.cp_ring
        expected = 2 * 8 * (SEQ / 4) * kv_local * 16 * 4
        assert np.allclose(shard, [0, expected, expected, expected, expected, 0]) and list(layers) == [0, 1, 1, 1, 1, 0]
        base = ProfileTable(p, tp).arrays(2)
        assert np.allclose(a.transient_bytes() - base.transient_bytes(), 2 * shard)
    assert np.all(block_b[1:5] > block_f[1:5]) and block_f[0] == 0


def test_one_block_of_attention_is_its_share_of_the_units_flops_over_cp() -> None:
    """Attention FLOPs per sample 4 s^2 heads head_dim / 2 (causal) against 2 x parameters x s of the matmuls; one
    ring step computes 1/cp of this rank's attention."""
    p = _profile()
    a = ContextTable(p, 1, 2).arrays(4)
    assert a.cp_ring is not None
    params = p.units[(p.units.microbatch_size == 1) & (p.units.unit == 1)].param_bytes.iloc[0] / 4
    attention = 4 * SEQ * SEQ * 4 * 16 / 2
    share = attention / (attention + 2 * params * SEQ)
    assert np.isclose(a.cp_ring[2][1], a.forward[1] * share / 2)
    bidirectional = ContextTable(_profile(causal=False), 1, 2).arrays(4)
    assert bidirectional.cp_ring is not None and bidirectional.cp_ring[2][1] > a.cp_ring[2][1]


def test_on_an_analytic_profile_attentions_share_is_of_the_time() -> None:
    """An analytic profile whose attention ran at half the compute efficiency (a GPU's default, 0.3 against 0.6)
    weighs its attention FLOPs twice: a block of attention is that share of the unit's time; a measured profile (or
    one without an attention efficiency) weighs them once."""
    p = _profile()
    counted = replace(p, meta=replace(p.meta, extra={**p.meta.extra, "analytic": {
        "compute_efficiency": 0.6, "attention_efficiency": 0.3}}))
    assert attention_slowdown(counted) == pytest.approx(2.0) and attention_slowdown(p) == 1.0
    params = p.units[(p.units.microbatch_size == 1) & (p.units.unit == 1)].param_bytes.iloc[0] / 4
    attention = 2 * 4 * SEQ * SEQ * 4 * 16 / 2
    a = ContextTable(counted, 1, 2).arrays(4)
    assert a.cp_ring is not None
    assert np.isclose(a.cp_ring[2][1], a.forward[1] * attention / (attention + 2 * params * SEQ) / 2)
    cpu = replace(counted, meta=replace(counted.meta, extra={**p.meta.extra, "analytic": {
        "compute_efficiency": 0.5, "attention_efficiency": None}}))
    assert attention_slowdown(cpu) == 1.0


def test_the_exchange_is_hidden_under_a_block_and_only_its_excess_is_exposed() -> None:
    """Each of cp - 1 steps per layer costs max(0, t - c) in the forward and max(0, 2t - c_b) in the backward, t =
    shard / bandwidth + latency; F, the recomputed forward, I and B take it, W does not."""
    p = _profile()
    view = Layout(cp=4).unit_view()
    a = ContextTable(p, 1, 4).arrays(8)
    assert a.cp_ring is not None
    shard, layers, block_f, block_b = a.cp_ring
    fast = Link(latency_s=0.0, bandwidth_bytes_per_s=1e18)
    hidden = context_parallel(a, view, fast)
    assert np.array_equal(hidden.forward, a.forward) and np.array_equal(hidden.backward, a.backward)
    slow = Link(latency_s=1e-4, bandwidth_bytes_per_s=1e6)
    out = context_parallel(a, view, slow)
    t = shard / 1e6 + 1e-4
    forward = layers * 3 * np.maximum(0, t - block_f)
    backward = layers * 3 * np.maximum(0, 2 * t - block_b)
    assert np.allclose(out.forward - a.forward, forward) and np.allclose(out.recompute - a.recompute, forward)
    assert np.allclose(out.backward_input - a.backward_input, backward)
    assert np.allclose(out.backward - a.backward, backward) and np.array_equal(out.backward_weight, a.backward_weight)
    assert forward[1] > 0 and forward[0] == 0 and backward[5] == 0
    assert context_parallel(a, Layout().unit_view(), slow) is a


def test_the_ring_runs_on_the_link_its_cp_x_tp_devices_cross() -> None:
    """On nodes of 4 devices: cp 2 x tp 2 inside a node, cp 4 x tp 2 across nodes (group_terms)."""
    p = _profile()
    inter = Link(latency_s=1e-3, bandwidth_bytes_per_s=1e5)
    intra = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
    nodes = hierarchical_cluster(Nodes(count=2, devices_per_node=4, intra=intra, inter=inter), 2**30)
    for cp, link in ((2, intra), (4, inter)):
        view = Layout(cp=cp, tp=2).unit_view()
        table = group_table(p, view)
        assert isinstance(table, ContextTable)
        a = table.arrays(8)
        expected = context_parallel(a, view, link)
        got = group_terms(a, view, nodes)
        tp_only = group_terms(a, view._replace(cp=1), nodes)  # the tensor-parallel collectives alone
        assert np.allclose(got.forward - tp_only.forward, expected.forward - a.forward)


def test_cp_needs_the_attention_shape_and_a_sequence_that_shards() -> None:
    with pytest.raises(ProfileError, match=r"^`cp` 2: the profile of synthetic-4.py records no attention shape "):
        group_table(synthetic_profile(4), Layout(cp=2).unit_view())
    assert check_sequence(131072, 8, 1) is None and check_sequence(16, 4, 2) is None
    assert check_sequence(24, 4, 2) == ("`cp` 4 with `tp` 2: context parallelism needs seq % (2 x cp x tp) == 0 for "
                                        "causal load balancing, and 24 % 16 = 8")

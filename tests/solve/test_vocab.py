"""Choosing vocabulary parallelism: chosen on a head-heavy model where it wins in the simulator, not chosen where
the head is light or the links are slow, and its costs (the vocabulary layers' work and memory / p, the
collectives) as autopp.costmodel.vocab writes them; and make_plan's choice of it (`PlanRequest.vocab`), refused in one
line where the profile's model cannot run it or a trainer is asked for."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from autopp.costmodel import UnitArrays
from autopp.costmodel.vocab import VocabVariant, body_arrays, vocab_passes, with_vocab_passes
from autopp.data.cluster import Cluster, Link, Nodes, hierarchical_cluster
from autopp.data.layout import Layout, LayoutPins
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.data.synthetic_profile import synthetic_profile
from autopp.errors import LayoutError, PlanError
from autopp.predict import simulate_plan
from autopp.schedule import ScheduleName, StageCost
from autopp.solve import PlanRequest, make_plan
from autopp.solve.search.request import Config
from autopp.solve.search.vocab import choose_vocab, vocab_runs

FACTS: dict[str, object] = {"embedding": "emb", "head": "head", "vocab": 32768, "hidden": 1024, "tied": False}

FAST = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e12)
SLOW = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e3)


def _lm(head: float, blocks: int = 6, cut: float = 1000.0, static: float = 100.0) -> UnitArrays:
    """Embedding (0.1), `blocks` blocks of forward 1, a head of forward `head`; B = 2 F, I = W = F."""
    f = np.array([0.1, *[1.0] * blocks, head])
    n = len(f)
    st = np.array([static * 8, *[static] * blocks, static * 8])
    return UnitArrays(f, f.copy(), f.copy(), f.copy(), st, 10 * f, st / 4, st / 4,
                      np.array([0.0, *[cut] * (n - 1), 0.0]), True, 2 * f)


def _cluster(link: Link, pp: int = 4, memory: int = 2**40) -> Cluster:
    return Cluster(num_devices=pp, memory_bytes=memory, link=link)


def test_passes_divide_the_vocabulary_layers_by_p() -> None:
    a = _lm(head=4.0)
    p = vocab_passes(a, 4, FAST, VocabVariant.VOCAB_2, microbatches=1)
    assert p.input_s + p.output_s == pytest.approx(3 * (0.1 + 4.0) / 4 + p.comm_s, rel=1e-9)  # F + B = 3 F
    assert p.link_bytes == 4 * 1000
    assert p.static_bytes == (800 + 800) // 4 + 1 * 1000 + 1 * 1000  # Vocab-2's p + 1, one partial embedding
    assert vocab_passes(a, 4, FAST, VocabVariant.VOCAB_1, microbatches=1).static_bytes == p.static_bytes + 1000
    body = body_arrays(a)
    assert body.forward[0] == body.forward[-1] == 0 and body.forward[1] == 1.0 and a.forward[-1] == 4.0


def test_chosen_on_a_head_heavy_model() -> None:
    choice = choose_vocab(_lm(head=16.0, blocks=4), _cluster(FAST), pp=4, microbatches=8, microbatch_size=1)
    assert choice.chosen.variant is VocabVariant.VOCAB_2  # one collective beats two at equal bytes
    assert choice.chosen.verdict.step_s < choice.without.verdict.step_s
    assert choice.gain > 0.15


def test_not_chosen_with_a_light_head_or_slow_links() -> None:
    light = choose_vocab(_lm(head=0.1, blocks=4), _cluster(FAST), pp=4, microbatches=8, microbatch_size=1)
    assert light.chosen.variant is None and light.gain == 0.0
    slowest = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e2)
    slow = choose_vocab(_lm(head=16.0, blocks=4), _cluster(slowest), pp=4, microbatches=8, microbatch_size=1)
    assert slow.chosen.variant is None
    assert all(o.verdict.step_s > slow.without.verdict.step_s for o in slow.options if o.variant)


def test_the_output_passes_couple_the_ranks() -> None:
    """Every rank runs output pass k together (`StageCost.sync_s`): rank 0 reaches pass k + 1 only after its
    backward of k, which waits for the gradient through every stage, so a heavy body makes the ranks wait for each
    other every microbatch. 2 ranks, 1F1B, 6 blocks (F 1, B 2 each), a head of 4 (F + B 12; 6 per rank and pass):
    the body split 3 | 3, pass k + 1 starts 6 (pass k) + 6 (the rest of B1) + 6 (B0) + 3 (F0 of k + 2) after pass
    k, 21 a microbatch; charged one rank after the other (as before), the passes hid in each other's waits."""
    choice = choose_vocab(_lm(head=4.0), _cluster(FAST, pp=2), pp=2, microbatches=8, microbatch_size=1)
    vocab = choice.options[2].verdict
    assert vocab.candidate.bounds == ((0, 4), (4, 8)) and choice.chosen.variant is None
    assert vocab.pipeline_s == pytest.approx(8 * 21, rel=0.01)
    assert [c.sync_s for c in vocab.costs] == pytest.approx([6.0, 6.0], rel=1e-5)


def test_refuses_one_rank_or_a_body_of_fewer_units_than_ranks() -> None:
    with pytest.raises(PlanError, match=r"needs `pp` >= 2 and an embedding, a body of `pp` units or more and a head "
                                        r"\(pp 1, 8 units\)$"):
        choose_vocab(_lm(head=4.0), _cluster(FAST, pp=1), pp=1, microbatches=2, microbatch_size=1)
    with pytest.raises(PlanError, match=r"\(pp 4, 5 units\)$"):
        choose_vocab(_lm(head=4.0, blocks=3), _cluster(FAST), pp=4, microbatches=2, microbatch_size=1)


def _holds_body(bounds: tuple[tuple[int, int], ...], n: int) -> bool:
    """Every stage holds a unit of the body (not only the embedding, unit 0, or the head, unit n - 1)."""
    return all(any(0 < u < n - 1 for u in range(i, j)) for i, j in bounds)


@pytest.mark.parametrize("pp,microbatches", [(2, 1), (2, 2), (3, 1), (4, 1), (4, 8)])
def test_every_stage_holds_some_of_the_body(pp: int, microbatches: int) -> None:
    """Regression: `autopp plan tests/models/tiedlm.py --pp 2 --vocab 2 --global-batch 4` gave stage 0 the
    embedding alone (units 0-0: free once its work moved to the passes; with one microbatch every split ties), and
    `autopp run` then failed: "splitting at 1 points gave 1 pieces, expected 2" (the body has nothing before its
    first block)."""
    a = _lm(head=4.0, blocks=pp + 1)
    options = choose_vocab(a, _cluster(FAST, pp=pp), pp, microbatches, 1, ScheduleName.GPIPE).options
    assert [o.variant for o in options] == [None, *VocabVariant]
    for option in options[1:]:
        assert _holds_body(option.verdict.candidate.bounds, a.n)


def test_planned_with_one_microbatch_every_stage_holds_some_of_the_body() -> None:
    """The same through make_plan (`vocab_verdicts`), pinned to one microbatch as the regression's plan was, the
    cut after the embedding the cheapest to send (half the others' bytes), so the empty first stage was the DP's
    strict optimum."""
    prof = _profile(1.0)
    edges = prof.edges.copy()
    edges.loc[edges.src == 0, "bytes"] //= 2
    link = Link(latency_s=1e-6, bandwidth_bytes_per_s=1e9)
    req = PlanRequest(cluster=_cluster(link, pp=2), global_batch=2, num_microbatches=1, pins=LayoutPins(dp=1, pp=2),
                      schedule=ScheduleName.GPIPE, vocab=(VocabVariant.VOCAB_2,))
    plan = make_plan(replace(prof, edges=edges), req)
    assert plan.vocab is VocabVariant.VOCAB_2 and plan.num_microbatches == 1
    assert _holds_body(tuple(s.units for s in plan.stages), 8)


def test_a_tied_head_counts_once() -> None:
    """Tied embedding and head (one tensor; the profile gives each unit a copy): the head's bytes once / p."""
    a = _lm(head=4.0)
    tied = vocab_passes(a, 4, FAST, VocabVariant.VOCAB_2, tied=True, microbatches=1)
    assert tied.static_bytes == 800 // 4 + 1000 + 1000
    assert vocab_passes(a, 4, FAST, VocabVariant.VOCAB_2, microbatches=1).static_bytes == tied.static_bytes + 800 // 4


def _profile(head_scale: float, facts: dict[str, object] | None = FACTS) -> Profile:
    """A synthetic 8-unit LM whose head does `head_scale` x its forward, backward and recompute work; its metadata
    records the vocabulary layers (`facts`) as the profiler does."""
    p = synthetic_profile(8, hidden=1024, seq=512)
    units = p.units.copy()
    last = units["unit"] == 7
    for col in ("forward_s", "backward_s", "backward_input_s", "backward_weight_s", "recompute_s"):
        units.loc[last, col] = units.loc[last, col] * head_scale
    extra = {} if facts is None else {"vocab": facts}
    return replace(p, units=units, meta=replace(p.meta, extra=extra))


def _request(vocab: tuple[VocabVariant | None, ...], **kw: object) -> PlanRequest:
    return PlanRequest(cluster=_cluster(FAST, pp=4), global_batch=8, pins=LayoutPins(dp=1), vocab=vocab, **kw)


def test_make_plan_chooses_it_where_it_simulates_faster() -> None:
    plan = make_plan(_profile(16.0), _request((None, *VocabVariant)))
    assert plan.vocab is VocabVariant.VOCAB_2
    plain = make_plan(_profile(16.0), _request((None,)))
    assert plain.vocab is None and plan.predicted.step_time_s < plain.predicted.step_time_s
    assert any("vocabulary parallelism vocab-2" in n and "without it predicts" in n for n in plan.notes)
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.vocab is VocabVariant.VOCAB_2
    assert simulate_plan(again).step_time_s == pytest.approx(plan.predicted.step_time_s - plan.predicted.optimizer_s
                                                             - plan.predicted.allreduce_s, rel=1e-9)


def test_make_plan_keeps_the_plain_split_with_a_light_head() -> None:
    plan = make_plan(_profile(1.0), _request((None, *VocabVariant)))
    assert plan.vocab is None and "vocab" not in plan.to_json()
    assert not any("vocabulary parallelism" in n for n in plan.notes)


def test_pinned_variant_is_planned_or_refused_in_one_line() -> None:
    assert make_plan(_profile(1.0), _request((VocabVariant.VOCAB_1,))).vocab is VocabVariant.VOCAB_1
    with pytest.raises(PlanError, match=r"^`vocab` vocab-2: the profile does not record the model's vocabulary "):
        make_plan(_profile(16.0, facts=None), _request((VocabVariant.VOCAB_2,)))
    with pytest.raises(PlanError, match=r"^`vocab` vocab-2: no embedding$"):
        make_plan(_profile(16.0, facts={"refused": "no embedding"}), _request((VocabVariant.VOCAB_2,)))
    auto = make_plan(_profile(16.0, facts={"refused": "no embedding"}), _request((None, *VocabVariant)))
    assert auto.vocab is None


def test_not_searched_beside_other_pinned_axes_and_refused_when_pinned() -> None:
    """A tester: `--pp 2 --tp 2 --dp 1` on 4 devices was refused ("pp(2) * dp(1) * tp(1) = 2 != devices (4)") with
    --vocab auto, the vocabulary search checking the pins on a tensor-parallel group's view. It runs with pp alone:
    not searched beside another pinned axis, and a pinned variant is refused saying so."""
    base = synthetic_profile(8, hidden=1024, seq=512, tp_degrees=(2,))
    profile = replace(base, meta=replace(base.meta, extra={"vocab": FACTS}))
    request = PlanRequest(cluster=_cluster(FAST, pp=4), global_batch=8, pins=LayoutPins(pp=2, dp=1, tp=2))
    plan = make_plan(profile, replace(request, vocab=(None, *VocabVariant)))
    assert plan.vocab is None and (plan.layout.pp, plan.layout.tp) == (2, 2)
    with pytest.raises(PlanError, match=r"^`vocab` vocab-2: vocabulary parallelism runs with pipeline parallelism "
                                        r"alone, and the request pins tp 2$"):
        make_plan(profile, replace(request, vocab=(VocabVariant.VOCAB_2,)))


def test_never_offered_for_a_trainer() -> None:
    plan = make_plan(_profile(16.0), _request((None, *VocabVariant), trainer="megatron"))
    assert plan.vocab is None
    with pytest.raises(LayoutError, match=r"`vocab` vocab-2 with `trainer` deepspeed: DeepSpeed's PipelineModule "):
        _request((VocabVariant.VOCAB_2,), trainer="deepspeed")


@pytest.mark.parametrize("schedule,pp,v,dp,runs", [
    (ScheduleName.ONE_F_ONE_B, 2, 1, 1, True), (ScheduleName.GPIPE, 4, 1, 1, True),
    (ScheduleName.INTERLEAVED_1F1B, 2, 2, 1, True), (ScheduleName.ZBV_ZERO_BUBBLE, 2, 2, 1, True),
    (ScheduleName.LOOPED_BFS, 2, 2, 1, False), (ScheduleName.DUAL_PIPE_V, 2, 2, 1, False),
    (ScheduleName.ONE_F_ONE_B, 2, 1, 2, False), (ScheduleName.GPIPE, 1, 1, 1, False),
])
def test_only_what_the_runner_runs_is_searched(schedule: ScheduleName, pp: int, v: int, dp: int, runs: bool) -> None:
    assert vocab_runs(Config(schedule, Layout(pp=pp, v=v, dp=dp), 4, 1)) is runs


def test_passes_go_where_the_runner_runs_them() -> None:
    """The input pass with the forward of each rank's first stage, the output pass with the backward of its last
    (its first backward of a microbatch), marked as the collective every rank runs at once only with one stage
    per rank (with several, the runner runs it when torch posts the gradient's receive, ahead of the action)."""
    p = vocab_passes(_lm(head=4.0), 2, FAST, VocabVariant.VOCAB_2, microbatches=8)
    base = StageCost(forward_s=1.0, backward_input_s=1.0, backward_weight_s=1.0, backward_s=2.0)
    one = with_vocab_passes([base] * 2, [0, 1], p)
    assert [c.sync_s for c in one] == [p.output_s] * 2 and all(c.forward_s == 1.0 + p.input_s for c in one)
    assert all(c.backward_s == pytest.approx(2.0 + p.output_s) for c in one)
    two = with_vocab_passes([base] * 4, [0, 1, 1, 0], p)  # ZBV's V: rank 0 holds stages 0 and 3
    assert [c.forward_s for c in two] == [1.0 + p.input_s, 1.0 + p.input_s, 1.0, 1.0]
    assert [c.backward_input_s for c in two] == [1.0, 1.0, 1.0 + p.output_s, 1.0 + p.output_s]
    assert [c.sync_s for c in two] == [0.0] * 4


def test_the_passes_are_costed_on_the_link_across_nodes() -> None:
    """pp 4 on two nodes of two devices: the passes' collectives span both nodes, so both searches (`choose_vocab`
    and make_plan's `vocab_verdicts`) charge them as on a flat cluster of the inter-node link, not as on the link
    between ranks 0 and 1 (inside a node)."""
    inter = Link(latency_s=1e-5, bandwidth_bytes_per_s=1e8)
    two_nodes = hierarchical_cluster(Nodes(count=2, devices_per_node=2, intra=FAST, inter=inter), 2**40)
    a = _lm(head=4.0)
    want = vocab_passes(a, 4, inter, VocabVariant.VOCAB_2, microbatches=8).output_s
    assert want > vocab_passes(a, 4, FAST, VocabVariant.VOCAB_2, microbatches=8).output_s
    options = choose_vocab(a, two_nodes, pp=4, microbatches=8, microbatch_size=1).options
    assert options[2].variant is VocabVariant.VOCAB_2
    assert [c.sync_s for c in options[2].verdict.costs] == pytest.approx([want] * 4, rel=1e-9)
    req = PlanRequest(cluster=two_nodes, global_batch=8, pins=LayoutPins(dp=1, pp=4), vocab=(VocabVariant.VOCAB_2,))
    flat = replace(req, cluster=_cluster(inter, pp=4))
    planned, on_inter = (make_plan(_profile(16.0), r) for r in (req, flat))
    assert planned.vocab is on_inter.vocab is VocabVariant.VOCAB_2
    assert [s.sync_s for s in planned.stages] == pytest.approx([s.sync_s for s in on_inter.stages], rel=1e-9)

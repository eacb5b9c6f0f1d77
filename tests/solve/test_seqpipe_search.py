"""Sequence pipelining in the search (autopp.solve.search.seqpipe): Seq1F1B is chosen where the simulator says it
wins, against the brute force of 1F1B over every split and the direct simulation of every chunk count, and the named
schedules are kept where it does not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.cluster import Cluster
from autopp.data.layout import Layout, LayoutPins
from autopp.data.profile import Profile
from autopp.data.synthetic_profile import synthetic_profile
from autopp.errors import InfeasibleError, ProfileError
from autopp.predict import simulate_plan
from autopp.schedule import Activation, ScheduleName
from autopp.solve import PlanRequest, make_plan
from autopp.solve.partition.brute import brute_force
from autopp.solve.search.request import RecomputeMode
from autopp.solve.search.seqpipe import CHUNK_COUNTS, CHUNK_MULTIPLE, seq_chunkings, seq_offered, seq_verdicts
from autopp.solve.search.views import Views

UNITS = 10


def _profile(hidden: int, seq: int) -> Profile:
    """A synthetic GPT-like profile as if made from an HF causal-LM config (its attention shape recorded)."""
    p = synthetic_profile(UNITS, hidden=hidden, seq=seq)
    hf = {"seq_len": seq, "task": "causal-lm", "model_type": "llama",
          "attention": {"heads": 8, "kv_heads": 2, "head_dim": hidden // 8, "causal": True}}
    return replace(p, meta=replace(p.meta, extra={"hf_config": hf}, dtype="float32"))


def _request(memory: int, **kw: object) -> PlanRequest:
    return PlanRequest(cluster=Cluster(num_devices=4, memory_bytes=memory), global_batch=4, schedule=None,
                       pins=LayoutPins(pp=4), **kw)  # type: ignore[arg-type]


def _brute_1f1b(p: Profile, req: PlanRequest, m: int = 4) -> float | None:
    """The simulator's best 1F1B step over every split on the same 4 ranks (keep), or None when none fits."""
    best = brute_force(Views(p, req).arrays(4 // m), req.cluster, ScheduleName.ONE_F_ONE_B, layout=Layout(pp=4), m=m,
                       microbatch_size=4 // m, activations=(Activation.KEEP,)).best
    return None if best is None else best.step_s


def test_long_sequences_choose_chunks_faster_and_smaller_than_1f1b() -> None:
    """8K tokens of a 1024-wide model: each chunk's compute dwarfs a message's overhead, so the search picks Seq1F1B;
    its step beats the best 1F1B split (brute force) and its peak is below 1F1B's, as Seq1F1B (NAACL 2025) reports."""
    p, req = _profile(1024, 8192), _request(10**12)
    plan = make_plan(p, req)
    assert plan.schedule is ScheduleName.SEQ_1F1B and plan.seq_chunks is not None
    assert len(plan.seq_chunks.lengths) in CHUNK_COUNTS and sum(plan.seq_chunks.lengths) == 8192
    assert "sequence pipelining chosen" in " ".join(plan.notes)
    one_f_one_b = _brute_1f1b(p, req)
    assert one_f_one_b is not None and plan.predicted.step_time_s < one_f_one_b
    baseline = make_plan(p, replace(req, schedule=ScheduleName.ONE_F_ONE_B))
    assert max(plan.predicted.peak_memory_bytes) < 0.8 * max(baseline.predicted.peak_memory_bytes)
    # the plan re-simulates as predicted (`autopp show`), and no other chunk count of its split is faster
    sim = simulate_plan(plan)
    assert sim.step_time_s + plan.predicted.optimizer_s == pytest.approx(plan.predicted.step_time_s)
    views = Views(p, req)
    others = seq_verdicts(p, views, views.degrees(), 1, lambda c, b: None, float("inf"))
    split = tuple(s.units for s in plan.stages)
    same = [v for v in others if v.candidate.bounds == split and v.candidate.microbatches == plan.num_microbatches]
    assert same and min(v.step_s for v in same) == pytest.approx(plan.predicted.step_time_s)


def test_short_sequences_keep_the_named_schedules() -> None:
    """4K tokens of a 64-wide model: a chunk's compute is microseconds against a message's 70 us overhead, so every
    Seq1F1B configuration simulates slower than the plan the named schedules give, which is kept."""
    p, req = _profile(64, 4096), _request(10**12)
    plan = make_plan(p, req)
    assert plan.schedule is not ScheduleName.SEQ_1F1B and plan.seq_chunks is None
    views = Views(p, req)
    chunked = seq_verdicts(p, views, views.degrees(), 1, lambda c, b: None, float("inf"))
    assert chunked and all(v.step_s > plan.predicted.step_time_s for v in chunked)


def test_a_memory_limit_1f1b_cannot_meet_chooses_chunks() -> None:
    """Keeping activations, no 1F1B split fits 48 MiB (brute force; the search's own least is 50.4 MiB) while
    Seq1F1B's units hold less: it is chosen where 1F1B was, without a limit, the faster."""
    p, limit = _profile(64, 4096), 48 * 2**20
    req = _request(limit, recompute=RecomputeMode.NONE)
    assert _brute_1f1b(p, req) is None and _brute_1f1b(p, _request(10**12)) is not None
    plan = make_plan(p, req)
    assert plan.schedule is ScheduleName.SEQ_1F1B and max(plan.predicted.peak_memory_bytes) <= limit
    assert plan.predicted.fits and "nothing else fits" in " ".join(plan.notes)
    pinned = make_plan(p, replace(req, schedule=ScheduleName.SEQ_1F1B))  # a tester's: the same note, 1F1B unsearched
    assert pinned.schedule is ScheduleName.SEQ_1F1B and not any("chosen" in n for n in pinned.notes)


def test_offered_only_for_causal_lms_searched_or_pinned() -> None:
    p, req = _profile(64, 4096), _request(10**12)
    assert seq_offered(p, req) and seq_offered(p, replace(req, schedule=ScheduleName.SEQ_1F1B))
    assert not seq_offered(p, replace(req, schedule=ScheduleName.ONE_F_ONE_B))
    assert not seq_offered(p, replace(req, trainer="torchtitan"))
    assert not seq_offered(p, replace(req, recompute=RecomputeMode.ALL))
    plain = synthetic_profile(UNITS)  # a model file's profile: no attention shape
    assert not seq_offered(plain, req)
    with pytest.raises(ProfileError, match=r"`schedule` Seq1F1B splits each sequence of a causal LM"):
        seq_offered(plain, replace(req, schedule=ScheduleName.SEQ_1F1B))
    assert [len(c.lengths) for c in seq_chunkings(p)] == list(CHUNK_COUNTS)
    assert all(n % CHUNK_MULTIPLE == 0 for c in seq_chunkings(p) for n in c.lengths)
    short = _profile(64, 3 * CHUNK_MULTIPLE)  # 384 tokens: 2 chunks only; 200 tokens: none
    assert [len(c.lengths) for c in seq_chunkings(short)] == [2] and not seq_offered(_profile(64, 200), req)
    with pytest.raises(ProfileError, match=r"`schedule` Seq1F1B cuts sequences into 2 or more chunks on multiples "
                                           r"of 128 tokens, and the profile's are 200"):
        seq_offered(_profile(64, 200), replace(req, schedule=ScheduleName.SEQ_1F1B))


def test_pinned_chunks_that_fit_nowhere_say_so() -> None:
    p = _profile(64, 4096)
    with pytest.raises(InfeasibleError, match=r"`schedule` Seq1F1B: in none of 2, 4, 8 chunks does a configuration "
                                              r"of pipeline and data parallelism \(`tp`, `cp`, `ep` 1, `zero` 0: "
                                              r"what the runner runs it with\) fit"):
        make_plan(p, replace(_request(10**6, recompute=RecomputeMode.NONE), schedule=ScheduleName.SEQ_1F1B))


def test_only_layouts_the_runner_runs_are_chunked() -> None:
    """The runner runs Seq1F1B with pipeline and data parallelism and whole replicas only (run.seq_chunks), so the
    search offers it nowhere else: with ZeRO searched beside dp 2 every Seq1F1B verdict keeps ZeRO 0, and pinned to
    ZeRO 1 it is not offered (the search keeps the named schedules)."""
    from autopp.data.zero import ZERO
    from autopp.solve.search.runnable import parallel_refusal
    p = _profile(1024, 8192)
    req = replace(_request(10**12), pins=LayoutPins(pp=2, dp=2, zero=None))
    views = Views(p, req)
    found = seq_verdicts(p, views, views.degrees(), 1,
                         lambda c, b: parallel_refusal(p.meta.tied_parameters, c.layout, b), float("inf"))
    assert found and all(v.candidate.layout.zero.replicated and v.candidate.layout.dp == 2 for v in found)
    pinned = replace(req, pins=LayoutPins(pp=2, dp=2, zero=ZERO[1]))
    assert make_plan(p, pinned).schedule is not ScheduleName.SEQ_1F1B
    with pytest.raises(InfeasibleError, match=r"what the runner runs it with"):
        make_plan(p, replace(pinned, schedule=ScheduleName.SEQ_1F1B))

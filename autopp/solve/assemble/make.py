"""make_plan: the search's best verdict, the device order CP-SAT chooses on a heterogeneous cluster, an optional
synthesized order, and the plan with its baselines (or an error saying what would be feasible)."""

from __future__ import annotations

import logging
from dataclasses import replace

from ...costmodel import ProfileTable, sp_offered
from ...schedule import Activation, policy
from ...errors import AutoppError, InfeasibleError, LayoutError, ProfileError
from ...data.plan import Plan
from ...data.precision import plan_recipe
from ...data.precision import recorded_kernels
from ...data.trainers import TRAINER_RULES, frees_outputs, kernels_words, optimizer_words
from ...data.profile import Profile
from ...progress import PROGRESS_LOG
from ...sizes import format_time
from .from_verdict import plan_from_verdict
from .reorder import synthesized
from ..search.band import Band, band
from ..search.explain import explain_infeasible
from ..search.judge import Verdict
from ..search.prove import Proof
from ..cpsat.placement import place_devices
from ..search.request import Config, PlanRequest, RecomputeMode, configs, with_sp
from ..search.runnable import PARALLEL_KEY, check_zero_has_replicas, split_backward_refusal, tied_across_note
from ..search.search import inflight, links_hold_messages, search
from ..search.seqpipe import with_seq
from ..search.views import Views
from ..search.vocab import vocab_verdicts

__all__ = ["GPU_PROGRESS_NOTE", "TIE_NOTE", "SAME_STEP_NOTE", "make_plan"]

log = logging.getLogger(__name__)

TIE_NOTE = ("configurations predicting inside the step band are ties, kept by fewer microbatches, then less peak "
            "memory, then the faster step (autopp.solve.search.band; docs/planner.md)")
#: TIE_NOTE's rule where the profile gives no band (no spreads): only configurations predicting the very same step tie.
SAME_STEP_NOTE = ("configurations predicting the same step are ties (the profile gives no step band), kept by fewer "
                  "microbatches, then less peak memory (autopp.solve.search.band; docs/planner.md)")

GPU_PROGRESS_NOTE = ("the links hold each message up to progress_s while its sender computes, as gloo does on a CPU "
                     "host (the default link); NCCL between GPUs does not: plan with `progress_s` 0 on every link "
                     "or a links file measured on the GPUs")


def _placement_config(req: PlanRequest, n: int, best: Verdict | None) -> Config | None:
    """The one-stage-per-rank configuration CP-SAT orders the devices for: the winner's, else the one with the
    most microbatches (the least memory per stage)."""
    if best is not None:
        c = best.candidate
        return Config.of(c) if c.layout.v == 1 else None
    return max((c for c in configs(req, n) if c.layout.v == 1), key=lambda c: c.m, default=None)


def _place(profile: Profile, req: PlanRequest, table: ProfileTable,
           best: Verdict | None) -> tuple[PlanRequest, Verdict | None, str | None]:
    """For a heterogeneous cluster, let CP-SAT choose which device runs which pipeline position (placement.py),
    re-run the search on that order (the DP is exact for a fixed order) and keep the order the simulator prefers."""
    c = _placement_config(req, profile.num_units, best)
    if c is None:  # said: the docs promise a device-order note on every plan for such a cluster
        return req, best, None if best is None else (
            "device order: the cluster file's, kept (CP-SAT places devices for one stage per rank, and the plan "
            f"runs {best.candidate.layout.v} per rank)")
    a = replace(table.arrays(c.b), frees_outputs=frees_outputs(req.trainer, req.frees_outputs))  # as `Views` does
    activation = max(best.candidate.activations, key=lambda x: policy(x).saving) if best is not None \
        else req.ladder(a)[0]  # the winner's policy saving most, else the first the request allows
    try:
        placed = place_devices(a, req.cluster, c.m, inflight(c.schedule, c.layout.pp, c.m, 1),
                               activation, req.placement_time_limit_s)
    except InfeasibleError as exc:
        return req, best, f"device order: the cluster file's, kept (CP-SAT's placement found none: {exc})"
    how = f"CP-SAT {placed.status}, gap {placed.gap:.1%}, limit {req.placement_time_limit_s:g} s"
    if list(placed.order) == list(range(req.cluster.num_devices)):
        return req, best, f"device order: the cluster file's order is CP-SAT's choice ({how})"
    trial = replace(req, cluster=req.cluster.reordered(placed.order))
    found = search(profile, trial, table)[0]
    if found is None or best is not None and found.key >= best.key:
        return req, best, f"device order: the cluster file's order kept; CP-SAT's {list(placed.order)} ({how}) " \
                          f"did not simulate faster"
    order = ", ".join(f"rank {r} -> device {d}" for r, d in enumerate(placed.order))
    return trial, found, f"device order chosen by CP-SAT ({how}): pipeline rank r runs on device order[r] of the " \
                         f"cluster file: {order}"


def _optimizer_note(profile: Profile, request: PlanRequest) -> list[str]:
    """For a `trainer`, where the profile counts another optimizer's state than Adam(W)'s: what the trainer trains
    with and how to plan for Adam(W), as its export says it (a tester's plan "fit" at 70.2 of 71.5 GiB counting
    SGD's, which Megatron's Adam would exceed)."""
    if request.trainer is None or profile.meta.optimizer in ("adam", "adamw"):
        return []
    return [f"optimizer: {optimizer_words(request.trainer, profile.meta.optimizer)}"]


def _kernels_note(profile: Profile, request: PlanRequest) -> list[str]:
    """For a `trainer`, where it runs other elementwise kernels than the profile counted (`kernels_words`), as its
    export says it (a reviewer: `--for megatron` from an eager profile said nothing of Megatron's fused kernels)."""
    note = kernels_words(request.trainer, recorded_kernels(profile.meta.extra)) if request.trainer else None
    return [f"kernels: {note}"] if note else []


def _tp_note(profile: Profile, request: PlanRequest) -> list[str]:
    """With `tp` searched and a profile without tensor-parallel rows: only tp 1 was searched, and why."""
    if request.pins.tp is not None or profile.meta.tp_degrees:
        return []
    why = profile.meta.extra.get("tp_skipped")
    return [f"tensor parallelism: only tp 1 was searched, as the profile has no tensor-parallel rows (tp.csv)"
            f"{': ' + why if why else ''}; profile with `tp_degrees` T, T a degree the model's TP plan allows"]


def make_plan(profile: Profile, request: PlanRequest) -> Plan:
    """The fastest simulated plan for `request` (ties: least peak memory), with baselines beside it. On a
    heterogeneous cluster CP-SAT also chooses the device order (the plan's notes say which and how sure). For a
    `trainer`, which applies one activation policy to every stage, each allowed policy is planned for every stage
    and the fastest kept (`_uniform`). Sequence parallelism searched is decided first (`with_sp`)."""
    _check_experts(profile, request)
    check_zero_has_replicas(request.pins, request.cluster.num_devices)  # the user's request, not its group views
    _check_recipe(profile, request)
    _check_trainer(request, profile.meta.dtype)
    request = with_sp(request, sp_offered(profile))
    if request.trainer is not None and (len(request.allowed()) > 1 or request.assumed_overlap.ep_a2a):
        return _uniform(profile, request)
    return _make_plan(profile, request)


def _check_experts(profile: Profile, request: PlanRequest) -> None:
    """A pinned ep must divide the routed experts per layer (searched ones do, `configs`): each rank holds E / ep of
    them, and Megatron-Core, torchtitan and the runner refuse any other ep. A dense profile (no stacked experts
    recorded) is refused a pinned ep > 1, which would shard nothing."""
    ep, experts = request.pins.ep, int((profile.meta.extra.get("moe") or {}).get("num_experts") or 1)
    if ep not in (None, 1) and not int(profile.units.moe_layers.sum()):
        raise ProfileError(f"`ep` {ep}: the profile records no stacked experts (a dense model, or one profiled before "
                           "autopp recorded them), so expert parallelism has nothing to shard: plan with `ep` 1")
    if ep not in (None, 1) and experts > 1 and experts % ep:
        raise LayoutError(f"`ep` {ep} does not divide the model's {experts} routed experts per layer (each ep rank "
                          f"holds experts / ep of them): give a divisor of {experts}")
    devices, etp = request.cluster.num_devices, request.pins.etp or 1
    if ep not in (None, 1) and request.pins.dp is None and devices % (ep * etp):  # dp is searched among ep's multiples
        fits = [e for e in range(2, devices + 1) if devices % (e * etp) == 0 and experts % e == 0]
        with_etp = f" x `etp` {etp}" if etp > 1 else ""
        raise LayoutError(f"`ep` {ep}{with_etp} needs a `dp` it divides, and dp divides the {devices} devices, which "
                          f"{ep * etp} does not: " + (f"give an `ep` of {fits}" if fits else
                                                      f"no `ep` above 1{with_etp} divides both the devices and the "
                                                      f"model's {experts} experts per layer: plan for other devices"))


def _check_recipe(profile: Profile, request: PlanRequest) -> None:
    """For a `trainer`, refuse before any search a profile counted in a recipe that trainer cannot train (bf16-pure
    for Megatron-LM and DeepSpeed, fp8 for DeepSpeed: autopp.data.precision), whose plan its export would refuse."""
    made = plan_recipe(profile.meta.extra.get("precision"), profile.meta.dtype)
    why = made.refusal(request.trainer) if made is not None and request.trainer is not None else None
    if why is not None:
        raise ProfileError(f"`trainer` {request.trainer}: the profile's precision {made}: {why}")


def _check_trainer(request: PlanRequest, dtype: str | None) -> None:
    """For a `trainer`, refuse before any search a pinned ZeRO stage, degree or switch it cannot run, which the search
    would otherwise work around (at dp 1 a pinned ZeRO stage no longer matters), and activation policies of which it
    applies none (`recompute` all: one whole-stage checkpoint), in the words of its export (autopp.data.trainers)."""
    if request.trainer is None:
        return
    rules = TRAINER_RULES[request.trainer]
    asked = f"`recompute` {request.recompute.value}" if request.activations is None else "`activations`"
    why = rules.pins_refusal(request.pins, request.cluster.num_devices) or rules.policies_refusal(request.allowed(),
                                                                                                  asked) \
        or rules.overlap_refusal(request.assumed_overlap, dtype)
    if why is not None:
        raise LayoutError(why)


def _uniform(profile: Profile, request: PlanRequest) -> Plan:
    """The fastest of the plans that give every stage one of the request's policies that its trainer applies and the
    profile has figures for; the error of the one that saves the most memory when none fits. A policy the trainer
    refuses beside the request's `ep_a2a` overlap (`Trainer.beside_ep_a2a`: Megatron-Core's full recomputation) is
    planned without that overlap, as the trainer would have to run it, and the plan says so."""
    trainer = str(request.trainer)
    plans: dict[Activation, Plan] = {}
    error: AutoppError | None = None
    rules, overlap = TRAINER_RULES[trainer], request.assumed_overlap
    beside = rules.beside_ep_a2a if overlap.ep_a2a else ()
    tried = [a for a in request.allowed() if policy(a).refusal(trainer) is None]
    for a in tried:
        alone = replace(request, recompute=RecomputeMode.NONE, activations=(a,))
        try:
            plans[a] = _make_plan(profile, replace(alone, overlap=replace(overlap, ep_a2a=False)) if a in beside
                                  else alone)
        except (InfeasibleError, ProfileError) as exc:  # ProfileError: no figures for the policy in this profile
            error = exc if isinstance(exc, InfeasibleError) or error is None else error
    if not plans:
        raise error or InfeasibleError(f"`trainer` {trainer} applies none of the policies asked for")
    best = min(plans.values(), key=lambda p: (p.predicted.step_time_s, max(p.predicted.peak_memory_bytes)))
    without = [a.value for a in tried if a in beside]
    note = (f"`trainer` {trainer} applies one activation policy to every stage: each of "
            f"{', '.join(a.value for a in tried)} was planned for all stages "
            f"({', '.join(a.value for a in plans)} fit), the fastest kept" + (
                f"; {', '.join(without)} without the ep_a2a overlap, as {rules.title} refuses full recomputation "
                "beside its EP A2A overlap" if without else ""))
    return replace(best, notes=(*best.notes, note))


def _make_plan(profile: Profile, request: PlanRequest) -> Plan:
    table = ProfileTable(profile)
    views = Views(profile, request, table)
    excluded: dict[str, str] = {}
    tied: list[Verdict] = []
    proofs: list[Proof] = []
    best, n_cfg, n_sim = search(profile, request, table, excluded, views, tied, proofs)
    logging.getLogger(PROGRESS_LOG).info("the plan: its sequence and vocabulary variants, baselines and figures")
    note = None
    if not request.cluster.homogeneous and not request.cluster.order:
        request, best, note = _place(profile, request, table, best)
        views = Views(profile, request, table)  # on the order CP-SAT chose, when it was kept
    if best is None and request.schedule is not None and request.schedule.value in excluded:
        raise InfeasibleError(excluded[request.schedule.value])
    pins = request.pins
    sharded = pins.zero is not None and not pins.zero.replicated
    if best is None and PARALLEL_KEY in excluded and (pins.tp not in (None, 1) or sharded):
        raise InfeasibleError(excluded[PARALLEL_KEY])
    best, seq_note = with_seq(profile, views, best)
    best, vocab_note = _with_vocab(profile, request, views, best)
    if best is None:
        raise explain_infeasible(profile, request, n_cfg)
    c = best.candidate
    a = views.arrays(c.microbatch_size, c.layout)
    view = views.request(c.layout)
    unsynthesizable = split_backward_refusal(profile.meta.live_values, best.candidate.bounds, "a synthesized order")
    custom = synthesized(a, view.cluster, best, request.synth_time_limit_s) \
        if request.synthesize and unsynthesizable is None and best.passes is None and c.seq is None else None
    notes = [note] if note else []
    notes += [vocab_note] if vocab_note else []
    notes += [seq_note] if seq_note and best.candidate.seq is not None else []
    chosen = best.candidate.schedule.value  # only some of its splits were left out: not worth a note
    notes += [why for name, why in excluded.items() if name != chosen]
    notes += [unsynthesizable] if request.synthesize and unsynthesizable else []
    notes += _tp_note(profile, request) + _optimizer_note(profile, request) + _kernels_note(profile, request)
    notes += [p.words() for p in proofs if not p.exact]
    if profile.meta.device.startswith("cuda") and links_hold_messages(request.cluster):
        notes.append(GPU_PROGRESS_NOTE)
    b = band(profile, request, best) if best.passes is None else None  # a vocabulary-parallel plan has none
    if request.ties and tied and b is not None:
        notes.append(TIE_NOTE if b.width_s > 0 else SAME_STEP_NOTE)
    pinned_vocab = best.passes is not None and None not in request.vocab  # no plain baseline replaces it
    plan = plan_from_verdict(profile, view, best, a, custom, extra=tuple(notes), keep_split=pinned_vocab,
                             whole=views.whole(c.microbatch_size))
    if plan.vocab is None and vocab_note:  # a plain baseline split simulated faster and replaced it
        plan = replace(plan, notes=tuple(n for n in plan.notes if n != vocab_note))
    tie = tied_across_note(profile.meta.tied_parameters, plan.layout, tuple(s.units for s in plan.stages)) \
        if request.tied_across_stages else None
    plan = replace(plan, notes=plan.notes + (tie,)) if tie else plan
    return plan if b is None else _banded(plan, b, best.step_s, tied)  # the band simulates plain configurations


def _banded(plan: Plan, b: Band, named_s: float, tied: list[Verdict]) -> Plan:
    """`plan` with its step's band (band.py; a synthesized order's is the named schedule's `named_s` band, scaled to
    its step) and the configurations tied with it, in words."""
    scale = plan.predicted.step_time_s / named_s if named_s > 0 else 1.0
    words = tuple(f"{c.schedule.value} {c.layout.describe()}" + (f" ZeRO {c.layout.zero.stage}" if c.layout.sync > 1
                                                                 else "")
                  + f" v={c.layout.v} m={c.microbatches}x{c.microbatch_size}"
                  + ("" if len(set(c.activations)) > 1 or c.activations[0] is Activation.KEEP else
                     f" {c.activations[0].value}") + f": {format_time(v.step_s)}"
                  for v in tied for c in (v.candidate,))
    return replace(plan, step_band_s=(b.low_s * scale, b.high_s * scale), tied=words)


def _with_vocab(profile: Profile, request: PlanRequest, views: Views,
                best: Verdict | None) -> tuple[Verdict | None, str | None]:
    """The plain search's `best`, or the fastest fitting verdict of vocabulary parallelism when it is faster (ties:
    the plain split) or pinned (`PlanRequest.vocab`), with a note comparing the two."""
    found = vocab_verdicts(profile, request, views)
    if not found:
        return best, None
    chosen = min(found, key=lambda v: v.key)
    if None in request.vocab and best is not None and chosen.key >= best.key:
        log.info("vocabulary parallelism: best %.6g s, not faster than the plain split's %.6g s", chosen.step_s,
                 best.step_s)
        return best, None
    assert chosen.passes is not None
    c = chosen.candidate
    than = "no plain split fits" if best is None else \
        f"the best plan without it predicts {best.step_s:.4g} s ({best.step_s / chosen.step_s - 1:+.1%} slower)"
    return chosen, (f"vocabulary parallelism {chosen.passes.variant.value}: the embedding and the head with its "
                    f"loss split along the vocabulary over the {c.layout.pp} pipeline ranks, the stages holding the "
                    f"body (docs/vocabulary-parallelism.md); {than}")

"""From the winning verdict to a Plan: stages, simulated predictions, and baselines judged the same way."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import replace

from ...costmodel import (UnitArrays, attention_shape, comm_times, gradient_allreduce_time, ideal_step_time,
                          progress_delays, sp_offered, stage_costs, stage_speeds)
from ...costmodel.alltoall import routing_of, routing_note
from ...costmodel.breakdown import time_breakdown
from ...data.breakdown import TimeBreakdown
from ...data.overlap import NO_OVERLAP
from ...data.plan import Plan, Prediction, StagePlan
from ...data.precision import recorded_kernels
from ...data.profile import Profile
from ...data.runner_rules import run_refusal
from ...data.profile_tp import SP_TIME_COLUMNS
from ...data.catalog import planned_device
from ...data.cluster import Cluster
from ...cores import MESH_ON_CPU
from ...data.layout import Layout, uses_mesh
from ...schedule import (COMPUTE_KINDS, Action, Activation, Pairing, ScheduleName, StageCost, describe, pairing,
                         policy)
from ..partition.baselines import baseline_bounds
from .profile_notes import profile_notes
from ..search.judge import Candidate, Verdict, judge, named_order
from ..partition.refine import recompute_choices
from ..search.request import PlanRequest
from ..search.runnable import schedule_refusal

if TYPE_CHECKING:
    from .reorder import CustomOrder

__all__ = ["plan_from_verdict", "prediction", "judge_recompute", "judge_baselines"]

SPLIT_NOTE = "the profile has no input/weight backward split: assumed I = W = B / 2"


def prediction(v: Verdict, ideal: float) -> Prediction:
    return Prediction(step_time_s=v.step_s, peak_memory_bytes=v.peak_memory, bubble_fraction=v.bubble,
                      stage_units=v.candidate.bounds, allreduce_s=v.allreduce_s, optimizer_s=v.optimizer_s,
                      efficiency=ideal / v.step_s if v.step_s > 0 else 1.0, fits=v.fits)


def judge_recompute(a: UnitArrays, cluster: Cluster, c: Candidate, ladder: tuple[Activation, ...],
                    fixed: tuple[Activation, ...] | None = None) -> Verdict:
    """`c`'s split judged with its own activation policies from `ladder` (`refine.recompute_choices`: its one
    policy, or the first of the minimal per-rank assignments that fit: one simulation, which matters at scale) or
    the pinned ones `fixed`; when none fits, the pinned or the ladder's first, judged all the same, so the verdict
    says it does not fit."""
    order = named_order(c.schedule, c.layout.pp, c.microbatches, c.layout.v)
    actions = {r: [x for x in order[r] if x is not None and x.kind in COMPUTE_KINDS] for r in sorted(order)}
    # memory does not depend on speed; the policies' added times are compared per stage (`recompute_choices`)
    costs = stage_costs(a, c.bounds, [1.0] * len(c.bounds), host_bandwidth=cluster.host_bandwidth)
    choices = recompute_choices(costs, c.owner, actions, lambda r: cluster.device(r).memory_bytes, ladder, fixed,
                                c.mirror is not None)
    chosen = choices[0] if choices else fixed or (ladder[0],) * len(c.bounds)
    return judge(a, cluster, replace(c, activations=chosen))


def judge_baselines(a: UnitArrays, request: PlanRequest, best: Verdict) -> dict[str, Verdict]:
    """The baseline splits with `best`'s configuration, each with its own activation policies under the request's
    policies (`judge_recompute`), judged by the simulator; a baseline that does not fit is kept (its verdict says
    so)."""
    fixed = request.pinned_activations(len(best.candidate.bounds))
    ladder = (Activation.KEEP,) if best.candidate.seq is not None else request.ladder(a)  # seqpipe: keep only
    return {name: judge_recompute(a, request.cluster, replace(best.candidate, bounds=bounds), ladder, fixed)
            for name, bounds in baseline_bounds(a, len(best.candidate.bounds)).items()}


def _runs(profile: Profile, v: Verdict) -> bool:
    """Whether the runner runs `v`'s schedule on its split for this model (split I/W backward: runnable.py)."""
    c = v.candidate
    return schedule_refusal(profile.meta.live_values, c.schedule, c.bounds) is None


def _device_order(request: PlanRequest, num_ranks: int) -> tuple[int, ...]:
    """The cluster's device order (CP-SAT's choice on a heterogeneous cluster) when it names one device per rank."""
    order = request.cluster.order
    return tuple(order) if len(order) == num_ranks and list(order) != list(range(num_ranks)) else ()


def _node_notes(cluster: Cluster, c: Candidate) -> list[str]:
    """On a cluster of nodes, where the configuration's hops and all-reduces run (none on a flat cluster)."""
    nodes = cluster.nodes
    if nodes is None:
        return []
    layout = c.layout
    placed = cluster.placed(layout)
    owner = c.owner
    pairs = dict.fromkeys((owner[k], owner[k + 1]) for k in range(len(owner) - 1) if owner[k] != owner[k + 1])
    hops = [(f"{a}-{b}", placed.hop_level(a, b)) for a, b in pairs if a < b or (b, a) not in pairs]
    cross = ", ".join(h for h, level in hops if level == 1) or "none"
    if nodes.regions > 1:
        cross += f"; across regions: {', '.join(h for h, level in hops if level == 2) or 'none'}"
    group = cluster.dp_group(0, layout.dp // layout.dp_replicate)  # HSDP: ZeRO's collectives in a shard group
    spans = sum(len(region) for region in group)
    reduce = "none" if layout.sync == 1 else "a ring inside a node" if spans == 1 else \
        f"hierarchical across {spans} nodes" + (f" in {len(group)} regions" if len(group) > 1 else "")
    if layout.dp_replicate > 1:
        reduce += f", then each shard all-reduced across the {layout.dp_replicate} HSDP replicas"
    regions = f" in {nodes.regions} regions" if nodes.regions > 1 else ""
    tp = layout.group
    ranks = "on device r x dp + j" if tp == 1 else f"on the {tp} devices from (r x dp + j) x {tp}"
    kind = nodes.device or "devices"
    if tp == 1:
        where = f"{nodes.count} nodes{regions} x {nodes.devices_per_node} {kind}"
    elif nodes.devices_per_node == 1 and nodes.intra == nodes.inter:  # groups spanning nodes (Cluster.tp_groups)
        where = f"{nodes.count} groups of {tp} {kind}{regions}, each spanning whole nodes"
    else:
        per = nodes.devices_per_node
        where = f"{nodes.count} nodes{regions} x {per} group{'s' if per != 1 else ''} of {tp} {kind}"
    sync = "gradient all-reduce" if layout.zero.replicated else f"{layout.zero} collectives"
    return [f"cluster: {where}, pipeline rank r of replica j {ranks}; pipeline hops across nodes: {cross}; "
            f"{sync}: {reduce} (docs/cluster-format.md)"]


def _parallel_notes(profile: Profile, c: Candidate, cluster: Cluster) -> list[str]:
    """What the tensor-, context- and expert-parallel degrees and the ZeRO stage mean for this plan on `cluster` (the
    request's devices: the links the ep group's all-to-alls cross); none for tp 1, cp 1, ep 1 and ZeRO 0."""
    out = []
    tp, zero = c.layout.tp, c.layout.zero
    if tp > 1:
        out.append(f"tensor parallelism {tp}: each pipeline rank is {tp} processes sharding its modules by the "
                   f"profile's plan ({profile.meta.tp_plan_source}); stage times include its collectives "
                   f"(docs/parallelism.md)")
    if c.layout.sp:
        out.append(f"sequence parallelism (tp {tp} + SP): the norms on 1/{tp} of the sequence, each all-reduce a "
                   "reduce-scatter + all-gather (the same time), activations less their inputs' (tp - 1)/tp "
                   "(docs/parallelism.md#sequence-parallelism)")
        if recorded_kernels(profile.meta.extra) == "fused":
            out.append("with fused kernels each norm's output, which the column-parallel projections read, is "
                       "recomputed from the norm's sharded input, as Megatron-LM's linears do (they save the input "
                       "sharded and gather it again in the backward); torchtitan's and autopp run's DTensor linears "
                       "keep the gathered input, the norm's full output per norm on every rank, more memory than "
                       "counted (docs/analytic.md#fused-elementwise-kernels)")
        if profile.tp_units is not None and not all(col in profile.tp_units.columns for col in SP_TIME_COLUMNS):
            out.append("SP's compute timed as the plain tp rows' (the norms and residual adds whole on every rank: "
                       "an upper bound): the profile has no SP times (sp_forward_s; measured, or counted before "
                       "2026-12-05); count it again for them (docs/analytic.md)")
    elif tp > 1 and not sp_offered(profile):
        out.append("no sequence parallelism: the profile's tp rows predate sp_sequence_bytes; profile again to "
                   "let the planner use it")
    if c.layout.cp > 1:
        shape = attention_shape(profile)
        seq = f"{shape.seq_len} tokens" if shape else "tokens"
        out.append(f"context parallelism {c.layout.cp}: each sequence of {seq} sharded over {c.layout.cp} ranks "
                   "(2 x cp chunks, head-tail balanced), attention as ring attention; stage times include the K/V "
                   "ring's part not hidden under one block of attention, gradients averaged over dp x cp "
                   "(docs/parallelism.md#context-parallelism)"
                   + (f" (costed only beside tp {tp}: `autopp run` runs context parallelism with tp 1; a trainer "
                      "runs it: `autopp export`)" if tp > 1 else ""))
    over = f"{c.layout.dp} replicas" if c.layout.cp == 1 else f"dp x cp = {c.layout.sync} ranks"
    if c.layout.dp_replicate > 1:
        over = f"each HSDP group of {c.layout.shard} ranks"
    if c.layout.fsdp:
        out.append(f"ZeRO stage {zero.stage} over {over} as FSDP2 without a pipeline: parameters, "
                   "gradients and optimizer state sharded, each unit gathered for its forward and again for its "
                   "backward, its gradients reduce-scattered every microbatch (docs/parallelism.md#zero-stages)"
                   + _fsdp_experts_note(c.layout))
    elif not zero.replicated:
        out.append(f"ZeRO stage {zero.stage} over {over}: {zero.sharded} sharded"
                   + (" (costed only: torch.distributed.pipelining cannot run it)" if zero.not_runnable else ""))
    if c.layout.dp_replicate > 1:
        out.append(f"HSDP: ZeRO shards over {c.layout.shard} neighbouring ranks, replicated {c.layout.dp_replicate} "
                   "times; each gradient shard all-reduced across the replicas (docs/parallelism.md#zero-stages)")
    if c.layout.ep > 1:
        moe, layers = profile.meta.extra.get("moe") or {}, int(profile.units.moe_layers.sum()) // len(
            profile.meta.microbatch_sizes)
        ep, dp, etp, same = c.layout.ep, c.layout.dp, c.layout.etp, c.layout.unit_view().ep_replicas
        groups = "" if ep == dp else f" form {dp // ep} groups of {ep} that each"
        tensor = "" if etp == 1 else (f"; expert tensor parallelism {etp}: each expert's GEMMs sharded over {etp} "
                                      "ranks beside them, the rows they receive all-gathered and the partial outputs "
                                      "reduce-scattered, 2 + 2 per MoE layer and microbatch (the time breakdown's "
                                      "TP/SP collectives)")
        top = "" if moe.get("top_k") is None else f", top-{moe['top_k']}"  # a router without top_k: not said
        out.append(f"expert parallelism {ep}: each stage's {dp} replicas{groups} hold 1/{ep} of its experts "
                   f"({moe['num_experts']} per layer{top}) and exchange the routed tokens by "
                   "all-to-all, 2 + 2 per MoE layer and microbatch, in the stage times (docs/parallelism.md)" + tensor
                   + ("" if same == 1 or c.layout.fsdp else
                      f"; expert gradients all-reduced over the {same} ranks holding the same")
                   + _expert_gemms_note(profile, ep, etp)
                   + routing_note(routing_of(profile), ep, etp * c.layout.group, cluster)
                   if layers else f"expert parallelism {c.layout.ep}: the profile records no stacked experts "
                   "(expert_param_bytes 0), so it changes nothing; plan with `ep` 1")
    if uses_mesh(c.layout) and _device(profile, cluster) == "cpu":  # a tester's ZeRO 3 ran 1.75x its near-tie
        out.append(f"{MESH_ON_CPU}: the step above leaves it out, so a layout without it (ZeRO 0, tp 1) may run "
                   "faster on CPU ranks")
    return out


def _device(profile: Profile, cluster: Cluster) -> str | None:
    """The catalog name of the device kind the plan is for (`planned_device`)."""
    return planned_device(cluster, profile.meta.device, profile.meta.extra.get("analytic_device"))


def _experts_unsearched(profile: Profile, request: PlanRequest, c: Candidate) -> list[str]:
    """A mixture of experts planned with `ep` pinned at 1 (the request's default): said, with how to search it (a
    new user's Qwen3-30B-A3B plan kept every expert on every rank, and nothing said ep was never tried)."""
    experts = int((profile.meta.extra.get("moe") or {}).get("num_experts") or 1)
    if c.layout.ep > 1 or request.pins.ep != 1 or experts == 1 or not int(profile.units.moe_layers.sum()):
        return []
    return [f"expert parallelism not searched (`ep` 1, the default): each rank holds all {experts} experts of its "
            "stages' MoE layers; `ep` auto searches it (docs/parallelism.md)"]


def _fsdp_experts_note(layout: Layout) -> str:
    """What FSDP2 at pp 1 does with the experts beside ep (autopp.costmodel.fsdp): sharded over their dp / ep
    replicas (torchtitan's dp_shard_mod_ep), with ep = dp over one rank (gathered for each use without a
    collective)."""
    if layout.ep == 1:
        return ""
    r = layout.dp // layout.ep
    if r == 1:
        return "; the experts (ep = dp) FSDP2 over their one rank: gathered for each use without a collective"
    return f"; the experts sharded, gathered and reduce-scattered over the {r} ranks holding the same"


def _expert_gemms_note(profile: Profile, ep: int, etp: int = 1) -> str:
    """How the expert GEMMs are timed at `ep` (and `etp`; autopp.costmodel.experts): re-timed for 1/(ep x etp) of
    the expert weights, or, for a profile without the columns, at ep 1, and why."""
    if not profile.experts_untimed:
        shards, formula = (ep, "/ ep + other bytes' time") if etp == 1 else (ep * etp, "/ (ep x etp) + etp x other "
                                                                                       "bytes' time")
        return (f"; expert GEMMs re-timed for a rank reading 1/{shards} of the expert weights at the same FLOPs "
                f"(per pass max(FLOP time, weight time {formula}))")
    why = ("its times were measured on one device running every expert" if profile.meta.extra.get("analytic_device")
           is None else "it was counted before the expert GEMMs' columns")
    return (f"; expert GEMMs timed as at ep 1, every expert's weights read on each rank ({why}): an upper bound; "
            "an analytic profile (`autopp profile --analytic DEVICE`) re-times them")


def _seq_note(c: Candidate) -> list[str]:
    """Sequence pipelining's chunks, what the prediction assumes of them, and what runs them."""
    if c.seq is None:
        return []
    k = len(c.seq.lengths)
    return [f"sequence pipelining: each sequence in {k} chunks of {', '.join(map(str, c.seq.lengths))} tokens "
            "(equal cost: the attention's share from the profile's attention shape), run as units, every stage "
            "keeping its activations; autopp run runs it, in chunks of equal length, for model files that declare "
            "SEQUENCE_CHUNKS and HF Llama-family causal LMs; no exporter does (docs/sequence-pipelining.md)"]


def _unoffered(request: PlanRequest, a: UnitArrays) -> list[str]:
    """Why the policies whose figures depend on the devices (`ActivationPolicy.derive`: offload) were not offered
    there, on a catalog device or when asked for by name (`activations`)."""
    if request.cluster.device_kind is None and request.activations is None:
        return []
    host = request.cluster.host_bandwidth
    return [f"activation policy {p.value} not offered on {request.cluster.device_kind or 'these devices'}: "
            f"{policy(p).unoffered}" for p in request.allowed()
            if policy(p).derive is not None and not policy(p).offered(a, host)]


#: A plan's note where its stages' outputs are counted freed once sent (`PlanRequest.frees_outputs`).
FREED_NOTE = ("stage outputs: each freed once sent, its autograd node kept for the backward, as Megatron-LM frees "
              "them (deallocate_pipeline_outputs); torch's PipelineStage (autopp run, torchtitan) and DeepSpeed hold "
              "each microbatch's until its backward, which this plan's memory does not count")


def _overlap_notes(request: PlanRequest, a: UnitArrays, best: Verdict) -> list[str]:
    """The memory reserve and the overlap assumptions, where they apply (autopp.data.overlap; nothing overlapped is
    the cost model as before the switches, and says nothing, so such plans read as before them)."""
    out, c, overlap = [], best.candidate, request.assumed_overlap
    reserve = request.cluster.memory_reserve_bytes
    if reserve:
        out.append(f"memory: {(request.cluster.memory_bytes + reserve) / 2**30:.1f} GiB per device less a "
                   f"{reserve / 2**30:.3g} GiB reserve (CUDA context, NCCL buffers, allocator fragmentation; "
                   "`memory_reserve`, docs/devices.md)")
    collectives = replace(overlap, ep_a2a=False)  # ep_a2a's own note below
    if (c.layout.dp > 1 or c.layout.tp > 1) and collectives != NO_OVERLAP:
        where = "FSDP2 outside a pipeline: per-layer all-gathers and reduce-scatters" if a.fsdp else \
            "ZeRO/data-parallel collectives"
        out.append(f"{collectives.describe()} ({where}; docs/parallelism.md#overlap)")
    rule = pairing(c.schedule, True, c.layout.v)
    if overlap.ep_a2a and rule is not Pairing.STAGES:  # DualPipeV pairs its own
        out.append(_ep_a2a_note(a, best, rule))
    return out


def _ep_a2a_note(a: UnitArrays, best: Verdict, rule: Pairing | None) -> str:
    """What the `ep_a2a` overlap (Megatron-Core's EP A2A overlap) did in this plan, and the warm-up forward more
    per rank that Megatron runs with it and autopp's order does not (docs/parallelism.md#overlap)."""
    c, interleaved = best.candidate, ScheduleName.INTERLEAVED_1F1B
    if c.layout.ep == 1:
        return "ep_a2a: no expert parallelism in this plan (ep 1), no all-to-all to overlap"
    if rule is None:
        return (f"ep_a2a: not on {c.schedule.value} at v {c.layout.v}: autopp costs Megatron-Core's EP A2A overlap on "
                f"{interleaved.value} with v > 1 only (Megatron runs it there and at pp 1), so this plan's all-to-alls "
                "are exposed")
    hidden = sum(best.overlapped_s) / c.layout.pp
    if hidden <= 0:
        return "ep_a2a: no steady-state pair of this plan hid any all-to-all (too few microbatches per rank)"
    extra = max(float(a.activation[i:j].sum()) for i, j in c.bounds)
    return (f"ep_a2a: each steady-state backward runs beside the forward before it, {hidden:.3g} s of all-to-alls a "
            "step hidden under each other's compute (Megatron-Core's EP A2A overlap); Megatron runs one more warm-up "
            f"forward per rank with it, which this plan's order does not: up to {extra / 2**30:.3g} GiB more "
            "activations on a rank (its largest stage's per microbatch) than the peak above, and a step a few % "
            "longer")


def plan_from_verdict(profile: Profile, request: PlanRequest, best: Verdict, a: UnitArrays,
               custom: CustomOrder | None = None, extra: tuple[str, ...] = (), keep_split: bool = False,
               whole: UnitArrays | None = None) -> Plan:
    """The Plan of `best` (`a`: unit costs at its microbatch size, with its tensor- and data-parallel terms;
    `request`: its tensor-parallel degree's view, `PlanRequest.view`; `whole`: the unsharded costs, for the ideal
    step time when they differ from `a`): stages, simulated figures, baselines, notes.
    A baseline split that the simulator finds faster (and fitting, and that the runner would not refuse for this
    model: `runnable.py`) replaces the DP's split unless `keep_split` (a pinned configuration), and a synthesized
    order (`custom`, judged by the simulator too) replaces the named schedule when it is faster still."""
    baselines = judge_baselines(a, request, best)
    if not keep_split:
        runnable = [v for v in baselines.values() if v.fits and _runs(profile, v)]
        best = min([best, *runnable], key=lambda v: v.key)
    notes = [*extra, *([SPLIT_NOTE] if a.split_assumed else []), *_unoffered(request, a)]
    order: tuple[tuple[Action, ...], ...] = ()
    if custom is not None and custom.verdict.key < best.key:
        best = custom.verdict
        order = tuple(tuple(custom.order[r]) for r in sorted(custom.order))
        how = f"{custom.status}, gap {custom.gap:.1%}" if custom.status != "hint" else \
            "its warm start: the solver found no faster order in its time limit"
        notes.append(f"order synthesized by CP-SAT ({how}) on the layout of "
                     f"{best.candidate.schedule.value}; it runs through torch's schedule runtime")
    c = best.candidate
    names, points = profile.meta.unit_names, profile.meta.split_points
    owner = c.owner
    layout = c.layout
    placed = request.cluster.placed(layout)
    sends = [*comm_times(a, placed, c.bounds, owner), 0.0]
    delays = [*progress_delays(placed, owner), 0.0]
    stages = tuple(
        StagePlan(index=s, rank=owner[s], units=(i, j), unit_names=tuple(names[i:j]),
                  split_point=points[i - 1] if i else None, forward_s=cost.forward_s,
                  backward_s=cost.backward_input_s + cost.backward_weight_s if cost.backward_s is None
                  else cost.backward_s,
                  memory_bytes=best.peak_memory[owner[s]], activation=c.activations[s],
                  backward_input_s=cost.backward_input_s, backward_weight_s=cost.backward_weight_s,
                  static_bytes=cost.static_bytes,
                  activation_bytes=cost.activation_bytes, input_bytes=cost.input_bytes, send_s=sends[s],
                  progress_s=delays[s], overhead_s=cost.overhead_s, transient_bytes=cost.transient_bytes,
                  own=tuple(f for f in cost.own if f[0] is c.activations[s]), comm_s=cost.forward_comm_s,
                  sync_s=cost.sync_s, resume_s=cost.resume_s, scatter_s=cost.scatter_s, output_bytes=cost.output_bytes,
                  recompute_s=_redone_forward(cost, c.activations[s]))
        for s, ((i, j), cost) in enumerate(zip(c.bounds, best.costs)))
    notes.extend(_node_notes(request.cluster, c))
    notes.extend(_parallel_notes(profile, c, request.cluster))
    notes.extend(_experts_unsearched(profile, request, c))
    notes.extend(profile_notes(profile, c.microbatches, c.microbatch_size, vocab=best.passes is not None))
    notes.extend(_seq_note(c))
    notes.extend(_overlap_notes(request, a, best))
    notes.extend([FREED_NOTE] if a.frees_outputs and len(c.bounds) > 1 else [])
    ideal = ideal_step_time(whole if whole is not None else a, request.cluster, layout.pp, c.microbatches) \
        / layout.group
    plan = Plan(model_path=profile.meta.model_path, fingerprint=profile.meta.fingerprint,
                schedule=ScheduleName.CUSTOM if order else c.schedule, custom_order=order,
                device_order=_device_order(request, layout.pp * layout.dp), layout=layout,
                tp_plan=dict(profile.meta.tp_plan) if layout.tp > 1 else {}, num_microbatches=c.microbatches,
                microbatch_size=c.microbatch_size, memory_limit_bytes=request.cluster.memory_bytes, stages=stages,
                predicted=prediction(best, ideal), baselines={k: prediction(v, ideal) for k, v in baselines.items()},
                ideal_step_time_s=ideal, notes=tuple(notes), hf_config=dict(profile.meta.extra.get("hf_config", {})),
                device=_device(profile, request.cluster),
                optimizer=profile.meta.optimizer, dtype=profile.meta.dtype,
                time_breakdown=_breakdown(a, placed, best),
                precision=profile.meta.extra.get("precision"),
                kernels=recorded_kernels(profile.meta.extra),
                vocab=best.passes.variant if best.passes is not None else None, seq_chunks=c.seq,
                overlap=request.assumed_overlap, nodes=_nodes(request.cluster, layout.world),
                frees_outputs=a.frees_outputs and len(stages) > 1)
    refused = run_refusal(plan)  # said where it is planned, not first when it is run
    return plan if refused is None else replace(plan, notes=(
        *plan.notes, f"autopp run would refuse this plan ({refused}); a trainer runs it (autopp export)"))


def _nodes(cluster: Cluster, world: int) -> tuple[int, int] | None:
    """The plan's `nodes`: the cluster's nodes and devices per node, when it has them and the plan uses them all."""
    n = cluster.nodes
    return None if n is None or n.count * n.devices_per_node != world else (n.count, n.devices_per_node)


def _breakdown(a: UnitArrays, placed: Cluster, v: Verdict) -> TimeBreakdown:
    """Where `v`'s step goes (autopp.costmodel.breakdown), on the cluster as its layout is `placed`."""
    c = v.candidate
    owner = c.owner
    return time_breakdown(a, v.costs, c.bounds, c.activations, c.microbatches, stage_speeds(placed, owner),
                          splits_backward=describe(c.schedule).splits_backward, pipeline_s=v.pipeline_s,
                          bubble=v.bubble, sync_s=v.allreduce_s,
                          sync_total_s=gradient_allreduce_time(a, c.bounds, owner, c.layout, placed),
                          optimizer_s=v.optimizer_s, resumed_s=v.resumed_s, overlapped_s=v.overlapped_s,
                          scatter_tail_s=v.scatter_tail_s)


def _redone_forward(cost: StageCost, activation: Activation) -> float | None:
    """The stage's recomputed forward (`StageCost.recompute_s`) where its policy runs the whole forward again (whole
    stage or per unit, not selective recomputation, whose own figure says what it redoes); else None."""
    p = policy(activation)
    return cost.recompute_s if p.redoes_forward and not p.saves_ops else None

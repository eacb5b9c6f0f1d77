"""The plan's overlap assumptions (`Plan.assumed_overlap`, autopp.data.overlap) as each trainer is asked for them:
what a switch hid in the prediction must be hidden in the exported run too, or the export says what it adds.

- Megatron-LM overlaps nothing by default. `grad_reduce` is `--overlap-grad-reduce` (its DDP and distributed
  optimizer reduce bucket by bucket during the last microbatch's backward: megatron/core/distributed,
  `DistributedDataParallelConfig.overlap_grad_reduce`); with the distributed optimizer (ZeRO 1) the parameter
  all-gather the plan also counts as hidden is `--overlap-param-gather` (gathered under the next step's forward,
  `overlap_param_gather`; Megatron-LM's arguments.py accepts it only with the distributed optimizer or Megatron-FSDP
  and with `--overlap-grad-reduce`). Megatron-FSDP (ZeRO 3 at pp 1) prefetches its per-layer gathers and reduces per
  layer under the same two flags (`fsdp_prefetch`). `async_tp` is `--tp-comm-overlap` (TransformerConfig's
  `tp_comm_overlap`: Transformer Engine's userbuffers overlap of the sequence-parallel collectives with the GEMMs).
  `ep_a2a` is `--overlap-moe-expert-parallel-comm --delay-wgrad-compute` (megatron/core/transformer/moe/README.md,
  "EP A2A Overlap ... by merging FWD-BWD passes of adjacent microbatches").
- torchtitan overlaps as the planner's defaults assume without a setting: FSDP2 prefetches the next module's
  all-gather and reduce-scatters each module's gradients under the next module's backward (torch docs,
  `fully_shard`; torchtitan docs/fsdp.md), and its replicate path all-reduces in buckets during the backward, as
  torch DDP does. `async_tp` is `--compile.enable --compile.enable_async_tensor_parallel` (torchtitan's
  CompileConfig: async TP needs torch.compile of the model).
- torchtitan runs no combined forward-backward step (`Trainer.ep_a2a`): its export of a plan that hid all-to-alls
  under `ep_a2a` says how many seconds, which its run adds (DeepSpeed refuses such a plan's Interleaved1F1B).
- DeepSpeed's PipelineEngine reduces gradients only after the pipeline's last backward (TrainSchedule's
  `ReduceGrads` instruction; `is_gradient_accumulation_boundary` is true only inside it, runtime/pipe/engine.py),
  so no setting (`zero_optimization.overlap_comm` included) hides it under the last backward.
"""

from __future__ import annotations

from ..data.plan import Plan
from ..schedule import Pairing
from ..data.trainers import trainer_rules

__all__ = ["megatron_overlap", "torchtitan_overlap", "deepspeed_overlap", "ep_a2a_note", "combined_1f1b"]


def _reduces(plan: Plan) -> bool:
    """Whether the plan synchronises gradients over data-parallel ranks (dp x cp > 1) with `grad_reduce` assumed."""
    return plan.assumed_overlap.grad_reduce and plan.layout.sync > 1


def megatron_overlap(plan: Plan) -> list[str]:
    """Megatron-LM's flags for what the plan assumed hidden (module docstring)."""
    overlap, layout = plan.assumed_overlap, plan.layout
    prefetch = overlap.fsdp_prefetch and layout.fsdp
    out = ["--overlap-grad-reduce"] if _reduces(plan) or prefetch else []
    if out and (prefetch or layout.zero.shards_optimizer and overlap.grad_reduce):
        out.append("--overlap-param-gather")
    if overlap.async_tp and layout.sp:
        out.append("--tp-comm-overlap")
    if combined_1f1b(plan):
        out += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
    return out


def combined_1f1b(plan: Plan) -> bool:
    """Whether the plan hid expert all-to-alls under other microbatches' compute: `ep_a2a` on an Interleaved1F1B
    plan with ep > 1 (`Plan.pairing`; Megatron-Core runs its combined 1F1B with a virtual pipeline where pp > 1, and
    autopp does not cost it at pp 1)."""
    return plan.pairing is Pairing.MICROBATCHES


def ep_a2a_note(plan: Plan, trainer: str) -> list[str]:
    """A note where the plan hid expert all-to-alls under another microbatch's compute (`Overlap.ep_a2a`) and
    `trainer` runs none so (`Trainer.ep_a2a`), with the seconds a step hid (its time breakdown's row, where
    recorded)."""
    why = trainer_rules(trainer).ep_a2a
    if not (combined_1f1b(plan) and why):
        return []
    rows = plan.time_breakdown.rows(plan.layout.pp) if plan.time_breakdown is not None else []
    hidden = next((h for term, _, h in rows if term == "EP all-to-alls"), None)
    much = f"the {hidden:.3g} s of expert all-to-alls" if hidden is not None else "the expert all-to-alls"
    return [f"the plan hid {much} under other microbatches' compute (`overlap` ep_a2a, Megatron-Core's EP A2A "
            f"overlap), and {trainer_rules(trainer).title} runs them exposed ({why}): its step is longer by up to "
            "that; re-plan without ep-a2a to predict it"]


def torchtitan_overlap(plan: Plan) -> tuple[list[str], list[str]]:
    """torchtitan's overrides for what the plan assumed hidden (async TP), and notes on what it overlaps without a
    setting (module docstring): where the plan assumed it, that it matches; where the plan did not, that the run
    may be faster than predicted."""
    overlap, layout = plan.assumed_overlap, plan.layout
    compile_lines = [*trainer_rules("torchtitan").fuse, "--compile.enable_async_tensor_parallel"]
    lines = compile_lines if overlap.async_tp and layout.sp else []
    reduces = layout.sync > 1
    if not reduces:
        return lines, []
    if overlap.grad_reduce:
        return lines, ["torchtitan overlaps the data-parallel gradient reduction with the backward by default (FSDP2's "
                       "per-module reduce-scatter, bucketed all-reduce of its replicas), as the plan assumed "
                       "(`overlap` grad_reduce): no setting"]
    return lines, ["the plan assumed the data-parallel gradient reduction exposed after the step (`overlap` without "
                   "grad_reduce), and torchtitan overlaps it with the backward regardless (FSDP2, bucketed "
                   "all-reduce): its step may be shorter than predicted"]


def deepspeed_overlap(plan: Plan) -> list[str]:
    """A note where the plan hid gradient reduction that DeepSpeed's PipelineEngine runs after the last backward,
    with the seconds the plan hid (its time breakdown's, where recorded)."""
    if not _reduces(plan):
        return []
    hidden = plan.time_breakdown.sync_hidden_s if plan.time_breakdown is not None else None
    much = f"the {hidden:.3g} s of it" if hidden is not None else "what of it"
    return [f"DeepSpeed's PipelineEngine reduces gradients only after the pipeline's last backward (its ReduceGrads "
            f"instruction), so {much} the plan hid under that backward (`overlap` grad_reduce) adds to its step; "
            "re-plan with `autopp plan --overlap none` (or without grad-reduce) to predict that"]

"""Which collectives the cost model hides under compute, as the trainers overlap them: one value, a switch each.

Each switch is an assumption about the trainer that runs the plan, with its source:
- `fsdp_prefetch`: FSDP2 (`fully_shard`) issues the all-gather of the next module's parameters while the current
  module computes, in the forward and (in reverse order) in the backward, and runs each module's gradient
  reduce-scatter beside the next module's backward (torch docs, "torch.distributed.fsdp.fully_shard": implicit
  prefetching with `reshard_after_forward`; torchtitan docs/fsdp.md: "FSDP2 ... overlaps communication with
  computation" and explicit prefetching, `set_modules_to_forward_prefetch`). autopp costs it where FSDP2 runs
  outside a pipeline (pp 1, a ZeRO stage that reshards after forward; `autopp.costmodel.parallel`) and for ZeRO 2's
  reduce-scatter after every microbatch inside a pipeline stage (pp > 1; plan-only, as Meta's FSDP ran it for
  Llama 3, arXiv:2407.21783 s.3.3.2): each unit's scatter under the backward of the unit before it in the same
  stage, and the stage's first unit's (the last to finish) on the rank's reduce-scatter stream: FSDP2 issues it in
  the post-backward hook on its own stream and the compute stream goes on with the rank's next action (another
  microbatch's forward or backward) at once; the simulator queues it there at max(backward end, stream free), and
  only the step's end on that rank (its DP/ZeRO collectives, the optimizer) waits for the stream
  (`autopp.costmodel.parallel.scatter_in_backward`, autopp.schedule.simulate). Not modelled: the stream's
  contention with the pipeline's point-to-point sends on the same link, and the memory of the unsharded gradients
  awaiting their scatter (not charged). Under
  torch.distributed.pipelining's ZeRO 1 and 3 the stage keeps parameters gathered and gradients unsharded until
  the last microbatch, so there is nothing per layer to overlap.
- `grad_reduce`: the data-parallel gradient reduction (all-reduce, or ZeRO's reduce-scatter) runs bucket by bucket
  while the step's last backward still computes (torch DDP's bucketed all-reduce, FSDP2's per-module
  reduce-scatter, Megatron-LM's `--overlap-grad-reduce`); what exceeds the rank's last backward is exposed
  (`autopp.costmodel.terms.step_end_time`).
- `async_tp`: tensor parallelism's sequence-parallel all-gathers and reduce-scatters decomposed and pipelined with
  the matmuls they feed (torch's micro-pipeline TP, `torch._inductor.config._micro_pipeline_tp`; torchtitan's
  `enable_async_tensor_parallel`, which needs torch.compile): off by default, as in both trainers; costed only with
  sequence parallelism, whose collectives it decomposes.
- `ep_a2a`: expert parallelism's all-to-alls of one microbatch under another's compute: Megatron-Core's
  `overlap_moe_expert_parallel_comm` (`--overlap-moe-expert-parallel-comm`, with `--delay-wgrad-compute`) runs
  each steady-state forward and backward of its interleaved schedule as one combined step, the dispatch and combine
  of each on a communication stream beside the other's computation (megatron/core/pipeline_parallel/schedules.py,
  `combined_1f1b_schedule_for_interleaved_pipelining`; DeepSeek-V3's DualPipe overlap, arXiv:2412.19437 s.3.2.1,
  on 1F1B). autopp pairs each full backward listed right after a forward of another microbatch on Interleaved1F1B's
  order with v > 1 (`autopp.schedule.pairing`, `Pairing.MICROBATCHES`) and the simulator runs each pair as
  DualPipeV's: max of the two computations and the two communications. Off by default, as in Megatron-LM;
  Megatron-Core asserts it with a virtual pipeline where pp > 1, without full recomputation, on a bf16 or fp16
  model; torchtitan and DeepSpeed do not run it (autopp.data.trainers). Not modelled: Megatron's one more warm-up
  forward per rank (the memory of one more microbatch in flight, and the pairs it makes on the last rank's last
  stage), its overlap layer by layer (a pair of chunks with different layer counts hides less than autopp's
  whole-stage pair), and the overlap at pp 1 (autopp's 1F1B order pairs each forward with its own backward).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .fields import Fields

__all__ = ["Overlap", "NO_OVERLAP", "TRAINER_OVERLAP", "default_overlap", "overlap_of"]


@dataclass(frozen=True, kw_only=True)
class Overlap:
    """The collectives hidden under compute (module docstring); each False: on the critical path."""

    fsdp_prefetch: bool = True
    """FSDP2's per-module all-gathers and reduce-scatters under the neighbouring modules' compute (pp 1), and ZeRO
    2's per-microbatch reduce-scatters under the stage's backward and, the stage's first unit's, on the rank's
    reduce-scatter stream beside its next actions (pp > 1)."""
    grad_reduce: bool = True
    """The data-parallel gradient reduction under the step's last backward."""
    async_tp: bool = False
    """Sequence-parallel collectives pipelined with their matmuls (async TP)."""
    ep_a2a: bool = False
    """Expert parallelism's all-to-alls of a forward and a backward of different microbatches under each other's
    compute (Megatron-Core's EP A2A overlap, its combined 1F1B), on Interleaved1F1B's order with v > 1."""

    def describe(self) -> str:
        """"overlap: fsdp_prefetch, grad_reduce" (or "overlap: none"), as plan notes print it."""
        on = [f.name for f in fields(self) if getattr(self, f.name)]
        return "overlap: " + (", ".join(on) or "none")


#: Nothing overlapped: every collective on the critical path (the cost model's arrays before a request's overlap).
NO_OVERLAP = Overlap(fsdp_prefetch=False, grad_reduce=False, async_tp=False)
#: What torchtitan and Megatron-LM (with `--overlap-grad-reduce`) do by default: the planner's default.
TRAINER_OVERLAP = Overlap()


def default_overlap(device: str | None) -> Overlap:
    """What the planner assumes unless asked (`PlanRequest.overlap` None): what torchtitan and Megatron-LM (with
    `--overlap-grad-reduce`, which the Megatron export writes) overlap on a catalog GPU, `TRAINER_OVERLAP`; nothing on
    CPU ranks and unnamed devices (`device` "cpu" or None), whose plans autopp's own runner checks: it all-reduces
    the gradients once after the step (autopp.run.worker). Plans written before `Plan.overlap` are read with it."""
    return TRAINER_OVERLAP if device not in (None, "cpu") else NO_OVERLAP


def overlap_of(value: Any, f: Fields) -> Overlap | None:
    """Plan field `overlap` (docs/plan-format.md): null, or an object of the switches' names, each true or false (a
    switch left out: off)."""
    if value is None:
        return None
    names = [x.name for x in fields(Overlap)]
    f.keys(value, names, listed=True)
    return Overlap(**{name: f.flag(value.get(name, False), name) for name in names})

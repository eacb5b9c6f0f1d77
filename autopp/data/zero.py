"""ZeRO stages as descriptors: what each shards over the data-parallel replicas, how it runs, how trainers spell it.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC'20, arXiv:1910.02054,
s.5), as the stages run under torch.distributed.pipelining with FSDP2 (docs/parallelism.md; the cost terms are in
autopp.costmodel.parallel). Every other module reads a stage's properties from its descriptor here; the stage number
itself appears only at the JSON and command-line boundaries (`zero_stage`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LayoutError

__all__ = ["ZeroStage", "ZERO", "NO_ZERO", "SEARCHED_ZERO", "zero_stage", "HSDP_REFUSALS"]


@dataclass(frozen=True, kw_only=True)
class ZeroStage:
    """One ZeRO stage: what it shards, what it communicates, whether autopp runs it, and each trainer's spelling."""

    stage: int
    """The stage's number (0-3): the JSON and flag spelling, and what messages print."""
    sharded: str
    """What the stage shards over the replicas, in words."""
    shards_optimizer: bool = False
    """Optimizer state (and its step) is split over the replicas: the optimizer steps 1 / dp of it."""
    scatters_each_microbatch: bool = False
    """Gradients are reduce-scattered after every microbatch's backward and kept sharded (stage 2), instead of once
    after the step's last backward."""
    gathers_each_forward: bool = False
    """Parameters are resharded between uses and all-gathered before every forward (stage 3)."""
    fsdp_reshard_after_forward: bool | None = None
    """How FSDP2's `fully_shard` runs it (`reshard_after_forward`); None: no FSDP (a plain gradient all-reduce)."""
    not_runnable: str | None = None
    """Why `autopp run` (torch.distributed.pipelining) cannot run it; None: it runs. A stage that cannot run is costed
    only when asked for, never searched."""
    split_backward_refusal: str | None = None
    """Why `autopp run` does not run this stage beside a split I/W backward (the zero-bubble schedules, synthesized
    orders); None: it does. The planner leaves those configurations out and refuses them pinned."""
    megatron: tuple[str, ...] = field(default=(), compare=False, hash=False)
    """Megatron-LM's arguments for it (where it runs: `refusal("megatron")` is None): those that name the stage, which
    `autopp plan --pin-from` looks for."""
    megatron_with: tuple[str, ...] = field(default=(), compare=False, hash=False)
    """Megatron-LM's arguments its validate_args requires or sets beside `megatron`, written after them by the export
    but not needed to recognise the stage (Megatron-FSDP's checkpoint format)."""
    trainer_refusals: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Trainer ("torchtitan", "megatron", "deepspeed") -> why it has no such stage beside pipeline parallelism."""
    one_stage_refusals: dict[str, str] = field(default_factory=dict, compare=False, hash=False)
    """Trainer -> why it cannot run this stage at pp 1 either, where the reason is not pipeline parallelism's."""

    @property
    def replicated(self) -> bool:
        """Nothing is sharded: every replica holds everything and gradients are all-reduced after the step."""
        return not self.shards_optimizer

    def refusal(self, trainer: str, pp: int | None = None) -> str | None:
        """Why `trainer` cannot run this stage beside pipeline parallelism (None: it can); at `pp` 1, the reason that
        holds without a pipeline where it differs (`one_stage_refusals`)."""
        return (self.one_stage_refusals.get(trainer) if pp == 1 else None) or self.trainer_refusals.get(trainer)

    def __str__(self) -> str:
        return f"ZeRO {self.stage}"

    def __repr__(self) -> str:
        return f"ZERO[{self.stage}]"


_NO_STAGE_2 = "re-plan with `zero` 1 or 3"
_DEEPSPEED = ("DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1 only (\"ZeRO-2 and ZeRO-3 are incompatible with "
              "pipeline parallelism\", runtime/pipe/engine.py); re-plan with `zero` 1")
#: At pp 1 the plan has no pipeline, but autopp's DeepSpeed export still builds a PipelineModule (one stage:
#: autopp.export.deepspeed.pipe_snippet), and deepspeed.initialize runs any PipelineModule with its PipelineEngine.
_DEEPSPEED_ONE_STAGE = ("autopp's DeepSpeed export builds the model as a PipelineModule at pp 1 too (one stage), "
                        "and deepspeed.initialize runs a PipelineModule with its PipelineEngine, which runs ZeRO "
                        "stage 0 or 1 only (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\", "
                        "runtime/pipe/engine.py); re-plan with `zero` 1")

#: What Megatron-FSDP's ZeRO 3 needs beside its flags in Megatron-LM's validate_args (megatron/training/arguments.py,
#: NVIDIA/Megatron-LM d98e8a64): it asserts `args.ckpt_format == "fsdp_dtensor"` ("Megatron-FSDP requires the
#: `fsdp_dtensor` checkpointing format") and, under Megatron-FSDP v1 (`--megatron-fsdp-version` default 1), sets
#: `--use-distributed-optimizer` with a warning when it is not given (docs/user-guide/features/megatron_fsdp.md: "Uses
#: Megatron-Core's DistributedOptimizer"). Its `--no-gradient-accumulation-fusion` is optional (the guide: fusion "used
#: by default and can be deactivated"; validate_args only warns to verify TE's support), so it is not written.
_MEGATRON_FSDP_WITH = ("--use-distributed-optimizer", "--ckpt-format fsdp_dtensor")

#: Every ZeRO stage by number.
ZERO: dict[int, ZeroStage] = {z.stage: z for z in (
    ZeroStage(stage=0, sharded="nothing (replicated)"),
    ZeroStage(stage=1, sharded="optimizer state", shards_optimizer=True, fsdp_reshard_after_forward=False,
              megatron=("--use-distributed-optimizer",)),
    ZeroStage(stage=2, sharded="optimizer state and gradients", shards_optimizer=True, scatters_each_microbatch=True,
              not_runnable="torch.distributed.pipelining keeps a stage's gradients unsharded until the step's last "
                           "microbatch, so ZeRO stage 2 cannot run under it",
              trainer_refusals={
                  "torchtitan": "torchtitan has no ZeRO stage 2 (its FSDP keeps gradients whole under pipeline "
                                f"parallelism); {_NO_STAGE_2}",
                  "megatron": "Megatron-LM has no ZeRO stage 2 beside pipeline parallelism (its distributed "
                              "optimizer is ZeRO 1; gradient sharding needs its FSDP); re-plan with `zero` 1",
                  "deepspeed": _DEEPSPEED}, one_stage_refusals={"deepspeed": _DEEPSPEED_ONE_STAGE}),
    ZeroStage(stage=3, sharded="optimizer state, and parameters and gradients between steps", shards_optimizer=True,
              gathers_each_forward=True, fsdp_reshard_after_forward=True,
              split_backward_refusal="torch.distributed.pipelining's split backward (input pass, then weight pass) "
                                     "beside FSDP2's resharding gives wrong parameter gradients (measured: "
                                     "examples/gpt.py under the V-shaped zero-bubble schedule, pp 2 x dp 2, a "
                                     "block's norm weight 100 % off; the same split with ZeRO 1, or with full "
                                     "backwards, matches one process)",
              megatron=("--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params"),
              megatron_with=_MEGATRON_FSDP_WITH,
              trainer_refusals={"deepspeed": _DEEPSPEED}, one_stage_refusals={"deepspeed": _DEEPSPEED_ONE_STAGE}),
)}
NO_ZERO = ZERO[0]
#: The stages the search tries when the request leaves ZeRO open: those `autopp run` can run.
SEARCHED_ZERO: tuple[ZeroStage, ...] = tuple(z for z in ZERO.values() if z.not_runnable is None)


def zero_stage(stage: object) -> ZeroStage:
    """The descriptor of ZeRO stage number `stage`; a LayoutError naming the stages that exist otherwise."""
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in ZERO:
        raise LayoutError(f"ZeRO stage {stage!r} does not exist; give one of {sorted(ZERO)}")
    return ZERO[stage]


#: HSDP (`Layout.dp_replicate` > 1: shard inside a group of dp / dp_replicate ranks, replicate across the groups):
#: trainer -> why it cannot run it (torchtitan runs it: `data_parallel_replicate_degree` x
#: `data_parallel_shard_degree`). Megatron-LM's distributed optimizer shards over the whole data-parallel group (its
#: nearest, `--num-distributed-optimizer-instances`, shards ZeRO 1 state only, and its FSDP has no replicate
#: dimension beside pipelining); DeepSpeed's nearest, ZeRO++ hpZ and MiCS, are ZeRO 3 schemes its PipelineEngine
#: refuses.
HSDP_REFUSALS: dict[str, str] = {
    "megatron": "Megatron-LM shards over the whole data-parallel group (its nearest, "
                "--num-distributed-optimizer-instances, partitions ZeRO 1 state only); re-plan with `dp_replicate` 1",
    "deepspeed": "DeepSpeed's nearest (ZeRO++ hpZ, MiCS) are ZeRO 3 schemes, which its PipelineEngine refuses; "
                 "re-plan with `dp_replicate` 1",
}

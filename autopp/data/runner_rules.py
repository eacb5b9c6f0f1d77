"""What `autopp run` refuses of a plan from the plan alone, before any rank starts: ZeRO stages torch's pipelining
cannot run, and expert and context parallelism beside what the runner runs them with. One torch-free home (no
pandas, no networkx either: every rank imports it), which the runner raises (autopp.run.data_parallel.
check_runnable, autopp.run.expert_parallel, autopp.run.context_run) and every plan notes (`plan_from_verdict`, so a
Python user of `make_plan` gets it too; a tester planned ZeRO 1 beside ep on CPU devices and learnt only from the run
that it does not run; importing the runner's modules for it put torch into every `autopp plan --profile`, a
reviewer)."""

from __future__ import annotations

from ..schedule import describe
from .hf_config import DEFAULT_TASK
from .layout import Layout
from .plan import Plan
from .zero import SEARCHED_ZERO

__all__ = ["CP_MODEL_TYPES", "sequence_refusal", "expert_refusal", "context_refusal", "cp_refusal", "run_refusal"]


#: HF model types whose causal LM the runner runs under cp: decoders that read token positions only through their
#: rotary embedding module (`forward(x, position_ids)`), checked on CPU ranks against one process
#: (tests/run/test_context_run.py). Mistral ran validated too but is not listed: its sliding window is not applied by
#: the runner's causal attention (no mask), so beyond the window neither the reference nor the run is Mistral.
CP_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def sequence_refusal(seq_len: int, cp: int, balance: bool) -> str | None:
    """Why a sequence of `seq_len` tokens does not split evenly over `cp` ranks (into 2·cp chunks with causal load
    balancing, as torch's head-tail balancer and torchtitan require), or None."""
    parts = 2 * cp if balance else cp
    if cp >= 1 and seq_len % parts == 0:
        return None
    return (f"context parallelism needs seq % ({'2*cp' if balance else 'cp'}) == 0 (seq {seq_len}, cp {cp}"
            f"{', causal load balancing' if balance else ''})")


def expert_refusal(layout: Layout) -> str | None:
    """Why the runner does not run `layout`'s expert parallelism (None: ep 1, or it runs it): ep (x etp) must divide
    dp (the ep groups are carved from a stage's data-parallel ranks), without tensor or context parallelism, with
    ZeRO 0, or ZeRO 3 at pp 1 (FSDP2 without a pipeline, `Layout.fsdp`) and etp 1."""
    if layout.ep == 1 or not (layout.dp % (layout.ep * layout.etp) or layout.group > 1 or not (
            layout.zero.replicated or layout.fsdp and layout.etp == 1)):
        return None
    carved = "ep" if layout.etp == 1 else "ep x etp"
    return (f"plan field 'ep' is {layout.ep}" + (f" (etp {layout.etp})" if layout.etp > 1 else "")
            + f" with pp {layout.pp}, dp {layout.dp}, cp {layout.cp}, tp {layout.tp}, zero {layout.zero.stage}: "
            f"autopp runs expert parallelism with {carved} dividing dp, cp 1, tp 1 and zero 0, or zero 3 at pp 1"
            + (" with etp 1" if layout.etp > 1 else "")
            + " (ZeRO 1 and 2 beside ep are planned and exported, not run); re-plan with `--ep 1` or those")


def context_refusal(plan: Plan) -> str | None:
    """Why the runner does not run `plan`'s context parallelism (None: cp 1, or it runs it): a model file, a task
    other than causal-lm, a model type outside `CP_MODEL_TYPES`, tp or ep above 1, vocabulary parallelism, a schedule
    that does not run whole microbatches, or a sequence that does not split into 2 x cp chunks."""
    layout, hf = plan.layout, plan.hf_config
    if layout.cp == 1:
        return None
    why: str | None = None
    if not hf or hf.get("task", DEFAULT_TASK) != DEFAULT_TASK:
        what = f"task {hf['task']}" if hf else f"the model file {plan.model_path}"
        why = (f"autopp run runs context parallelism for HF causal LMs given by --hf-config "
               f"({', '.join(CP_MODEL_TYPES)}), not {what}")
    elif hf.get("model_type", CP_MODEL_TYPES[0]) not in CP_MODEL_TYPES:  # a plan without it: the model is checked
        why = (f"autopp run runs context parallelism for {', '.join(CP_MODEL_TYPES)} causal LMs, not model_type "
               f"{hf['model_type']}")
    elif layout.tp > 1 or layout.ep > 1 or plan.vocab is not None:
        why = (f"autopp run runs context parallelism with tp 1, ep 1 and no vocabulary parallelism (plan has tp "
               f"{layout.tp}, ep {layout.ep}, vocab {'on' if plan.vocab else 'off'})")
    elif describe(plan.schedule).mirrored or describe(plan.schedule).sequence_chunks:
        why = (f"autopp run runs context parallelism under schedules that run each microbatch whole, not "
               f"{plan.schedule.value}")
    else:
        why = sequence_refusal(int(hf["seq_len"]), layout.cp, balance=True)
    return None if why is None else cp_refusal(plan, why)


def cp_refusal(plan: Plan, why: str) -> str:
    """The runner's one line refusing `plan`'s context parallelism for reason `why`."""
    return (f"plan field 'cp' is {plan.layout.cp}: {why}; export the plan to torchtitan or megatron, or re-plan with "
            "`--cp 1`")


def run_refusal(plan: Plan) -> str | None:
    """What `autopp run` refuses of `plan` from the plan alone before any rank starts, or None: expert and context
    parallelism beside what it runs them with, a ZeRO stage torch's pipelining cannot run (`not_runnable`), or its
    `split_backward_refusal` under a schedule or order that splits the backward. `autopp plan` says it in a note (a
    tester planned ZeRO 1 beside ep on CPU devices and learnt only from the run that it does not run)."""
    zero = plan.layout.zero
    if why := expert_refusal(plan.layout) or context_refusal(plan):
        return why
    if zero.not_runnable is not None:
        return (f"plan field 'zero' is {zero.stage}: {zero.not_runnable}; plan with `zero` "
                f"{' or '.join(str(z.stage) for z in SEARCHED_ZERO if not z.replicated)}")
    if zero.split_backward_refusal and plan.splits_backward:
        return (f"plan field 'zero' is {zero.stage} beside {plan.schedule.value}'s split backward: "
                f"{zero.split_backward_refusal}; plan with `zero` 1 or a schedule with full backwards")
    return None

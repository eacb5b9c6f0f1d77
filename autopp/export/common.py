"""What every trainer export needs from a plan: stage order, per-stage units, one activation policy, the batch, and
each parallel axis as the trainer spells it (autopp.data.axes)."""

from __future__ import annotations

from dataclasses import dataclass

from typing import Any, Mapping

from ..data.axes import AXES, SWITCHES, Axis, Switch
from ..data.layout import MESH_AXES
from ..data.plan import Plan
from ..data.precision import plan_recipe
from ..data.tp_plan import LOSS_PARALLEL
from ..data.trainers import kernels_words, optimizer_words, trainer_rules
from ..errors import ScheduleError
from ..schedule import DESCRIPTORS, Activation, ActivationPolicy, StagePlacement, describe, policy
from .layers import ExportError

__all__ = ["Exported", "uniform_policy", "refuse_layout", "trainer_axes", "launch_grid", "group_lines",
           "carved_lines", "axis_notes", "stage_placement", "refuse_schedule", "made_for", "kernels_for",
           "outputs_notes", "optimizer_note", "loss_parallel_notes"]


@dataclass(frozen=True)
class Exported:
    """The text of the main file, extra files beside it (suffix -> text), and notes for the user (stderr)."""

    text: str
    extra: dict[str, str]
    notes: tuple[str, ...] = ()


def uniform_policy(plan: Plan, trainer: str, where: str) -> ActivationPolicy:
    """The one activation policy of every stage; an ExportError when stages differ (`trainer`, a name of
    autopp.data.trainers, applies one policy to all) or when `trainer` cannot apply it (`ActivationPolicy.refusal`)."""
    used = sorted({s.activation for s in plan.stages}, key=list(Activation).index)
    if len(used) > 1:
        which = "; ".join(f"{a.value}: stages {[s.index for s in plan.stages if s.activation is a]}" for a in used)
        raise ExportError(f"{where}: the stages' activation policies differ ({which}); {trainer_rules(trainer).title} "
                          f"applies one activation-checkpointing policy to every stage; {_replan_policies(trainer)}")
    chosen = policy(used[0])
    why = chosen.refusal(trainer)
    if why is not None:
        raise ExportError(f"{where}: activation policy {chosen.name.value}: {why}; {_replan_policies(trainer)}")
    return chosen


def _replan_policies(trainer: str) -> str:
    """How to plan again with one activation policy `trainer` applies on every stage: `recompute` none (keep), or
    `--for`, whose `recompute` auto plans each policy it applies (`recompute` all, one whole-stage checkpoint, is one
    none of the trainers applies: its `--for` refuses it)."""
    applied = ", ".join(a.value for a in Activation if policy(a).refusal(trainer) is None)
    return (f"re-plan with `recompute` none, or with `autopp plan --for {trainer}`, whose `recompute` auto gives every "
            f"stage one of the policies {trainer_rules(trainer).title} applies ({applied})")


def refuse_layout(plan: Plan, trainer: str, where: str) -> None:
    """An ExportError when `trainer` cannot run the plan's ZeRO stage or one of its parallel axes beside pipeline
    parallelism (autopp.data.trainers, reading the ZeRO and axis descriptors), its precision recipe or its vocabulary
    parallelism."""
    recipe = plan_recipe(plan.precision, plan.dtype)
    why = trainer_rules(trainer).layout_refusal(plan.layout) or (
        f"precision {recipe}: {recipe.refusal(trainer)}" if recipe is not None and recipe.refusal(trainer) else None)
    if why is not None:
        raise ExportError(f"{where}: {why}")
    if plan.vocab is not None:
        raise ExportError(f"{where}: vocab {plan.vocab.value}: {trainer_rules(trainer).vocab}; re-plan with `vocab` "
                          f"off (or `autopp plan --for {trainer}`)")


def _switches(plan: Plan) -> list[tuple[Switch, bool]]:
    """The layout's switches whose axis is above 1, with their values."""
    return [(s, bool(getattr(plan.layout, s.name))) for s in SWITCHES.values() if getattr(plan.layout, s.axis) > 1]


def trainer_axes(plan: Plan, trainer: str) -> list[tuple[Axis, int]]:
    """The axes autopp plans that `trainer` runs, with the plan's degrees, in mesh order (those it refuses and those
    not planned yet left out)."""
    return [(a, getattr(plan.layout, a.name)) for a in AXES.values()
            if a.unplanned is None and a.spelling(trainer).refusal is None]


def launch_grid(plan: Plan, trainer: str) -> str:
    """The ranks to launch as `trainer` sees them, for its launch note: "pp 2 x dp 2 x tp 1" (the mesh's axes: ep is
    carved from them, not a factor of the world size)."""
    return " x ".join(f"{a.name} {degree}" for a, degree in trainer_axes(plan, trainer) if a.name in MESH_AXES)


def group_lines(plan: Plan, trainer: str, line: str) -> list[str]:
    """Per axis inside a pipeline rank's group (`Axis.in_group`) that `trainer` runs, its degree as `line` formats
    it (`line.format(key=..., degree=...)`), then its `extra` lines when the degree is above 1."""
    out: list[str] = []
    for axis, degree in trainer_axes(plan, trainer):
        spelling = axis.spelling(trainer)
        if axis.in_group and spelling.degree is not None:
            out.append(line.format(key=spelling.degree, degree=degree))
            out.extend(spelling.extra if degree > 1 else ())
            out.extend(line for s, v in _switches(plan) if s.axis == axis.name for line in s.spelling(trainer, v).extra)
    return out


def carved_lines(plan: Plan, trainer: str, line: str, facts: Mapping[str, Any], where: str) -> list[str]:
    """Per axis carved from the mesh's ranks (outside `MESH_AXES`: ep) above degree 1 that `trainer` runs, its degree
    as `line` formats it, its `extra` lines and the model's facts it needs (`Spelling.facts`, read from `facts`: the
    profile's meta.extra["moe"]; `Spelling.facts_if_any` where `facts` has them); an ExportError naming the first
    fact `facts` lacks. At degree 1 the facts alone, where `facts` has them: the trainer builds the model from them
    (Megatron's --num-experts makes its layers MoE layers), whatever the degree."""
    out: list[str] = []
    for axis, degree in trainer_axes(plan, trainer):
        spelling = axis.spelling(trainer)
        if axis.name in MESH_AXES or spelling.degree is None or \
                degree == 1 and all(facts.get(fact) is None for fact, _ in spelling.facts):
            continue
        out.extend([line.format(key=spelling.degree, degree=degree)] if degree > 1 else [])
        for fact, key in spelling.facts:
            if facts.get(fact) is None:
                raise ExportError(f"{where}: {axis.name} {degree}: {trainer} needs {key}, and the profile the plan "
                                  f"was made from records no {fact}: profile the model again (autopp profile) and "
                                  "export with it")
            out.append(line.format(key=key, degree=facts[fact]))
        out.extend(line.format(key=key, degree=facts[fact]) for fact, key in spelling.facts_if_any
                   if facts.get(fact) is not None)
        out.extend(spelling.extra if degree > 1 else ())
    return out


def axis_notes(plan: Plan, trainer: str) -> list[str]:
    """The notes of the axes above degree 1 and of their switches on how `trainer` runs them (`Spelling.note`)."""
    notes = [a.spelling(trainer).note for a, degree in trainer_axes(plan, trainer)
             if degree > 1 and a.spelling(trainer).note]
    return notes + [s.spelling(trainer, v).note for s, v in _switches(plan) if s.spelling(trainer, v).note]


def stage_placement(plan: Plan) -> StagePlacement | None:
    """The placement of the plan's stages: the placement of the first schedule that places them so, LOOP (stage s on
    rank s % pp) or V (zig-zag), or None for another one."""
    ranks = [s.rank for s in plan.stages]
    for d in DESCRIPTORS.values():
        if d.placement is StagePlacement.GIVEN:
            continue
        try:
            if d.stage_to_rank(plan.layout.pp, plan.layout.v) == ranks:
                return d.placement
        except ScheduleError:  # another stage count per rank than the plan's
            continue
    return None


def refuse_schedule(plan: Plan, trainer: str, where: str) -> None:
    """An ExportError when `trainer` cannot run the plan's schedule with its layout and microbatches
    (autopp.data.trainers), saying what to re-plan with."""
    why = trainer_rules(trainer).schedule_refusal(plan.schedule, plan.layout, plan.num_microbatches)
    if why is None:
        return
    value = plan.schedule.value
    name = f"a synthesized order ({value})" if describe(plan.schedule).given_order else value
    hint = "" if "re-plan" in why else "; re-plan with --schedule 1F1B (and no --synthesize)"
    raise ExportError(f"{where}: the plan's schedule is {name}, but {why}{hint}, or plan with `autopp plan --for "
                      f"{trainer}`, which searches only what {trainer} runs")


def made_for(plan: Plan, trainer: str, compiles: bool = False) -> tuple[list[str], list[str]]:
    """`trainer`'s lines for what the plan was made for (autopp.data.trainers): the sequence length (`Trainer.seq_len`;
    a model built from an HF config records it, `Plan.hf_config`) and the precision recipe (`Plan.precision`, else
    its dtype's: autopp.data.precision), with a note for each the plan does not know (nothing is made up), and its
    elementwise kernels (`kernels_for`; `compiles`: the export compiles for another reason)."""
    rules, lines, notes = trainer_rules(trainer), [], []
    seq = plan.hf_config.get("seq_len")
    if rules.seq_len is not None and seq:
        lines.append(rules.seq_len.format(seq))
    elif rules.seq_len is not None:
        notes.append(f"no sequence length written ({rules.seq_len.format('S')}): the plan's model is a model file, "
                     "whose sequence length autopp does not know; give the length of the samples you profiled")
    recipe = plan_recipe(plan.precision, plan.dtype)
    if recipe is None:
        notes.append(f"no precision written: the plan records no dtype it was profiled in; {rules.title}'s default "
                     "applies")
    else:
        lines += getattr(recipe, trainer)
        notes += [recipe.torchtitan_note] if trainer == "torchtitan" and recipe.torchtitan_note else []
    kernel_lines, kernel_notes = kernels_for(plan, trainer, compiles)
    return lines + kernel_lines, notes + kernel_notes + outputs_notes(plan, trainer)


def outputs_notes(plan: Plan, trainer: str, title: str | None = None) -> list[str]:
    """Where `trainer` (called `title`, else its own title) keeps a pipeline stage's outputs otherwise than the plan
    counted them (`Plan.frees_outputs`, `Trainer.frees_outputs`): what that does to its memory, how to plan for it."""
    rules = trainer_rules(trainer)
    title = title or rules.title
    if len(plan.stages) < 2 or plan.frees_outputs == rules.frees_outputs:
        return []
    if plan.frees_outputs:
        return [f"stage outputs: the plan counts each freed once sent (as Megatron-LM frees them); {title} holds "
                "each microbatch's until its backward, more memory than the plan counts: plan with `autopp plan --for "
                f"{trainer}` to count it"]
    return [f"stage outputs: the plan counts each held until its backward (torch's PipelineStage); {title} "
            "frees them once sent, so its ranks need less memory than the plan says: plan with `autopp plan --for "
            f"{trainer}` to count that"]


def kernels_for(plan: Plan, trainer: str, compiles: bool = False) -> tuple[list[str], list[str]]:
    """`trainer`'s lines and notes for the elementwise kernels the plan's profile counted (`Plan.kernels`,
    autopp.measure.fusion): fused where the trainer fuses when told (torchtitan: torch.compile) is asked for (unless
    `compiles`: its lines compile already); where the trainer runs otherwise, what that does to its step
    (`kernels_words`)."""
    rules, note = trainer_rules(trainer), kernels_words(trainer, plan.kernels, compiles)
    lines = list(rules.fuse) if plan.kernels == "fused" and not compiles else []
    return lines, [note] if note else []


def optimizer_note(plan: Plan, trainer: str) -> str:
    """What the plan's memory counts of the optimizer (`Plan.optimizer`, the profile's), which no export writes, and
    what `trainer` trains with unless told (autopp.data.trainers.optimizer_words)."""
    return f"optimizer not written: {optimizer_words(trainer, plan.optimizer)}"


def loss_parallel_notes(plan: Plan, trainer: str) -> list[str]:
    """With tp > 1, how the plan counted the head against what `trainer` runs: torchtitan (its lm_head's output
    Shard(-1), torchtitan/models/common/decoder_sharding.py) and Megatron-LM (vocab-parallel cross-entropy) always
    keep the logits sharded on the vocabulary into the loss; a plan whose head gathers them (a model file's own
    loss, autopp.model.tp) holds more on its last stage than the trainer will."""
    if plan.layout.tp == 1:
        return []
    title = trainer_rules(trainer).title
    if LOSS_PARALLEL in plan.tp_plan.values():
        return [f"loss parallelism: the head's logits stay sharded on the vocabulary into the loss, as the plan counts "
                f"them and {title} runs them"]
    return [f"loss parallelism: {title} keeps the head's logits sharded on the vocabulary into the loss, where the "
            f"plan counts them gathered to full width on every TP rank, as its profile did (a model file's loss may "
            f"read them whole; an HF config's profile counted before loss parallelism): its last stage's memory and "
            f"time will differ from the prediction"]

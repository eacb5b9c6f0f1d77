"""autopp.export.overlap: what the plan's prediction hid under compute (`Plan.overlap`) is asked of each trainer, or
said where the trainer cannot hide it.

Review: the planner assumed by default (a catalog GPU) that the data-parallel gradient reduction hides under the last
backward "as Megatron with --overlap-grad-reduce", but the Megatron export never wrote that flag (off by default in
Megatron-LM), so the exported run exposed what the plan hid."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopp.data.layout import LayoutPins
from autopp.data.overlap import NO_OVERLAP, TRAINER_OVERLAP, Overlap
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.data.zero import ZERO
from autopp.export import Target, export_plan
from autopp.schedule import Activation

from .conftest import plan_for, unit_modules


def _megatron(plan: Plan) -> list[str]:
    return export_plan(plan, Target.MEGATRON, "x").text.splitlines()


def _gpu(plan: Plan, zero: int = 0, **layout: object) -> Plan:
    """`plan` as made for a catalog GPU before `Plan.overlap` was recorded (the planner's default then: the trainers'
    overlap), with ZeRO stage `zero`."""
    return replace(plan, device="h100-sxm", overlap=None, layout=replace(plan.layout, zero=ZERO[zero], **layout))


@pytest.mark.parametrize("zero, flags", [(0, ["--overlap-grad-reduce"]),
                                         (1, ["--overlap-grad-reduce", "--overlap-param-gather"])])
def test_megatron_overlaps_what_the_gpu_plan_hid(zero: int, flags: list[str], llama_plans: dict[str, Plan]) -> None:
    lines = _megatron(_gpu(llama_plans["dp"], zero))
    assert [line for line in lines if line.startswith("--overlap")] == flags
    if zero:  # Megatron-LM: --overlap-param-gather only with the distributed optimizer and --overlap-grad-reduce
        assert "--use-distributed-optimizer" in lines


def test_megatron_overlaps_nothing_the_plan_did_not_hide(llama_plans: dict[str, Plan]) -> None:
    """A CPU plan (nothing overlapped, recorded or by its device), a plan of `--overlap none`, and a plan without
    data parallelism write no overlap flag."""
    dp = llama_plans["dp"]
    assert dp.overlap == NO_OVERLAP  # the planner records its assumption (a cluster without a device kind)
    assert not any(line.startswith("--overlap") for line in _megatron(dp))
    assert not any(line.startswith("--overlap") for line in _megatron(replace(_gpu(dp, 1), overlap=NO_OVERLAP)))
    assert not any(line.startswith("--overlap") for line in _megatron(_gpu(llama_plans["1f1b"])))


def test_megatron_prefetches_megatron_fsdp_at_pp_1(llama: Profile) -> None:
    """ZeRO 3 at pp 1 runs as Megatron-FSDP: FSDP prefetch asks for both flags, even without `grad_reduce`."""
    base = plan_for(llama, pins=LayoutPins(pp=1, dp=2, zero=ZERO[3]), activations=(Activation.BLOCKS,))
    plan = replace(base, overlap=Overlap(fsdp_prefetch=True, grad_reduce=False))
    flags = [line for line in export_plan(plan, Target.MEGATRON, "x").text.splitlines()
             if line.startswith("--overlap")]
    assert flags == ["--overlap-grad-reduce", "--overlap-param-gather"]


def test_async_tp_is_asked_of_megatron_and_torchtitan(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    base = llama_plans["dp"]
    plan = replace(_gpu(base, 1, tp=2, sp=True), overlap=Overlap(async_tp=True))
    assert "--tp-comm-overlap" in _megatron(plan)
    titan = export_plan(plan, Target.TORCHTITAN, "x", [[m.replace("model.", "") for m in ms]
                                                       for ms in unit_modules(llama)])
    lines = titan.text.splitlines()
    assert "--compile.enable" in lines and "--compile.enable_async_tensor_parallel" in lines
    assert lines[-1].startswith("activation_checkpoint:")
    assert "--tp-comm-overlap" not in _megatron(replace(plan, overlap=TRAINER_OVERLAP))


def test_torchtitan_says_it_overlaps_by_default(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    gpu = export_plan(_gpu(llama_plans["dp"], 1), Target.TORCHTITAN, "x", modules)
    assert not any("compile" in line for line in gpu.text.splitlines())
    assert sum("overlaps the data-parallel gradient reduction with the backward by default" in n
               for n in gpu.notes) == 1
    cpu = export_plan(llama_plans["dp"], Target.TORCHTITAN, "x", modules)
    assert sum("its step may be shorter than predicted" in n for n in cpu.notes) == 1


def test_deepspeed_says_what_its_pipeline_engine_exposes(llama_plans: dict[str, Plan]) -> None:
    plan = _gpu(llama_plans["dp"], 1)
    hidden = plan.time_breakdown.sync_hidden_s if plan.time_breakdown is not None else None
    said = [n for n in export_plan(plan, Target.DEEPSPEED, "x.json").notes if "ReduceGrads" in n]
    assert len(said) == 1 and "re-plan with `autopp plan --overlap none`" in said[0]
    assert hidden is None or f"the {hidden:.3g} s of it" in said[0]
    assert not any("ReduceGrads" in n for n in export_plan(llama_plans["dp"], Target.DEEPSPEED, "x.json").notes)

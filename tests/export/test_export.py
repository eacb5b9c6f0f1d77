"""autopp.export without the trainers: what maps to what, what is refused (one line, why), no torch imported."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.export import ExportError, Target, default_output, export_plan, model_layers, rename_modules
from autopp.plan import Plan
from autopp.profile import Profile

from .conftest import unit_modules


def test_export_imports_no_torch() -> None:
    code = "import sys, autopp.export, autopp.export.pin, autopp.export.compare; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_layers_of_llama_and_gpt(llama: Profile, gpt: Profile) -> None:
    got = model_layers(llama.meta.unit_names, "x")
    assert (got.pre, got.blocks, got.post, got.container) == (0, (1, 2, 3, 4), 5, "model.layers")
    assert model_layers(gpt.meta.unit_names, "x").blocks == tuple(range(1, 7))
    with pytest.raises(ExportError, match="one stack of blocks"):
        model_layers(["emb", "enc.0", "enc.1", "dec.0", "head"], "x")


def test_torchtitan_parts_are_the_stages_modules(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans["interleaved"]
    modules = rename_modules(unit_modules(llama), [("model.embed_tokens", "tok_embeddings"), ("model.rotary_emb", ""),
                                                   ("model.layers", "layers"), ("model.norm", "norm"),
                                                   ("lm_head", "output")])
    text = export_plan(plan, Target.TORCHTITAN, "x.args", modules).text
    parts = [line for line in text.splitlines() if "module_fqns_per_model_part" in line][0].split()[1:]
    assert parts == ["tok_embeddings,layers.0", "layers.1,layers.2", "layers.3", "norm,output"]
    assert "--parallelism.pipeline_parallel_schedule=Interleaved1F1B" in text
    assert text.splitlines()[-1] == "activation_checkpoint:none"  # tyro takes the subcommand last


def test_torchtitan_refuses_nested_names_and_missing_modules(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    with pytest.raises(ExportError, match="--rename"):
        export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args", unit_modules(llama))
    with pytest.raises(ExportError, match="--profile"):
        export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args", None)


def test_torchtitan_dp_is_replicate_and_recompute_full(gpt: Profile) -> None:
    from .conftest import plan_for
    from autopp.solve import RecomputeMode
    plan = plan_for(gpt, devices=4, pp=2, dp=2, recompute=RecomputeMode.ALL)
    text = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(gpt)).text
    assert "--parallelism.data_parallel_replicate_degree=2" in text
    assert "--parallelism.data_parallel_shard_degree=1" in text
    assert f"--training.global_batch_size={plan.global_batch}" in text
    assert text.endswith("activation_checkpoint:full\n")


def test_custom_order_goes_through_the_csv(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    zbv = llama_plans["zbv"]
    order = tuple(tuple(str(a) for a in row) for row in _order(zbv))
    custom = replace(zbv, schedule="Custom", custom_order=order)
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    out = export_plan(custom, Target.TORCHTITAN, "/tmp/p.torchtitan.args", modules)
    assert "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble" in out.text  # torchtitan's V placement
    assert "--parallelism.pipeline_parallel_schedule_csv=/tmp/p.torchtitan.csv" in out.text
    assert out.extra["/tmp/p.torchtitan.csv"].splitlines()[0].split(",") == list(order[0])


def _order(plan: Plan) -> list[list[object]]:
    from autopp.predict import plan_order
    return [plan_order(plan)[r] for r in range(plan.pp)]


def test_megatron_layout_places_embedding_and_loss(llama_plans: dict[str, Plan]) -> None:
    text = export_plan(llama_plans["interleaved"], Target.MEGATRON, "x").text
    assert "--pipeline-model-parallel-layout Et|tt|t|L\n" in text
    assert "--num-layers 4\n" in text and "--global-batch-size 8\n" in text


@pytest.mark.parametrize("target", [Target.MEGATRON, Target.DEEPSPEED])
def test_v_schedules_are_refused_with_the_reason(target: Target, llama_plans: dict[str, Plan]) -> None:
    with pytest.raises(ExportError, match="ZBVZeroBubble.*runs only") as info:
        export_plan(llama_plans["zbv"], target, "x")
    assert "\n" not in str(info.value)


def test_some_stages_recomputing_is_refused(llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans["1f1b"]
    mixed = replace(plan, stages=(replace(plan.stages[0], recompute=True), *plan.stages[1:]))
    for target in (Target.MEGATRON, Target.DEEPSPEED):
        with pytest.raises(ExportError, match=r"only stages \[0\] of 2 recompute"):
            export_plan(mixed, target, "x")


def test_deepspeed_config_and_parts(llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans["dp"]
    out = export_plan(plan, Target.DEEPSPEED, "/tmp/x.deepspeed.json")
    assert list(out.extra) == ["/tmp/x_deepspeed_pipe.py"]  # importable: no dots in the module name
    cfg = json.loads(out.text)
    assert cfg["train_batch_size"] == plan.global_batch == 8
    assert cfg["gradient_accumulation_steps"] == plan.num_microbatches
    assert "PARTS = [0, 4, 6]" in out.extra["/tmp/x_deepspeed_pipe.py"]
    assert "activation_checkpoint_interval=1" in out.extra["/tmp/x_deepspeed_pipe.py"]


def test_cli_export_writes_files_and_refuses_in_one_line(tmp_path: Path, llama_plans: dict[str, Plan],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = llama_plans["zbv"].save(tmp_path / "m.plan.json")
    assert main(["export", str(plan_path), "--to", "torch-csv"]) == 0
    assert default_output(plan_path, Target.TORCH_CSV) == tmp_path / "m.schedule.csv"
    assert (tmp_path / "m.schedule.csv").read_text().startswith("0F0")
    capsys.readouterr()
    assert main(["export", str(plan_path), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "m.plan.json" in err[0] and "runs only 1F1B" in err[0]
    assert not (tmp_path / "m.megatron.args").exists()

"""autopp.export without the trainers: what maps to what, what is refused (one line, why), no torch imported."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.export import ExportError, Target, default_output, export_plan, model_layers, rename_modules
from autopp.data.layout import Layout, LayoutPins
from autopp.data.overlap import Overlap
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.data.vocab import VocabVariant
from autopp.data.zero import ZERO
from autopp.schedule import Action, Activation, ScheduleName

from .conftest import unit_modules


@pytest.mark.integration
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
    wrapped = [[f"net.{m}" for m in ms] for ms in unit_modules(llama)]  # a wrapper module: not an HF decoder's names
    with pytest.raises(ExportError, match="'net.model.embed_tokens'.*--rename"):
        export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args", wrapped)
    with pytest.raises(ExportError, match="--profile"):
        export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args", None)


# Issue 26, point 5: HF Llama / Qwen names were five hand-typed --rename flags; they are mapped automatically.
def test_torchtitan_maps_hf_decoder_names_itself(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    out = export_plan(llama_plans["interleaved"], Target.TORCHTITAN, "x.args", unit_modules(llama))
    parts = [line for line in out.text.splitlines() if "module_fqns_per_model_part" in line][0].split()[1:]
    assert parts == ["tok_embeddings,layers.0", "layers.1,layers.2", "layers.3", "norm,output"]
    assert any(n.startswith("module names: the HF decoder's mapped to torchtitan's") for n in out.notes)
    renamed = rename_modules(unit_modules(llama), [("model.layers", "blocks")])  # renamed first: written as renamed
    text = export_plan(llama_plans["interleaved"], Target.TORCHTITAN, "x.args", renamed).text
    assert "--parallelism.module_fqns_per_model_part model.embed_tokens,model.rotary_emb,blocks.0 " in text


def test_torchtitan_renames_apply_on_top_of_the_mapping(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """The tester's report: `--rename model.layers.3=blocks.3` turned the HF -> torchtitan mapping off (then
    refused the nested names, suggesting --rename model.layers=layers), and `--rename layers.3=blocks.3` (no such
    profiled module) was ignored without a word."""
    out = export_plan(llama_plans["interleaved"], Target.TORCHTITAN, "x.args", unit_modules(llama),
                      renames=[("model.layers.3", "blocks.3")])
    parts = [line for line in out.text.splitlines() if "module_fqns_per_model_part" in line][0].split()[1:]
    assert parts == ["tok_embeddings,layers.0", "layers.1,layers.2", "blocks.3", "norm,output"]
    assert any("--rename OLD=NEW renames profiled names on top of it" in n for n in out.notes)
    with pytest.raises(ExportError, match=r"^--rename layers.3=blocks.3: OLD 'layers.3' matches no profiled module "
                                          r"\(their names: 'model.embed_tokens' ... 'lm_head'\); OLD is a profiled "
                                          r"name or a prefix of whole dotted parts of one$"):
        export_plan(llama_plans["interleaved"], Target.TORCHTITAN, "x.args", unit_modules(llama),
                    renames=[("layers.3", "blocks.3")])


def test_torchtitan_dp_is_replicate_and_recompute_full(gpt: Profile) -> None:
    """torchtitan's full AC checkpoints each block: per-unit recomputation; it has no whole-stage checkpoint."""
    from .conftest import plan_for
    from autopp.solve import RecomputeMode
    plan = plan_for(gpt, devices=4, pins=LayoutPins(pp=2, dp=2), activations=(Activation.BLOCKS,))
    text = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(gpt)).text
    assert "--parallelism.data_parallel_replicate_degree=2" in text
    assert "--parallelism.data_parallel_shard_degree=1" in text
    assert f"--training.global_batch_size={plan.global_batch}" in text
    assert text.endswith("activation_checkpoint:full\n")
    whole = plan_for(gpt, devices=4, pins=LayoutPins(pp=2, dp=2), recompute=RecomputeMode.ALL)
    with pytest.raises(ExportError, match=r"activation policy recompute: torchtitan's activation_checkpoint:full wraps "
                                          r"each transformer block .*re-plan with `recompute` none, or with `autopp "
                                          r"plan --for torchtitan`, whose `recompute` auto gives every stage one of "
                                          r"the policies torchtitan applies \(keep, recompute-units, "
                                          r"selective-units\)"):
        export_plan(whole, Target.TORCHTITAN, "x.args", unit_modules(gpt))


def test_custom_order_goes_through_the_csv(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    zbv = llama_plans["zbv"]
    order = tuple(tuple(row) for row in _order(zbv))
    custom = replace(zbv, schedule=ScheduleName.CUSTOM, custom_order=order)
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    out = export_plan(custom, Target.TORCHTITAN, "/tmp/p.torchtitan.args", modules)
    assert "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble" in out.text  # torchtitan's V placement
    assert "--parallelism.pipeline_parallel_schedule_csv=p.torchtitan.csv" in out.text
    assert out.extra["/tmp/p.torchtitan.csv"].splitlines()[0].split(",") == [str(a) for a in order[0]]


def _order(plan: Plan) -> list[list[Action]]:
    from autopp.predict import plan_order
    return [plan_order(plan)[r] for r in range(plan.layout.pp)]


def test_megatron_layout_places_embedding_and_loss(llama_plans: dict[str, Plan]) -> None:
    text = export_plan(llama_plans["interleaved"], Target.MEGATRON, "x").text
    assert "--pipeline-model-parallel-layout Et|tt|t|L\n" in text
    assert "--num-layers 4\n" in text and "--global-batch-size 8\n" in text


@pytest.mark.parametrize("target", [Target.MEGATRON, Target.DEEPSPEED])
def test_v_schedules_are_refused_with_the_reason(target: Target, llama_plans: dict[str, Plan]) -> None:
    with pytest.raises(ExportError, match="ZBVZeroBubble.*runs only") as info:
        export_plan(llama_plans["zbv"], target, "x")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target", list(Target))
def test_chimera_is_refused_by_every_exporter_in_one_line(target: Target, llama: Profile,
                                                          llama_plans: dict[str, Plan]) -> None:
    plan = replace(llama_plans["1f1b"], schedule=ScheduleName.CHIMERA)
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)] if target is Target.TORCHTITAN \
        else None
    with pytest.raises(ExportError, match="the plan's schedule is Chimera") as info:
        export_plan(plan, target, "x", modules)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("target,why", [
    (Target.TORCHTITAN, "torchtitan keeps the embedding and the output layer whole"),
    (Target.MEGATRON, "Megatron-LM's --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-"
                      "split only count the embedding and the loss as a layer"),
    (Target.DEEPSPEED, "DeepSpeed's PipelineModule places the embedding and the head"),
])
def test_vocabulary_parallelism_is_refused_with_the_reason(target: Target, why: str, llama: Profile,
                                                          llama_plans: dict[str, Plan]) -> None:
    plan = replace(llama_plans["1f1b"], vocab=VocabVariant.VOCAB_2)
    with pytest.raises(ExportError, match=r"^plan: vocab vocab-2: " + re.escape(why)) as info:
        export_plan(plan, target, "x", unit_modules(llama))
    assert "\n" not in str(info.value) and "re-plan with `vocab` off" in str(info.value)


def test_some_stages_recomputing_is_refused(llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans["1f1b"]
    mixed = replace(plan, stages=(replace(plan.stages[0], activation=Activation.RECOMPUTE), *plan.stages[1:]))
    for target in (Target.MEGATRON, Target.DEEPSPEED):
        with pytest.raises(ExportError, match=r"policies differ \(keep: stages \[1\]; recompute: stages \[0\]\).*"
                                              r"re-plan with `recompute` none, or with `autopp plan --for"):
            export_plan(mixed, target, "x")


def test_selective_recomputation_as_each_trainer_spells_it(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """torchtitan's selective recomputation checkpoints block by block (`selective-units`, its op-level
    `activation_checkpoint:selective`); Megatron's recomputes submodules and DeepSpeed has none. A whole
    stage under one selective checkpoint (`selective`) is what no trainer runs: each export refuses it."""
    plan = llama_plans["1f1b"]
    selective = replace(plan, stages=tuple(replace(s, activation=Activation.SELECTIVE_UNITS) for s in plan.stages))
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    titan = export_plan(selective, Target.TORCHTITAN, "x.args", modules)
    assert titan.text.endswith("activation_checkpoint:selective\n")  # op-level: torchtitan 0.3's only selective mode
    assert any(n.startswith("torchtitan's selective AC: torchtitan's op-level policy also recomputes every second "
                            "matmul") for n in titan.notes)
    # Megatron's selective recomputation is another policy (submodules, core_attn by default): a tester's plan
    # "fit" in 53 GiB under autopp's selective-units where Megatron's would keep about keeping's 121 GiB
    with pytest.raises(ExportError, match=r"^plan: activation policy selective-units: Megatron-LM's "
                                          r"--recompute-granularity selective recomputes whole submodules .*; re-plan "
                                          r"with `recompute` none, or with `autopp plan --for megatron`"):
        export_plan(selective, Target.MEGATRON, "x")
    with pytest.raises(ExportError, match=r"^plan: activation policy selective-units: DeepSpeed's PipelineModule "
                                          r"checkpoints whole layers \(activation_checkpoint_interval\); it has no "
                                          r"op-level selective recomputation; re-plan with `recompute` none, or with "
                                          r"`autopp plan --for deepspeed`, .* \(keep, recompute-units\)"):
        export_plan(selective, Target.DEEPSPEED, "x")
    mixed = replace(selective, stages=(replace(selective.stages[0], activation=Activation.KEEP),
                                       *selective.stages[1:]))
    for target in (Target.MEGATRON, Target.DEEPSPEED):
        with pytest.raises(ExportError, match=r"policies differ \(keep: stages \[0\]; selective-units: stages "
                                              r"\[1\]\)"):
            export_plan(mixed, target, "x")
    whole = replace(plan, stages=tuple(replace(s, activation=Activation.SELECTIVE) for s in plan.stages))
    for target, why in ((Target.TORCHTITAN, r"torchtitan's activation_checkpoint:selective wraps each transformer "
                                            r"block \(per-unit selective recomputation, `selective-units`\)"),
                        (Target.MEGATRON, r"Megatron-LM's --recompute-granularity selective recomputes whole "
                                          r"submodules"),
                        (Target.DEEPSPEED, r"DeepSpeed's PipelineModule checkpoints whole layers")):
        with pytest.raises(ExportError, match=rf"^plan: activation policy selective: {why}.*; re-plan with "
                                              r"`recompute` none, or with `autopp plan --for .*recompute-units"):
            export_plan(whole, target, "x.args", modules if target is Target.TORCHTITAN else None)


def test_offload_is_refused_by_every_trainer_with_its_reason(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """torchtitan 0.3 has no activation offload, Megatron-Core's --cpu-offloading refuses pipeline parallelism, and
    DeepSpeed's cpu_checkpointing offloads the inputs of recomputation: each export says so in one line."""
    plan = llama_plans["1f1b"]
    offloaded = replace(plan, stages=tuple(replace(s, activation=Activation.OFFLOAD) for s in plan.stages))
    for target, why in ((Target.TORCHTITAN, "torchtitan 0.3 has no activation offload"),
                        (Target.MEGATRON, "Megatron-Core's --cpu-offloading refuses pipeline parallelism"),
                        (Target.DEEPSPEED, "DeepSpeed's cpu_checkpointing moves the inputs")):
        with pytest.raises(ExportError, match=rf"^plan: activation policy offload: {re.escape(why)}.*; re-plan with "
                                              r"`recompute` none, or with `autopp plan --for"):
            export_plan(offloaded, target, "x", [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)])


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


def test_target_names_spelt_out_for_the_parser_match_the_enum() -> None:
    from autopp.cli import TARGET_NAMES, _parser
    assert TARGET_NAMES == tuple(t.value for t in Target)
    export = _parser()._subparsers._group_actions[0].choices["export"]  # type: ignore[union-attr]
    assert next(a for a in export._actions if a.dest == "to").choices == TARGET_NAMES


def test_torchtitan_disables_cuda_graphs_with_pipeline_parallelism(llama: Profile,
                                                                   llama_plans: dict[str, Plan]) -> None:
    """Regression (issue 18 review): torchtitan 0.3's Trainer.Config refuses pp > 1 while CUDA graphs are on."""
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    assert "--training.disable_cuda_graphs\n" in export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x", modules).text


def test_torchtitan_keeps_module_dict_entries_by_key(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """torchtitan's _split_module keeps `container.key` for a top-level ModuleDict whatever the key; deeper names
    are refused."""
    modules = [[m.replace("model.", "").replace("layers.", "layers.blk") for m in ms] for ms in unit_modules(llama)]
    text = export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x", modules).text
    assert "layers.blk0" in text
    with pytest.raises(ExportError, match="'model.layers.0'"):
        export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x", rename_modules(unit_modules(llama),
                                                                                [("model.embed_tokens", "emb")]))


def test_torchtitan_csv_path_is_relative_to_the_export(llama: Profile, llama_plans: dict[str, Plan], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 26, point 5: the CSV was named by an absolute path; it is written beside the export and named by its
    file name there, whatever the working directory."""
    zbv = llama_plans["zbv"]
    order = tuple(tuple(row) for row in _order(zbv))
    custom = replace(zbv, schedule=ScheduleName.CUSTOM, custom_order=order)
    monkeypatch.chdir(tmp_path)
    out = export_plan(custom, Target.TORCHTITAN, "sub/p.torchtitan.args", unit_modules(llama))
    assert "--parallelism.pipeline_parallel_schedule_csv=p.torchtitan.csv\n" in out.text
    assert list(out.extra) == [str(Path("sub") / "p.torchtitan.csv")]
    assert any("named relative to the export (p.torchtitan.csv): launch torchtitan from the export's directory" in n
               for n in out.notes)


@pytest.mark.parametrize("out, module", [("my-model.deepspeed.json", "my_model_deepspeed_pipe"),
                                         ("1b.v2.deepspeed.json", "_1b_deepspeed_pipe")])
def test_deepspeed_snippet_is_importable(out: str, module: str, llama_plans: dict[str, Plan]) -> None:
    extra = export_plan(llama_plans["1f1b"], Target.DEEPSPEED, f"/tmp/{out}").extra
    assert list(extra) == [f"/tmp/{module}.py"] and module.isidentifier()


def test_megatron_refuses_interleaved_microbatches_it_cannot_group(llama: Profile) -> None:
    from autopp.data.cluster import Cluster
    from autopp.schedule import ScheduleName
    from autopp.solve import PlanRequest, make_plan
    odd = make_plan(llama, PlanRequest(cluster=Cluster(num_devices=2, memory_bytes=4 << 30), global_batch=3,
                                       num_microbatches=3, schedule=ScheduleName.INTERLEAVED_1F1B,
                                       pins=LayoutPins(v=2)))
    assert (odd.layout.pp, odd.layout.v, odd.num_microbatches) == (2, 2, 3)
    with pytest.raises(ExportError, match=r"groups of pp \(2\).* it is 3; re-plan with `num_microbatches` 4") as info:
        export_plan(odd, Target.MEGATRON, "x")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("flag, targets, says", [
    (["--rename", "model.layers=layers"], ["megatron", "deepspeed", "torch-csv"],
     "--rename applies to --to torchtitan only"),
    (["--profile", "profiles/x"], ["deepspeed", "torch-csv"], "--profile applies to --to torchtitan and megatron only")])
def test_cli_refuses_name_flags_where_names_are_not_used(flag: list[str], targets: list[str], says: str,
                                                         tmp_path: Path, llama_plans: dict[str, Plan],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = llama_plans["1f1b"].save(tmp_path / "m.plan.json")
    for target in targets:
        assert main(["export", str(plan_path), "--to", target, *flag]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.plan.json"]


def test_cli_checks_every_file_before_writing_any(tmp_path: Path, llama_plans: dict[str, Plan],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = llama_plans["1f1b"].save(tmp_path / "m.plan.json")
    (tmp_path / "m_deepspeed_pipe.py").mkdir()  # the snippet's path is taken by a directory
    assert main(["export", str(plan_path), "--to", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "m_deepspeed_pipe.py: is a directory" in err[0]
    assert not (tmp_path / "m.deepspeed.json").exists()


# ---- tensor parallelism and ZeRO (issue 17) ------------------------------------------------------------------------

LLAMA_TP_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}


def _3d(plan: Plan, tp: int = 2, zero: int = 0) -> Plan:
    """`plan` with tensor parallelism `tp` and ZeRO stage `zero` (the planner's own 3D plans are the lead's)."""
    return replace(plan, layout=replace(plan.layout, tp=tp, zero=ZERO[zero]), tp_plan=LLAMA_TP_PLAN if tp > 1 else {})


def test_megatron_unties_the_output_layer_where_the_hf_config_does(llama_plans: dict[str, Plan],
                                                                    tmp_path: Path) -> None:
    """Megatron-LM ties the output layer to the embedding unless given --untie-embeddings-and-output-weights
    (megatron/training/arguments.py): written where the plan's HF config says tie_word_embeddings false, not where
    it ties (or says nothing: transformers' default), a note where the config cannot be read."""
    flag = "--untie-embeddings-and-output-weights"
    configs = Path(__file__).resolve().parents[2] / "examples" / "configs"
    hf = {"seq_len": 64, "task": "causal-lm"}

    def export(path: Path, hf_config: dict[str, object]) -> tuple[list[str], str]:
        plan = replace(llama_plans["1f1b"], model_path=str(path), hf_config=hf_config)
        out = export_plan(plan, Target.MEGATRON, "x")
        return out.text.splitlines(), " ".join(out.notes)
    assert flag in export(configs / "llama-3-8b.json", hf)[0]  # "tie_word_embeddings": false
    assert flag not in export(configs / "llama-1b.json", hf)[0]  # true
    (tmp_path / "c.json").write_text('{"model_type": "llama"}')
    assert flag not in export(tmp_path / "c.json", hf)[0]
    assert flag not in export(configs / "llama-3-8b.json", {})[0]  # no HF config recorded: a model file's plan
    lines, notes = export(tmp_path / "gone.json", hf)
    assert flag not in lines and f"give {flag} if its tie_word_embeddings is false" in notes


def test_megatron_says_what_cuda_device_max_connections_must_be(llama_plans: dict[str, Plan]) -> None:
    """Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 with tp or cp above 1 (before Blackwell)
    and not 1 with Megatron-FSDP; the export's notes say which, and nothing where neither applies."""
    def notes(plan: Plan) -> str:
        return " ".join(export_plan(plan, Target.MEGATRON, "x").notes)
    assert "launch with CUDA_DEVICE_MAX_CONNECTIONS=1" in notes(_3d(llama_plans["dp"], tp=2))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in notes(_3d(llama_plans["dp"], tp=1))
    sharded, stages = _3d(llama_plans["dp"], tp=2, zero=3), llama_plans["dp"].stages
    flat = replace(sharded, layout=replace(sharded.layout, pp=1), stages=(replace(
        stages[0], units=(0, stages[-1].units[1]), unit_names=tuple(n for s in stages for n in s.unit_names)),))
    assert "CUDA_DEVICE_MAX_CONNECTIONS unset or above 1" in notes(flat)


def test_megatron_layout_works_from_the_file_and_pasted(llama_plans: dict[str, Plan], tmp_path: Path) -> None:
    """The file is read by `$(cat FILE)`, which keeps quotes, so the layout stays unquoted there (the shell does
    not take an expanded `|` for a pipe); the notes give the quoted line to paste, which bash reads as the same one
    word (unquoted, pasted, it was a pipe)."""
    out = export_plan(llama_plans["interleaved"], Target.MEGATRON, "x")
    layout = next(line.split(" ", 1)[1] for line in out.text.splitlines()
                  if line.startswith("--pipeline-model-parallel-layout "))
    assert "|" in layout and out.text.endswith("\n")
    (tmp_path / "x.args").write_text(out.text)
    via_cat = subprocess.run(["bash", "-c", "printf '%s\\n' $(cat x.args)"], cwd=tmp_path, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert via_cat[via_cat.index("--pipeline-model-parallel-layout") + 1] == layout
    pasted = next(n.split(": ", 1)[1] for n in out.notes if "quote the layout" in n)
    assert pasted == f"--pipeline-model-parallel-layout '{layout}'"
    run = subprocess.run(["bash", "-c", f"printf '%s\\n' {pasted}"], capture_output=True, text=True, check=True)
    assert run.stdout.splitlines() == ["--pipeline-model-parallel-layout", layout]


def test_deepspeed_stage_file_says_what_the_last_unit_holds(llama_plans: dict[str, Plan]) -> None:
    """The stage file listed the HF decoder's last layer as 'model.norm' alone, where that unit also holds lm_head
    and autopp timed the loss with it: its docstring says so."""
    snippet = export_plan(llama_plans["1f1b"], Target.DEEPSPEED, "x.json").extra["x_deepspeed_pipe.py"]
    assert llama_plans["1f1b"].stages[-1].unit_names[-1] == "model.norm"
    assert "the last, 'model.norm', holds every module after the previous one, the output layer included" in \
        " ".join(snippet.split())
    compile(snippet, "x_deepspeed_pipe.py", "exec")


def _titan(plan: Plan, llama: Profile) -> list[str]:
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    return export_plan(plan, Target.TORCHTITAN, "x", modules).text.splitlines()


@pytest.mark.parametrize("zero, shard", [(0, ["--parallelism.data_parallel_replicate_degree=2",
                                             "--parallelism.data_parallel_shard_degree=1"]),
                                         (1, ["--parallelism.data_parallel_replicate_degree=1",
                                              "--parallelism.data_parallel_shard_degree=2",
                                              "--parallelism.fsdp_reshard_after_forward=never"]),
                                         (3, ["--parallelism.data_parallel_replicate_degree=1",
                                              "--parallelism.data_parallel_shard_degree=2",
                                              "--parallelism.fsdp_reshard_after_forward=always"])])
def test_torchtitan_writes_tp_and_zero(zero: int, shard: list[str], llama: Profile,
                                       llama_plans: dict[str, Plan]) -> None:
    lines = _titan(_3d(llama_plans["dp"], zero=zero), llama)
    assert [line for line in lines if "data_parallel" in line or "reshard" in line] == shard
    assert "--parallelism.tensor_parallel_degree=2" in lines
    assert "--parallelism.no_enable_sequence_parallel" in lines  # torchtitan's default is SP on; autopp costs none
    assert "--training.global_batch_size=8" in lines and lines[-1].startswith("activation_checkpoint:")


def test_torchtitan_without_tp_writes_what_it_wrote_before(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    lines = _titan(llama_plans["dp"], llama)
    assert "--parallelism.tensor_parallel_degree=1" in lines
    assert not any("sequence_parallel" in line or "reshard" in line for line in lines)


def test_an_axis_planned_in_its_descriptor_reaches_every_exporter(monkeypatch: pytest.MonkeyPatch, llama: Profile,
                                                                  llama_plans: dict[str, Plan]) -> None:
    """Issue 24: the exporters spell the axes from their descriptors (autopp.data.axes) alone: context parallelism,
    once its descriptor says it is planned (issue 27), is written by torchtitan and Megatron-LM and refused by
    DeepSpeed, and no exporter names it."""
    from autopp.data import axes
    plan = replace(llama_plans["dp"], layout=replace(llama_plans["dp"].layout, cp=2))
    titan = _titan(replace(plan, layout=replace(plan.layout, zero=ZERO[1])), llama)  # torchtitan shards beside cp
    assert "--parallelism.context_parallel_degree=2" in titan and "--parallelism.tensor_parallel_degree=1" in titan
    megatron = export_plan(plan, Target.MEGATRON, "x")
    assert megatron.text.splitlines()[:2] == ["--context-parallel-size 2", "--tensor-model-parallel-size 1"]
    assert "(world size pp 2 x dp 2 x cp 2 x tp 1;" in megatron.notes[0]
    with pytest.raises(ExportError, match=r"^plan: cp 2: DeepSpeed's PipelineModule does not shard sequences .*"
                                          r"re-plan with `cp` 1, or export to torchtitan or megatron$"):
        export_plan(plan, Target.DEEPSPEED, "x.json")
    monkeypatch.setitem(axes.AXES, "cp", replace(axes.AXES["cp"], unplanned="issue 27"))  # as before it
    assert "context_parallel" not in "".join(_titan(llama_plans["dp"], llama))  # unplanned: written by no one


def test_megatron_writes_tp_and_the_distributed_optimizer(llama_plans: dict[str, Plan]) -> None:
    lines = export_plan(_3d(llama_plans["dp"], zero=1), Target.MEGATRON, "x").text.splitlines()
    assert "--tensor-model-parallel-size 2" in lines and "--use-distributed-optimizer" in lines
    assert "--use-distributed-optimizer" not in export_plan(_3d(llama_plans["dp"]), Target.MEGATRON, "x").text


def test_sequence_parallelism_is_spelt_by_its_switch(monkeypatch: pytest.MonkeyPatch, llama: Profile,
                                                     llama_plans: dict[str, Plan]) -> None:
    """Issue 25 item 1: with `sp` Megatron gets --sequence-parallel and torchtitan its own switch, on (its default,
    written since issue 26 so that the export says it); without, torchtitan's is turned off; DeepSpeed refuses tensor
    parallelism before it (and SP with it)."""
    tp = _3d(llama_plans["dp"], zero=1)
    sp = replace(tp, layout=replace(tp.layout, sp=True))
    megatron = export_plan(sp, Target.MEGATRON, "x")
    assert megatron.text.splitlines()[:3] == ["--context-parallel-size 1", "--tensor-model-parallel-size 2",
                                              "--sequence-parallel"]
    assert any(n.startswith("sequence parallelism: Megatron's --sequence-parallel") for n in megatron.notes)
    assert "--sequence-parallel" not in export_plan(tp, Target.MEGATRON, "x").text
    assert "no sequence parallelism, as autopp costed it" in export_plan(tp, Target.MEGATRON, "x").notes
    titan, plain = _titan(sp, llama), _titan(tp, llama)
    assert "--parallelism.tensor_parallel_degree=2" in titan and "--parallelism.enable_sequence_parallel" in titan
    assert "--parallelism.no_enable_sequence_parallel" in plain
    assert [x for x in plain if x != "--parallelism.no_enable_sequence_parallel"] == \
        [x for x in titan if x != "--parallelism.enable_sequence_parallel"]
    with pytest.raises(ExportError, match=r"^plan: tp 2: DeepSpeed's PipelineModule does not shard layers"):
        export_plan(sp, Target.DEEPSPEED, "x.json")
    from autopp.data import axes
    from autopp.export.common import refuse_layout
    no_refusal = {**axes.AXES["tp"].trainers, "deepspeed": axes.Spelling()}
    monkeypatch.setitem(axes.AXES, "tp", replace(axes.AXES["tp"], trainers=no_refusal))
    with pytest.raises(ExportError, match=r"^plan: sp on: DeepSpeed's pipeline engine has no sequence parallelism "):
        refuse_layout(sp, "deepspeed", "plan")
    refuse_layout(tp, "deepspeed", "plan")  # off: nothing to refuse


def test_megatron_zero3_only_without_pipeline(llama_plans: dict[str, Plan]) -> None:
    with pytest.raises(ExportError, match=r"zero 3 with pp 2: .*--use-torch-fsdp2 asserts") as info:
        export_plan(_3d(llama_plans["dp"], zero=3), Target.MEGATRON, "x")
    assert "\n" not in str(info.value)
    from autopp.export.megatron import data_parallel_flags
    sharded = _3d(llama_plans["dp"], zero=3)
    flat = replace(sharded, layout=replace(sharded.layout, pp=1),
                   stages=(replace(llama_plans["dp"].stages[0], units=(0, 6)),))
    assert data_parallel_flags(flat) == ["--use-megatron-fsdp", "--data-parallel-sharding-strategy optim_grads_params",
                                         "--use-distributed-optimizer", "--ckpt-format fsdp_dtensor"]


def test_deepspeed_writes_zero1_and_refuses_what_its_pipeline_engine_cannot_run(llama_plans: dict[str, Plan]) -> None:
    plan = _3d(llama_plans["dp"], tp=1, zero=1)
    assert json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)["zero_optimization"] == {"stage": 1}
    for bad, match in [(_3d(llama_plans["dp"], tp=1, zero=3), "zero 3: DeepSpeed's PipelineEngine runs ZeRO stage 0 or 1"),
                       (_3d(llama_plans["dp"], tp=2), "tp 2: DeepSpeed's PipelineModule does not shard layers")]:
        with pytest.raises(ExportError, match=match) as info:
            export_plan(bad, Target.DEEPSPEED, "x.json")
        assert "\n" not in str(info.value)


def test_deepspeed_refuses_zero3_at_pp1_for_its_true_reason(llama: Profile) -> None:
    """The tester's report: a pp 1 ZeRO 3 plan was refused for pipeline parallelism it does not have; the true
    reason is that the export builds a one-stage PipelineModule, which deepspeed.initialize runs with its
    PipelineEngine."""
    from .conftest import plan_for
    plan = plan_for(llama, devices=2, pins=LayoutPins(pp=1, dp=2, tp=1, zero=ZERO[3]))
    assert plan.layout.pp == 1
    with pytest.raises(ExportError, match=r"^plan: zero 3: autopp's DeepSpeed export builds the model as a "
                                          r"PipelineModule at pp 1 too \(one stage\), and deepspeed.initialize runs "
                                          r"a PipelineModule with its PipelineEngine, which runs ZeRO stage 0 or 1 "
                                          r"only .*; re-plan with `zero` 1$"):
        export_plan(plan, Target.DEEPSPEED, "x.json")


@pytest.mark.parametrize("target", [Target.TORCHTITAN, Target.MEGATRON, Target.DEEPSPEED])
def test_zero2_is_refused_by_every_trainer(target: Target, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """ZeRO 2 is plan-only (docs/parallelism.md): no trainer runs it beside pipeline parallelism."""
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    with pytest.raises(ExportError, match=r"^x.plan: zero 2: .*re-plan with `zero` 1") as info:
        export_plan(_3d(llama_plans["dp"], tp=1, zero=2), target, "x", modules, where="x.plan")
    assert "\n" not in str(info.value)


def test_cli_export_refuses_zero2_in_one_line(tmp_path: Path, llama_plans: dict[str, Plan],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    plan_path = _3d(llama_plans["dp"], tp=1, zero=2).save(tmp_path / "m.plan.json")
    assert main(["export", str(plan_path), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "m.plan.json: zero 2:" in err[0] and err[0].endswith("re-plan with --zero 1")
    assert not (tmp_path / "m.megatron.args").exists()


def test_cli_export_reads_the_profile_the_plan_records(tmp_path: Path, llama_plans: dict[str, Plan],
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A plan saved with `profile_path` (as `autopp plan` writes it, relative to the plan) exports its module names
    without --profile, from wherever the plan and its profile are moved together."""
    from .conftest import LLAMA
    from autopp.data.plan import load_plan
    from autopp.data.profile import load_profile
    folder = tmp_path / "job"
    load_profile(LLAMA).save(folder / "profiles" / "llama")
    plan_path = replace(llama_plans["1f1b"], profile_path=str(folder / "profiles" / "llama")).save(
        folder / "m.plan.json")
    assert json.loads(plan_path.read_text())["profile_path"] == "profiles/llama"
    moved = tmp_path / "moved"
    folder.rename(moved)
    assert load_plan(moved / "m.plan.json").profile_path == str((moved / "profiles" / "llama").resolve())
    assert main(["export", str(moved / "m.plan.json"), "--to", "torchtitan"]) == 0  # HF names mapped, no --rename
    text = (moved / "m.torchtitan.args").read_text()
    assert "--parallelism.module_fqns_per_model_part tok_embeddings,layers." in text and ",norm,output\n" in text
    assert main(["export", str(moved / "m.plan.json"), "--to", "megatron"]) == 0  # its live values checked
    assert "were not checked" not in capsys.readouterr().err
    assert "profile_path" not in llama_plans["1f1b"].to_json()  # not recorded: not written


def test_expert_parallelism_exports_with_the_profiles_routing(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 30: ep above 1 is written with the routing facts the profile records (meta.extra["moe"]): Megatron's
    --expert-model-parallel-size, --num-experts, --moe-router-topk and its all-to-all dispatcher, torchtitan's
    expert_parallel_degree; not a factor of the launched world size; without the facts Megatron's export is refused
    in one line; DeepSpeed refuses ep."""
    plan = replace(llama_plans["dp"], layout=replace(llama_plans["dp"].layout, ep=2))
    moe = {"num_experts": 8, "top_k": 2}
    megatron = export_plan(plan, Target.MEGATRON, "x", moe=moe)
    lines = megatron.text.splitlines()
    assert lines[2:6] == ["--expert-model-parallel-size 2", "--num-experts 8", "--moe-router-topk 2",
                          "--moe-token-dispatcher-type alltoall"]
    assert "(world size pp 2 x dp 2 x cp 1 x tp 1;" in megatron.notes[0]
    assert any("all-to-all dispatcher" in n for n in megatron.notes)
    with pytest.raises(ExportError, match=r"^plan: ep 2: megatron needs --num-experts, and the profile the plan was "
                                          r"made from records no num_experts: profile the model again"):
        export_plan(plan, Target.MEGATRON, "x")
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    sharded = replace(plan, layout=replace(plan.layout, zero=ZERO[1]))  # torchtitan carves ep from dp_shard
    titan = export_plan(sharded, Target.TORCHTITAN, "x", modules, moe=moe).text.splitlines()
    assert "--parallelism.expert_parallel_degree=2" in titan
    with pytest.raises(ExportError, match=r"^plan: zero 0 with ep 2: torchtitan carves the ep ranks from dp_shard "):
        export_plan(plan, Target.TORCHTITAN, "x", modules, moe=moe)
    with pytest.raises(ExportError, match=r"^plan: ep 2: the exported stage file builds no expert parallelism "
                                          r"\(DeepSpeed's MoE layers take their own ep_size\); re-plan with `ep` 1"):
        export_plan(plan, Target.DEEPSPEED, "x.json")
    # ep 1: the model's facts alone (Megatron builds MoE layers from --num-experts), nothing for a dense model
    assert export_plan(llama_plans["dp"], Target.MEGATRON, "x", moe=moe).text.splitlines()[2:4] == [
        "--num-experts 8", "--moe-router-topk 2"]
    assert "expert" not in export_plan(llama_plans["dp"], Target.MEGATRON, "x").text
    assert "dispatcher" not in export_plan(llama_plans["dp"], Target.MEGATRON, "x", moe=moe).text


def test_a_group_limited_routing_exports_its_groups_to_megatron(llama_plans: dict[str, Plan]) -> None:
    """DeepSeek-V3's routing (top-k within `group_top_k` of `num_groups` expert groups, the profile's extra.moe from
    its config's n_group / topk_group) is Megatron's --moe-router-num-groups / --moe-router-group-topk; a routing
    that is not group-limited (None) or a profile from before the facts writes neither; the note names DeepEP."""
    plan = replace(llama_plans["dp"], layout=replace(llama_plans["dp"].layout, ep=2))
    facts = {"num_experts": 8, "top_k": 2, "num_groups": 4, "group_top_k": 2}
    megatron = export_plan(plan, Target.MEGATRON, "x", moe=facts)
    assert megatron.text.splitlines()[2:8] == [
        "--expert-model-parallel-size 2", "--num-experts 8", "--moe-router-topk 2", "--moe-router-num-groups 4",
        "--moe-router-group-topk 2", "--moe-token-dispatcher-type alltoall"]
    assert any("--moe-flex-dispatcher-backend deepep" in n for n in megatron.notes)
    for moe in ({**facts, "num_groups": None, "group_top_k": None}, {"num_experts": 8, "top_k": 2}):
        assert "groups" not in export_plan(plan, Target.MEGATRON, "x", moe=moe).text


def test_expert_tensor_parallelism_exports_to_megatron_alone(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 24's proof axis: etp above 1 is written by its descriptor with no exporter change: Megatron-Core's
    --expert-tensor-parallel-size after ep's lines (and --disable-bias-linear), with its note; torchtitan (whose key took only 1 or tp) and
    DeepSpeed refuse it in one line; a plan without it writes nothing of it."""
    dp4 = replace(llama_plans["dp"], layout=Layout(pp=2, dp=4))
    plan = replace(dp4, layout=replace(dp4.layout, ep=2, etp=2))
    moe = {"num_experts": 8, "top_k": 2}
    megatron = export_plan(plan, Target.MEGATRON, "x", moe=moe)
    lines = megatron.text.splitlines()
    assert lines[2:8] == ["--expert-model-parallel-size 2", "--num-experts 8", "--moe-router-topk 2",
                          "--moe-token-dispatcher-type alltoall", "--expert-tensor-parallel-size 2",
                          "--disable-bias-linear"]  # megatron-core runs etp > 1 only without linear biases
    assert any("MoE Parallel Folding" in n for n in megatron.notes)
    modules = [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]
    with pytest.raises(ExportError, match=r"^plan: etp 2: torchtitan's expert_tensor_parallel_degree takes only 1 or "
                                          r"the tensor-parallel degree .*re-plan with `etp` 1, or export to megatron$"):
        export_plan(plan, Target.TORCHTITAN, "x", modules, moe=moe)
    with pytest.raises(ExportError, match=r"^plan: ep 2: .*re-plan with `ep` 1"):  # ep's refusal first: etp needs ep
        export_plan(plan, Target.DEEPSPEED, "x.json")
    assert "expert-tensor" not in export_plan(replace(dp4, layout=replace(dp4.layout, ep=2)), Target.MEGATRON, "x",
                                              moe=moe).text


# ---- what the plan was made for (issue 26, point 5) ---------------------------------------------------------------

HF_LLAMA = {"seq_len": 64, "task": "causal-lm", "model_type": "llama"}


def _as_hf(plan: Plan, dtype: str = "bfloat16", task: str = "causal-lm") -> Plan:
    """`plan` as a plan of an HF config profiled in `dtype` records it (`hf_config`, `dtype`)."""
    return replace(plan, hf_config={**HF_LLAMA, "task": task}, dtype=dtype)


def test_exports_carry_the_sequence_length_and_the_precision(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """The export said "set training.seq_len ... yourself" and wrote no dtype; the plan knows both."""
    plan = _as_hf(llama_plans["1f1b"])
    titan = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama))
    lines = titan.text.splitlines()
    assert {"--training.seq_len=64", "--training.dtype=float32", "--training.mixed_precision_param=bfloat16",
            "--training.mixed_precision_reduce=float32"} <= set(lines)
    assert not any("seq_len" in n or "yourself" in n for n in titan.notes)
    megatron = export_plan(plan, Target.MEGATRON, "x")
    assert {"--seq-length 64", "--bf16"} <= set(megatron.text.splitlines())
    assert not any("seq-length" in n for n in megatron.notes)
    assert json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)["bf16"] == {"enabled": True}
    fp32 = _as_hf(llama_plans["1f1b"], dtype="float32")
    assert "--training.mixed_precision_param=float32" in export_plan(fp32, Target.TORCHTITAN, "x.args",
                                                                     unit_modules(llama)).text
    assert "--bf16" not in export_plan(fp32, Target.MEGATRON, "x").text
    assert "bf16" not in export_plan(fp32, Target.DEEPSPEED, "x.json").text


def test_fp8_plans_spell_the_recipe_and_deepspeed_refuses_it(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """An FP8 plan: Megatron's hybrid format and tensorwise recipe beside --bf16, torchtitan's bf16 overrides and a
    note with its Python-only Float8 converter, and one line from DeepSpeed, whose config has no FP8."""
    plan = replace(_as_hf(llama_plans["1f1b"]), precision="fp8")
    megatron = export_plan(plan, Target.MEGATRON, "x").text.splitlines()
    assert {"--bf16", "--fp8-format hybrid", "--fp8-recipe tensorwise"} <= set(megatron)
    titan = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama))
    assert "--training.mixed_precision_param=bfloat16" in titan.text.split()
    assert any("Float8LinearConverter.Config(recipe_name=\"rowwise\")" in n for n in titan.notes)
    assert not any("Float8" in n for n in export_plan(_as_hf(llama_plans["1f1b"]), Target.TORCHTITAN, "x.args",
                                                      unit_modules(llama)).notes)
    with pytest.raises(ExportError, match=r"^plan: precision fp8: DeepSpeed's config has no FP8 training .*"
                                          r"count the profile again with `precision` bf16 .*then re-plan$"):
        export_plan(plan, Target.DEEPSPEED, "x.json")
    assert "--fp8-format hybrid" not in export_plan(_as_hf(llama_plans["1f1b"]), Target.MEGATRON, "x").text


def test_a_plan_of_fused_kernels_asks_torchtitan_to_compile_and_says_what_the_others_run(
        llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """`Plan.kernels` (the analytic profile's): fused asks torchtitan for torch.compile (once, with async TP too) and
    tells DeepSpeed's user it runs the model's own kernels; eager tells Megatron-LM's user it fuses by default;
    where the trainer runs what the plan counted, or the plan does not know, nothing is said."""
    plan = _as_hf(llama_plans["1f1b"])
    fused, eager = replace(plan, kernels="fused"), replace(plan, kernels="eager")
    titan = export_plan(fused, Target.TORCHTITAN, "x.args", unit_modules(llama))
    assert titan.text.splitlines().count("--compile.enable") == 1
    assert any("counted fused elementwise kernels" in n and "torch.compile" in n for n in titan.notes)
    for quiet, target in ((plan, Target.TORCHTITAN), (eager, Target.TORCHTITAN), (plan, Target.MEGATRON),
                          (fused, Target.MEGATRON), (eager, Target.DEEPSPEED)):
        exported = export_plan(quiet, target, "x.args" if target is Target.TORCHTITAN else "x",
                               *((unit_modules(llama),) if target is Target.TORCHTITAN else ()))
        assert "--compile.enable" not in exported.text and not any("elementwise kernels" in n
                                                                   for n in exported.notes), (quiet.kernels, target)
    megatron = export_plan(eager, Target.MEGATRON, "x")
    assert any("Megatron-Core fuses them (" in n and "--transformer-impl transformer_engine" in n for n in megatron.notes)
    deepspeed = export_plan(fused, Target.DEEPSPEED, "x.json")
    assert any("its step takes longer and its activations take more memory than predicted" in n
               for n in deepspeed.notes)
    tp = _as_hf(llama_plans["dp"])  # tp 2 with SP: async TP compiles the model, so eager kernels run fused
    tp = replace(tp, layout=replace(tp.layout, tp=2, sp=True), tp_plan={"model.layers.*.mlp.up_proj": "colwise"})
    async_tp = replace(tp, overlap=Overlap(async_tp=True))
    for kernels, says in (("eager", "its step may be shorter and its activations smaller than predicted"),
                          ("fused", None)):
        exported = export_plan(replace(async_tp, kernels=kernels), Target.TORCHTITAN, "x.args", unit_modules(llama))
        assert exported.text.splitlines().count("--compile.enable") == 1, kernels
        assert [n for n in exported.notes if "elementwise kernels" in n] == \
            ([] if says is None else [next(n for n in exported.notes if says in n)]), kernels
    assert Plan.from_json(fused.to_json()).kernels == "fused" and "kernels" not in plan.to_json()


def test_pure_bf16_plans_are_torchtitans_bf16_training_dtype_and_refused_elsewhere(
        llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """A bf16-pure plan (bf16 weights, gradients and Adam state, no master copy): torchtitan's `training.dtype`
    bfloat16 with bf16 compute; Megatron-LM and DeepSpeed keep a master copy whatever their flags, so one line each
    (autopp.data.precision)."""
    plan = replace(_as_hf(llama_plans["1f1b"]), precision="bf16-pure")
    titan = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama)).text.split()
    assert {"--training.dtype=bfloat16", "--training.mixed_precision_param=bfloat16"} <= set(titan)
    assert "--training.dtype=float32" not in titan
    for target, says in ((Target.MEGATRON, r"Megatron-LM keeps a master copy beside bf16 weights \(its --main-params"),
                         (Target.DEEPSPEED, r"DeepSpeed keeps a master copy beside bf16 weights")):
        with pytest.raises(ExportError, match=rf"^plan: precision bf16-pure: {says}.*count the profile again with "
                                              r"`precision` bf16 .*then re-plan$"):
            export_plan(plan, target, "x.json")

def test_what_the_plan_does_not_know_is_said(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """A model file's plan has no sequence length; a plan of the Python API no dtype: each is said in a note, and
    nothing is made up."""
    plan = replace(llama_plans["1f1b"], dtype=None)
    titan = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama))
    assert "seq_len" not in titan.text and "mixed_precision" not in titan.text
    assert any(n.startswith("no sequence length written (--training.seq_len=S): the plan's model is a model file")
               for n in titan.notes)
    assert "no precision written: the plan records no dtype it was profiled in; torchtitan's default applies" in \
        titan.notes
    megatron = export_plan(plan, Target.MEGATRON, "x")
    assert "--seq-length" not in megatron.text
    assert any(n.startswith("no sequence length written (--seq-length S)") for n in megatron.notes)


def test_megatron_refuses_a_model_with_a_skip_and_says_which_check(llama: Profile,
                                                                   llama_plans: dict[str, Plan]) -> None:
    from autopp.data.profile_values import LiveValue, ValueAction
    plan = llama_plans["1f1b"]
    skip = LiveValue(name="add_3", src=1, dsts=(2, 4), action=ValueAction.RELAY, relayed_over=(2, 3))
    with pytest.raises(ExportError, match=r"^plan: Megatron-LM's pretrain_gpt.py builds a GPT whose layers pass one "
                                          r"hidden state each to the next, but unit 4 \(model.layers.3\) reads "
                                          r"'add_3' of unit 1 \(model.layers.0\), 2 units back \(a skip connection: "
                                          r"the profile's live values\); run it with autopp run"):
        export_plan(plan, Target.MEGATRON, "x", values=(skip,))
    export_plan(plan, Target.MEGATRON, "x", values=llama.meta.live_values)  # its rotary tables are recomputed: fine
    with pytest.raises(ExportError, match=r"^plan: Megatron-LM's pretrain_gpt.py trains a GPT decoder .* the "
                                          r"model is a seq-cls model"):
        export_plan(_as_hf(plan, task="seq-cls"), Target.MEGATRON, "x")
    assert any("were not checked (no profile of the plan found)" in n
               for n in export_plan(plan, Target.MEGATRON, "x").notes)


@pytest.mark.integration
def test_a_cnn_with_a_long_skip_is_refused_by_megatron(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's case: a hand-written CNN whose units look like a layer stack was exported as pretrain_gpt.py
    arguments without complaint; the export now reads the profile's live values and refuses it in one line."""
    from .conftest import ROOT
    model, profile = ROOT / "tests" / "models" / "skipcnn.py", tmp_path / "skipcnn"
    assert main(["profile", str(model), "--analytic", "h100-sxm", "-o", str(profile)]) == 0
    plan = tmp_path / "skipcnn.plan.json"
    assert main(["plan", "--profile", str(profile), "--devices", "2", "--memory", "80GiB", "--global-batch", "8",
                 "--schedule", "1F1B", "--dp", "1", "--recompute", "none", "-o", str(plan)]) == 0  # Megatron runs it
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unit 4 (blocks.3) reads 'submod_pp_0' of unit 0 (stem), 3 units back (a skip " \
        "connection: the profile's live values)" in err[0]
    assert not (tmp_path / "skipcnn.megatron.args").exists()


def test_torchtitan_refuses_whole_replicas_beside_cp(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Review: torchtitan turns FSDP on whenever cp > 1 (`ParallelDims.fsdp_enabled`: dp_shard > 1 or cp > 1),
    sharding over dp_shard x cp, so a plan of ZeRO 0 beside cp (whole replicas, as autopp costed them) is refused
    in one line; Megatron-LM runs it (its DDP beside --context-parallel-size)."""
    base = llama_plans["dp"]
    plan = replace(base, layout=replace(base.layout, cp=2))
    with pytest.raises(ExportError, match=r"^plan: zero 0 with cp 2: torchtitan shards over dp_shard x cp whenever "
                                          r"cp > 1 \(ParallelDims.fsdp_enabled: .*; re-plan with `zero` 1 or 3, or "
                                          r"`cp` 1$"):
        export_plan(plan, Target.TORCHTITAN, "x", [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)])
    assert export_plan(plan, Target.MEGATRON, "x").text.startswith("--context-parallel-size 2\n")


def test_every_export_says_which_optimizer_the_plans_memory_counts(llama: Profile, llama_plans: dict[str, Plan]
                                                                   ) -> None:
    """A new user's: the plan counted SGD's state (a CPU profile) while the trainers default to Adam(W), and no
    export said so. Each says what the memory counts and what the trainer trains with; where the two differ, how to
    plan for Adam(W)."""
    plan = llama_plans["1f1b"]
    for target, modules, trains in ((Target.TORCHTITAN, unit_modules(llama), "torchtitan trains with AdamW"),
                                    (Target.MEGATRON, None, "Megatron-Core trains with Adam with decoupled"),
                                    (Target.DEEPSPEED, None, "trains with the optimizer given to deepspeed.initialize")):
        for name, again in (("sgd", True), ("adamw", False), (None, True)):
            notes = export_plan(replace(plan, optimizer=name), target, "x.out", modules).notes
            said = [n for n in notes if n.startswith("optimizer not written: the plan's memory counts ")]
            assert len(said) == 1 and trains in said[0], (target, name, notes)
            assert (f"{name}'s state" if name else "an optimizer the plan does not record") in said[0]
            assert ("profile again with --optimizer adamw" in said[0]) is again


def test_for_megatron_refuses_before_planning_what_its_export_would(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A tester: `autopp plan --profile profiles/mlp --for megatron` wrote a plan (exit 0) that `autopp export --to
    megatron` then refused (no numbered blocks); the plan refuses it first, one line, nothing written
    (`trainer_model_problem`), and the other trainers, which take the units as they are, plan it."""
    from autopp.cli import main
    from .conftest import ROOT
    common = ["plan", "--profile", str(ROOT / "profiles" / "mlp"), "--devices", "2", "--memory", "1GiB"]
    assert main([*common, "--for", "megatron", "-o", str(tmp_path / "m.json")]) == 2
    assert "--for megatron: no unit is a numbered block (like layers.0)" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    assert main([*common, "--for", "deepspeed", "-o", str(tmp_path / "d.json")]) == 0


def test_a_plan_past_its_profiles_units_is_refused(llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """A tester's hand-edited plan (a stage to unit 10 of 8) crashed torchtitan's export with an IndexError."""
    plan = llama_plans["1f1b"]
    last = plan.stages[-1]
    edited = replace(plan, stages=(*plan.stages[:-1], replace(last, units=(last.units[0], last.units[1] + 2))))
    with pytest.raises(ExportError, match=rf"^plan: the stages end at unit {last.units[1] + 1}, and the profile has "
                                          rf"{last.units[1]} units: the plan was edited by hand"):
        export_plan(edited, Target.TORCHTITAN, "x.args", unit_modules(llama))


def test_torch_csv_refuses_sequence_chunks(llama_plans: dict[str, Plan]) -> None:
    """A tester: a Seq1F1B plan's CSV numbered 32 chunk-microbatches where its note said n_microbatches=8 (8
    microbatches x 4 chunks); torch's runtime splits the batch, not the sequence: refused, as every exporter does."""
    from autopp.schedule.seqpipe import ChunkCosts
    plan = replace(llama_plans["dp"], schedule=ScheduleName.SEQ_1F1B,
                   seq_chunks=ChunkCosts((8, 8, 8, 8), (0.25,) * 4, (0.25,) * 4))
    with pytest.raises(ExportError, match=r"in 4 sequence chunks each \(seq_chunks\), its CSV numbering chunks, "
                                          r"not microbatches"):
        export_plan(plan, Target.TORCH_CSV, "/tmp/x.schedule.csv")


def test_an_ep_plan_whose_profile_is_gone_is_told_to_give_it(tmp_path: Path, llama_plans: dict[str, Plan],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A tester moved a plan away from its profile and was told the profile records no num_experts: Megatron's
    export of an ep plan whose profile is not found asks for --profile, and writes nothing."""
    from autopp.cli import main
    plan = replace(llama_plans["dp"], layout=replace(llama_plans["dp"].layout, ep=2),
                   profile_path=str(tmp_path / "gone"))
    path = plan.save(tmp_path / "p.plan.json")
    assert main(["export", str(path), "--to", "megatron"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("has no profile (the plan moved?): give --profile DIR") and "ep 2: Megatron-LM" in err
    assert not list(tmp_path.glob("*.args"))

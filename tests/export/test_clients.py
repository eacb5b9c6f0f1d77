"""Each export read back by its trainer's own code: torchtitan's config classes through its ConfigManager's tyro
rules, megatron-core's TransformerConfig and layout parser, DeepSpeed's DeepSpeedConfig and PipelineModule, torch's
schedule names and action parser. Skipped only where the client is not installed (scripts/setup.sh installs them)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import types
from pathlib import Path

import pytest

from autopp.export import ExportError, Target, export_plan, rename_modules
from autopp.data.layout import Layout, LayoutPins
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.data.zero import ZERO
from autopp.schedule import Activation, ScheduleName

from .conftest import plan_for, unit_modules

pytestmark = pytest.mark.integration

#: HF Llama module names -> torchtitan's llama3 names (torchtitan's model has no rotary module: its table is a buffer).
TITAN_NAMES = [("model.embed_tokens", "tok_embeddings"), ("model.rotary_emb", ""), ("model.layers", "layers"),
               ("model.norm", "norm"), ("lm_head", "output")]


def _blocks_per_stage(plan: Plan) -> list[int]:
    return [sum(1 for n in s.unit_names if n.startswith("model.layers.")) for s in plan.stages]


# ---- torchtitan ---------------------------------------------------------------------------------------------------

#: Trainer.Config's fields that its validation reads, with their types' names in torchtitan's trainer.py.
SECTIONS = {"parallelism": "ParallelismConfig", "training": "TrainingConfig",
            "activation_checkpoint": "ActivationCheckpointingConfig", "debug": "DebugConfig",
            "compile": "CompileConfig"}
#: Trainer.Config's own checks, run on every parsed export.
CHECKS = ("__post_init__", "_validate_cuda_graphs")


def _trainer_config_class() -> ast.ClassDef:
    spec = pytest.importorskip("torchtitan", reason="torchtitan is not installed").__file__
    tree = ast.parse((Path(spec).parent / "trainer.py").read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Config")


def _trainer_config_checks() -> dict[str, object]:
    """Trainer.Config.__post_init__ and the validation it calls, compiled from torchtitan's own trainer.py (importing
    the trainer needs triton, torchdata, datasets and wandb). Names they use only with a model spec or expert
    parallelism (FlexAttention, token dispatchers) are left out: with model_spec None those branches never run."""
    from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC, SelectiveAC
    methods = [n for n in _trainer_config_class().body if isinstance(n, ast.FunctionDef) and n.name in CHECKS]
    assert sorted(m.name for m in methods) == sorted(CHECKS)
    namespace: dict[str, object] = {"SelectiveAC": SelectiveAC, "MemoryBudgetAC": MemoryBudgetAC}
    exec(compile(ast.Module(body=methods, type_ignores=[]), "torchtitan/trainer.py", "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in CHECKS}


@pytest.fixture(scope="module")
def titan():  # type: ignore[no-untyped-def]
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (scripts/setup.sh installs it)")
    import tyro
    from torchtitan.config import ConfigManager, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import CompileConfig, DebugConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC
    ConfigManager()  # registers torchtitan's tyro rules (comma-separated lists) on custom_registry

    # Trainer.Config's sections that its checks read, with their real types (make_dataclass: this module's
    # annotations are strings), and Trainer.Config's own __post_init__: a config torchtitan refuses fails to parse
    kinds = {"ParallelismConfig": ParallelismConfig, "TrainingConfig": TrainingConfig,
             "ActivationCheckpointingConfig": ActivationCheckpointingConfig, "DebugConfig": DebugConfig,
             "CompileConfig": CompileConfig}
    defaults = {"activation_checkpoint": SelectiveAC.Config}
    Sections = dataclasses.make_dataclass("Sections", [
        (name, kinds[kind], dataclasses.field(default_factory=defaults.get(name, kinds[kind])))
        for name, kind in SECTIONS.items()], namespace={**_trainer_config_checks(), "model_spec": None})

    def parse(text: str):  # type: ignore[no-untyped-def]
        return tyro.cli(Sections, args=text.split(), default=Sections(), registry=custom_registry)
    return parse


def test_torchtitan_takes_overrides_before_the_export_only(titan, llama: Profile,  # type: ignore[no-untyped-def]
                                                            llama_plans: dict[str, Plan]) -> None:
    """The export's last line is a tyro subcommand (activation_checkpoint:MODE): torchtitan's parser takes a user's
    override before `$(cat FILE)` and refuses it after, as the export's note says; the file ends in a newline."""
    modules = rename_modules(unit_modules(llama), TITAN_NAMES)
    out = export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args", modules)
    assert out.text.endswith("\n") and out.text.splitlines()[-1].startswith("activation_checkpoint:")
    assert any(n.startswith("overrides of your own go before $(cat FILE)") for n in out.notes)
    assert titan("--training.steps=7\n" + out.text).training.steps == 7
    with pytest.raises(SystemExit):
        titan(out.text + "--training.steps=7\n")


def test_trainer_config_has_the_sections_we_parse() -> None:
    """The sections the export writes and the checks read are Trainer.Config's fields of these types (read from
    torchtitan's source, as importing its trainer needs triton, datasets and wandb)."""
    config = _trainer_config_class()
    fields = {n.target.id: ast.unparse(n.annotation) for n in config.body if isinstance(n, ast.AnnAssign)}
    assert {name: fields[name] for name in SECTIONS} == SECTIONS


def test_torchtitan_validation_is_live(titan, llama: Profile,  # type: ignore[no-untyped-def]
                                      llama_plans: dict[str, Plan], capsys: pytest.CaptureFixture[str]) -> None:
    """Trainer.Config's own checks run on the parsed export: without --training.disable_cuda_graphs (which the
    export lacked before the issue 18 review) torchtitan 0.3 refuses any pp > 1."""
    def refusal(text: str) -> str:
        with pytest.raises(SystemExit):  # tyro reports the ValueError of __post_init__ and exits
            titan(text)
        return " ".join(capsys.readouterr().err.split())
    text = export_plan(llama_plans["1f1b"], Target.TORCHTITAN, "x.args",
                       rename_modules(unit_modules(llama), TITAN_NAMES)).text
    assert "--training.disable_cuda_graphs" in text
    with_graphs = text.replace("--training.disable_cuda_graphs", "")
    assert "CUDA graphs do not support pipeline parallelism" in refusal(with_graphs)
    odd = re.sub(r"local_batch_size=\d+", "local_batch_size=7",
                 re.sub(r"microbatch_size=\d+", "microbatch_size=2", text))
    assert "must be evenly divisible" in refusal(odd)
    titan(odd.replace("local_batch_size=7", "local_batch_size=8"))  # the same with a multiple: accepted


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "dp"])
def test_torchtitan_parses_the_export(name: str, titan, llama: Profile,  # type: ignore[no-untyped-def]
                                      llama_plans: dict[str, Plan]) -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class
    plan = llama_plans[name]
    text = export_plan(plan, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES)).text
    cfg = titan(text)
    par = cfg.parallelism
    assert par.pipeline_parallel_degree == plan.layout.pp
    assert get_schedule_class(par.pipeline_parallel_schedule).__name__.lower().endswith(plan.schedule.value.lower())
    assert [sum(m.startswith("layers.") for m in part) for part in par.module_fqns_per_model_part] == \
        _blocks_per_stage(plan)
    assert par.module_fqns_per_model_part[0][0] == "tok_embeddings"
    assert par.module_fqns_per_model_part[-1][-2:] == ["norm", "output"]
    assert par.data_parallel_replicate_degree == plan.layout.dp and par.data_parallel_shard_degree == 1
    assert cfg.training.local_batch_size // par.pipeline_parallel_microbatch_size == plan.num_microbatches
    assert cfg.training.global_batch_size == plan.global_batch
    recompute = plan.stages[0].activation is Activation.BLOCKS
    assert (cfg.activation_checkpoint is None) != recompute
    assert type(cfg.activation_checkpoint).__qualname__ == ("FullAC.Config" if recompute else "NoneType")


def test_torchtitan_default_split_matches_ours() -> None:
    """--pin-from reads a config without module_fqns_per_model_part by torchtitan's own default split."""
    pp = pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="torchtitan is not installed")
    from autopp.export.pin_torchtitan import torchtitan_default_parts
    for stages, layers, w_in, w_out in [(2, 4, 1, 1), (4, 16, 1, 1), (3, 8, 2, 1), (4, 6, 1, 1), (1, 5, 1, 1)]:
        theirs = pp._generate_llm_fqn_per_model_part(stages, layers, w_in, w_out)
        assert torchtitan_default_parts(stages, layers, w_in, w_out) == \
            [sum(m.startswith("layers.") for m in part) for part in theirs]


# ---- Megatron-Core ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron():  # type: ignore[no-untyped-def]
    return pytest.importorskip("megatron.core", reason="megatron-core is not installed (scripts/setup.sh installs it)")


#: Megatron-LM arguments that are no megatron-core config field (megatron/training/arguments.py, NVIDIA/Megatron-LM
#: d98e8a64): the checkpoint format Megatron-FSDP asserts, the untied output layer (its GPTModel's
#: share_embeddings_and_output_weights).
_MEGATRON_LM_ONLY = ("ckpt_format", "untie_embeddings_and_output_weights")
_MEGATRON_RENAMED = {"num-experts": "num_moe_experts", "fp8-format": "fp8"}  # --fp8-format's dest is fp8


def _megatron_config(text: str):  # type: ignore[no-untyped-def]
    """Every exported flag is a megatron-core config field (Megatron-LM copies args into TransformerConfig by name) or a
    batch size, which megatron-core's microbatch calculator takes."""
    import torch
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
    from megatron.core.transformer import TransformerConfig
    from megatron.core.distributed import DistributedDataParallelConfig
    args = dict((line.split(" ", 1) + ["true"])[:2] for line in text.splitlines())  # bare flags: store_true
    # Megatron-LM copies its args into TransformerConfig by name, but for --num-experts (num_moe_experts; its
    # arguments.py core_transformer_config_from_args) and --fp8-format (its argparse dest is fp8)
    kw = {_MEGATRON_RENAMED.get(k[2:], k[2:].replace("-", "_")): v for k, v in args.items()}
    if kw.pop("disable_bias_linear", None):  # Megatron-LM: store_false into add_bias_linear (arguments.py)
        kw["add_bias_linear"] = "false"
    # batch sizes go to megatron-core's microbatch calculator, the sequence length to its data loader and schedules
    batch = {k: int(kw.pop(k)) for k in ("micro_batch_size", "global_batch_size", "seq_length") if k in kw}
    # the data-parallel flags (Megatron-LM copies them into DistributedDataParallelConfig by name too): bare flags
    # and strategies such as --data-parallel-sharding-strategy optim_grads_params (Megatron-FSDP, ZeRO 3 at pp 1)
    # Megatron-LM's own arguments that no megatron-core config holds (megatron/training/arguments.py): kept aside
    lm = {k: kw.pop(k) for k in _MEGATRON_LM_ONLY if k in kw}
    ddp_names = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    ddp = {k: True if v == "true" else v for k, v in kw.items() if k in ddp_names}
    kw = {k: v for k, v in kw.items() if k not in ddp_names}
    if ddp.get("overlap_param_gather"):  # Megatron-LM's arguments.py asserts both (megatron-core does not check)
        assert ddp.get("use_distributed_optimizer") or ddp.get("use_megatron_fsdp")
        assert ddp.get("overlap_grad_reduce")
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    assert set(kw) <= names, f"not megatron-core config fields: {set(kw) - names}"
    kw = {k: int(v) if v.isdigit() else True if v == "true" else False if v == "false" else v for k, v in kw.items()}
    # Megatron-LM's --bf16 sets params_dtype to bfloat16, which it passes on as the pipeline's dtype
    dtype = torch.bfloat16 if kw.get("bf16") else torch.float32
    cfg = TransformerConfig(hidden_size=64, num_attention_heads=4, params_dtype=dtype, pipeline_dtype=dtype, **kw)
    cfg.ddp = DistributedDataParallelConfig(**ddp)
    cfg.lm = lm
    return cfg, batch, ConstantNumMicroBatchesCalculator


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "dp"])
def test_megatron_core_parses_the_export(name: str, megatron, llama_plans: dict[str, Plan]) -> None:  # type: ignore[no-untyped-def]
    from megatron.core.transformer.enums import LayerType
    plan = llama_plans[name]
    cfg, batch, calculator = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    layout = cfg.pipeline_model_parallel_layout  # parsed and validated (E first, L last, layer count) by megatron-core
    pp = plan.layout.pp
    assert layout.pipeline_model_parallel_size == pp
    assert layout.virtual_pipeline_model_parallel_size == plan.layout.v
    per_stage = [layout.layout[k % pp][k // pp] for k in range(len(plan.stages))]  # stage k: rank k % pp
    assert [s.count(LayerType.decoder) for s in per_stage] == _blocks_per_stage(plan)
    assert LayerType.embedding in per_stage[0] and LayerType.loss in per_stage[-1]
    calc = calculator(batch["global_batch_size"], batch["micro_batch_size"], plan.layout.dp, False, 0)
    assert calc.get() == plan.num_microbatches
    assert (cfg.recompute_granularity == "full") == (plan.stages[0].activation is Activation.BLOCKS)


def test_megatron_core_parses_a_megatron_fsdp_export(megatron, llama: Profile) -> None:  # type: ignore[no-untyped-def]
    """Issue 26: the newcomer's 2 x 8 H100 plan is ZeRO 3 at pp 1, exported as Megatron-FSDP; its sharding strategy
    is a DistributedDataParallelConfig field, which this check once took for an unknown flag."""
    plan = plan_for(llama, devices=2, pins=LayoutPins(pp=1, dp=2, zero=ZERO[3]))
    cfg, batch, calculator = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    assert cfg.ddp.use_megatron_fsdp and cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    # what Megatron-LM's validate_args requires beside Megatron-FSDP (v1: the distributed optimizer; the format:
    # "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format")
    assert cfg.ddp.use_distributed_optimizer and cfg.lm["ckpt_format"] == "fsdp_dtensor"
    assert cfg.pipeline_model_parallel_size == 1
    assert calculator(batch["global_batch_size"], batch["micro_batch_size"], 2, False, 0).get() == \
        plan.num_microbatches


def test_megatron_layout_grammar_matches_megatron_core(megatron) -> None:  # type: ignore[no-untyped-def]
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from autopp.export.pin_megatron import megatron_layout
    names = {"embedding": "E", "decoder": "t", "loss": "L", "mtp": "m"}
    for text in ["Et|tt|t|L", "Et*3|(tt|)*2,tL", "E|t*4|L", "Ettt|tttL", "(Et|)*1t*2|tL"]:
        theirs = ["".join(names[x.name] for x in st) for st in PipelineParallelLayerLayout.parse_str_to_list(text)]
        assert megatron_layout(text) == theirs, text


class _PastTheCheck(Exception):
    """Raised by the stub process group that megatron-core first asks for a size after its microbatch checks."""


def _megatron_core_runs_interleaved(pp: int, microbatches: int, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether megatron-core's forward_backward_pipelining_with_interleaving gets past its microbatch-group checks
    for `microbatches` on `pp` ranks (v 2, the default group size of TransformerConfig), run in-process up to the
    first thing that needs a real process group (its one CUDA tensor before the checks is made on the CPU)."""
    import torch
    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, device=None, **k: zeros(*a, **k))
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(num_layers=2 * pp, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
                            pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=2)
    chunks = [torch.nn.Module(), torch.nn.Module()]
    for chunk in chunks:
        chunk.config, chunk.model_type = cfg, ModelType.encoder_or_decoder  # type: ignore[assignment]

    def past(*_: object) -> int:
        raise _PastTheCheck
    group = types.SimpleNamespace(size=lambda: pp, rank=lambda: 0)
    pgs = types.SimpleNamespace(tp=None, cp=types.SimpleNamespace(size=past), embd=None, pos_embd=None, pp=group,
                                dp_cp=None)
    try:
        forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[None, None], model=chunks, num_microbatches=microbatches,
            seq_length=8, micro_batch_size=1, p2p_communicator=types.SimpleNamespace(config=cfg, pp_group=group),
            pg_collection=pgs)
    except _PastTheCheck:
        return True
    except (ValueError, RuntimeError) as exc:
        assert "micro-batches" in str(exc) or "M (the total micro-batches)" in str(exc), exc
        return False
    raise AssertionError("megatron-core's interleaved schedule ran past its checks without a process group")


def test_megatron_interleaving_refusal_matches_megatron_core(megatron,  # type: ignore[no-untyped-def]
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from autopp.data.trainers import interleaving_problem
    for pp in (2, 3, 4):
        for m in range(1, 3 * pp + 2):
            theirs = _megatron_core_runs_interleaved(pp, m, monkeypatch)
            assert (interleaving_problem(pp, m) is None) == theirs, (pp, m)


def test_megatron_layout_refusal_matches_megatron_core(megatron, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                       llama: Profile) -> None:
    """What megatron-core's validate_layer_layout refuses (one E first, one L last, the layer count), --pin-from
    refuses too; it also refuses a first stage without E or a last without L, which megatron-core allows but which
    would put the embedding or the head on another stage than autopp reads."""
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    from autopp.export import ExportError, read_pinned
    args, path = "--pipeline-model-parallel-size 2 --num-layers 4 --global-batch-size 8", tmp_path / "m.args"
    for text in ["Ett|ttL", "EtE|ttL", "EtL|ttL", "tEt|ttL", "Ett|ttLt", "Et|t|t|tL", "Ettt|tL", "EtLt|ttL"]:
        try:
            PipelineParallelLayerLayout(text, pipeline_model_parallel_size=2).validate_layer_layout(4, None)
            theirs = True
        except AssertionError:
            theirs = False
        path.write_text(f"{args} --pipeline-model-parallel-layout '{text}'\n")
        try:
            read_pinned(path, llama.meta.unit_names, 2)
            ours = True
        except ExportError:
            ours = False
        assert ours == theirs, text
    for text in ["|Ett|t|tL", "Ett|t|tL|"]:  # megatron-core takes these; autopp refuses
        PipelineParallelLayerLayout(text, pipeline_model_parallel_size=2).validate_layer_layout(4, None)
        path.write_text(f"{args} --pipeline-model-parallel-layout '{text}'\n")
        with pytest.raises(ExportError, match="open its first stage with E"):
            read_pinned(path, llama.meta.unit_names, 2)


# ---- DeepSpeed ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deepspeed(monkeypatch_module: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    ds = pytest.importorskip("deepspeed", reason="deepspeed is not installed (scripts/setup.sh installs it)")
    import deepspeed.comm as dist
    # DeepSpeedConfig asks deepspeed.comm for the rank and the mpu for the data-parallel size; without this it falls
    # back to world size 1. (Starting deepspeed.comm on CPU JIT-compiles a C++ op: not for a unit test.)
    monkeypatch_module.setattr(dist, "get_rank", lambda *a, **k: 0)
    return ds


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("name", ["1f1b", "dp"])
def test_deepspeed_config_accepts_the_export(name: str, deepspeed, llama_plans: dict[str, Plan]) -> None:  # type: ignore[no-untyped-def]
    from deepspeed.runtime.config import DeepSpeedConfig
    plan = llama_plans[name]
    data = json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: plan.layout.dp, get_model_parallel_world_size=lambda: 1)
    cfg = DeepSpeedConfig(data, mpu=mpu)  # asserts train_batch = micro x accumulation x dp
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (plan.global_batch, plan.microbatch_size)
    assert cfg.gradient_accumulation_steps == plan.num_microbatches and cfg.zero_optimization_stage == 0
    with pytest.raises(AssertionError):  # the check is live: a wrong dp is refused
        DeepSpeedConfig(data, mpu=types.SimpleNamespace(get_data_parallel_world_size=lambda: plan.layout.dp + 1,
                                                        get_model_parallel_world_size=lambda: 1))


def test_deepspeed_pipeline_module_takes_the_parts(deepspeed, llama_plans: dict[str, Plan]) -> None:  # type: ignore[no-untyped-def]
    """The snippet's override runs DeepSpeed's own _set_bounds for each stage, and PipelineModule.__init__ still
    partitions through _partition_layers (the private hook it overrides)."""
    import torch
    from deepspeed.runtime.pipe.module import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology
    plan = llama_plans["dp"]
    namespace: dict[str, object] = {}
    snippet = export_plan(plan, Target.DEEPSPEED, "x.json").extra["x_deepspeed_pipe.py"]
    exec(snippet, namespace)  # noqa: S102 - our own export
    cls = namespace["AutoppPipelineModule"]
    assert issubclass(cls, PipelineModule)  # type: ignore[arg-type]
    assert "self._partition_layers(method=partition_method)" in inspect.getsource(PipelineModule.__init__)
    for stage in plan.stages:
        module = object.__new__(cls)  # type: ignore[call-overload]
        torch.nn.Module.__init__(module)
        module._layer_specs = [torch.nn.Linear(2, 2) for _ in range(plan.stages[-1].units[1])]
        module._topo = PipeDataParallelTopology(num_pp=plan.layout.pp, num_dp=plan.layout.dp)
        module.global_rank = module._topo.get_rank(pipe=stage.rank, data=0)
        module._partition_layers()
        assert (module._local_start, module._local_stop) == stage.units


# ---- torch's schedule CSV -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv"])
def test_torch_parses_every_csv_cell(name: str, llama_plans: dict[str, Plan]) -> None:
    from torch.distributed.pipelining.schedules import _Action, _ComputationType
    plan = llama_plans[name]
    rows = [r.split(",") for r in export_plan(plan, Target.TORCH_CSV, "x.csv").text.splitlines()]
    actions = [_Action.from_str(c) for row in rows for c in row if c]
    assert len(rows) == plan.layout.pp
    forwards = [a for a in actions if a.computation_type == _ComputationType.FORWARD]
    assert len(forwards) == len(plan.stages) * plan.num_microbatches


# ---- tensor parallelism and ZeRO (issue 17) ------------------------------------------------------------------------

def _3d(plan: Plan, tp: int, zero: int) -> Plan:
    return dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, tp=tp, zero=ZERO[zero]),
                               tp_plan={"model.layers.*.mlp.up_proj": "colwise"} if tp > 1 else {})


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_torchtitan_parses_tp_and_zero(zero: int, titan, llama: Profile,  # type: ignore[no-untyped-def]
                                       llama_plans: dict[str, Plan]) -> None:
    plan = _3d(llama_plans["dp"], 2, zero)
    par = titan(export_plan(plan, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES)).text
                ).parallelism
    assert par.tensor_parallel_degree == 2 and par.enable_sequence_parallel is False
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == plan.layout.dp
    assert par.data_parallel_shard_degree == (1 if zero == 0 else plan.layout.dp)
    assert par.fsdp_reshard_after_forward == {0: "default", 1: "never", 3: "always"}[zero]
    world = (plan.layout.pp * par.data_parallel_replicate_degree * par.data_parallel_shard_degree
             * par.tensor_parallel_degree)
    assert world == plan.num_ranks  # torchtitan's ParallelDims check: the product is the world size


@pytest.mark.parametrize("zero", [0, 1])
def test_megatron_core_parses_tp_and_the_distributed_optimizer(zero: int, megatron,  # type: ignore[no-untyped-def]
                                                               llama_plans: dict[str, Plan]) -> None:
    plan = _3d(llama_plans["dp"], 2, zero)
    cfg, batch, calculator = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    assert cfg.tensor_model_parallel_size == 2 and cfg.sequence_parallel is False
    assert cfg.ddp.use_distributed_optimizer == (zero == 1)
    assert calculator(batch["global_batch_size"], batch["micro_batch_size"], plan.layout.dp, False, 0).get() == \
        plan.num_microbatches


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_config_accepts_zero_stages(zero: int, deepspeed,  # type: ignore[no-untyped-def]
                                              llama_plans: dict[str, Plan]) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import ZeroStageEnum
    plan = _3d(llama_plans["dp"], 1, zero)
    data = json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: plan.layout.dp, get_model_parallel_world_size=lambda: 1)
    stage = DeepSpeedConfig(data, mpu=mpu).zero_optimization_stage
    assert stage == zero and stage < ZeroStageEnum.gradients  # what DeepSpeed's PipelineEngine asserts


@pytest.mark.parametrize("zero", [1, 3])
def test_torchtitan_parses_hsdp_and_megatron_and_deepspeed_refuse_it(  # type: ignore[no-untyped-def]
        zero: int, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 25 item 3: HSDP (dp 4 = replicate 2 x shard 2) is torchtitan's data_parallel_replicate_degree x
    data_parallel_shard_degree, which its ParallelDims multiplies to the world size; Megatron-LM and DeepSpeed have no
    replicate dimension beside pipelining and refuse it in one line."""
    from autopp.export import ExportError
    base = llama_plans["dp"]
    plan = dataclasses.replace(base, layout=dataclasses.replace(base.layout, dp=4, zero=ZERO[zero], dp_replicate=2))
    par = titan(export_plan(plan, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES)).text
                ).parallelism
    assert (par.data_parallel_replicate_degree, par.data_parallel_shard_degree) == (2, 2)
    assert plan.layout.pp * par.data_parallel_replicate_degree * par.data_parallel_shard_degree == plan.num_ranks
    assert par.fsdp_reshard_after_forward == {1: "never", 3: "always"}[zero]
    with pytest.raises(ExportError, match=r"dp_replicate 2 \(HSDP\): Megatron-LM shards over the whole"):
        export_plan(plan, Target.MEGATRON, "x")
    ds = r"dp_replicate 2 \(HSDP\): DeepSpeed's nearest \(ZeRO\+\+ hpZ, MiCS\)" if zero == 1 else "zero 3: DeepSpeed"
    with pytest.raises(ExportError, match=ds):
        export_plan(plan, Target.DEEPSPEED, "x.json")


def test_expert_parallelism_export_is_read_by_megatron_core_and_torchtitan(  # type: ignore[no-untyped-def]
        megatron, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 30: ep 2 with 8 experts and top-2 routing: megatron-core's TransformerConfig takes the expert flags (and
    checks that ep divides the experts), torchtitan's config its expert_parallel_degree."""
    plan = dataclasses.replace(llama_plans["dp"], layout=dataclasses.replace(llama_plans["dp"].layout, ep=2))
    moe = {"num_experts": 8, "top_k": 2}
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x", moe=moe).text)
    assert (cfg.expert_model_parallel_size, cfg.num_moe_experts, cfg.moe_router_topk) == (2, 8, 2)
    assert cfg.moe_token_dispatcher_type == "alltoall"
    limited = {"num_experts": 8, "top_k": 2, "num_groups": 4, "group_top_k": 2}  # group-limited routing's groups
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x", moe=limited).text)
    assert (cfg.moe_router_num_groups, cfg.moe_router_group_topk) == (4, 2)  # megatron-core checks them
    assert not any(line.startswith("--moe-layer-freq") for line in export_plan(plan, Target.MEGATRON, "x", moe={
        **moe, "moe_units": [0, 1, 1, 1, 1, 0]}).text.splitlines())  # every block has experts: Megatron's default
    dense_first = export_plan(plan, Target.MEGATRON, "x", moe={**moe, "moe_units": [0, 0, 1, 1, 1, 0]}).text
    freq = next(line for line in dense_first.splitlines() if line.startswith("--moe-layer-freq "))
    assert freq == "--moe-layer-freq ([0]*1+[1]*3)"  # the first block dense, as DeepSeek-V3's first three
    cfg, _, _ = _megatron_config(dense_first.replace(freq + "\n", ""))
    cfg.moe_layer_freq = eval(freq.split(" ", 1)[1])  # Megatron-LM's moe_freq_type evaluates the list expression
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern
    assert get_moe_layer_pattern(cfg) == [0, 1, 1, 1]  # megatron-core checks its length against --num-layers
    sharded = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, zero=ZERO[1]))  # ZeRO 0 refused
    text = export_plan(sharded, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES),
                       moe=moe).text
    parallelism = titan(text).parallelism
    assert parallelism.expert_parallel_degree == 2
    # torchtitan's expert mesh: efsdp = dp_shard x cp x tp / ep ranks hold the same experts (ParallelDims)
    assert parallelism.data_parallel_shard_degree * parallelism.context_parallel_degree \
        * parallelism.tensor_parallel_degree // 2 >= 1


def test_fsdp_beside_expert_parallelism_at_pp_1_is_read_by_megatron_core_and_torchtitan(  # type: ignore[no-untyped-def]
        megatron, titan, llama: Profile) -> None:
    """Issue 30: ZeRO 3 beside ep at pp 1 (NeMo AutoModel's EP8 x FSDP8): torchtitan's config takes FSDP over the 4
    dp ranks and expert_parallel_degree 2 (its experts' FSDP over dp_shard / ep), megatron-core Megatron-FSDP beside
    --expert-model-parallel-size (MCore 0.15: FSDP with EP); DeepSpeed refuses ZeRO 3 in one line."""
    from autopp.export import ExportError
    fsdp = plan_for(llama, devices=4, pins=LayoutPins(pp=1, dp=4, zero=ZERO[3]))  # llama is dense: ep set after
    plan = dataclasses.replace(fsdp, layout=dataclasses.replace(fsdp.layout, ep=2))
    assert plan.layout.fsdp and plan.layout.ep == 2
    moe = {"num_experts": 8, "top_k": 2}
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x", moe=moe).text)
    assert cfg.ddp.use_megatron_fsdp and cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    assert (cfg.expert_model_parallel_size, cfg.pipeline_model_parallel_size) == (2, 1)
    text = export_plan(plan, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES),
                       moe=moe).text
    par = titan(text).parallelism
    assert (par.data_parallel_shard_degree, par.expert_parallel_degree, par.pipeline_parallel_degree) == (4, 2, 1)
    with pytest.raises(ExportError, match=r"^plan: zero 3: autopp's DeepSpeed export builds the model as a "
                                          r"PipelineModule at pp 1 too"):  # pp 1: no pipeline, but its engine
        export_plan(plan, Target.DEEPSPEED, "x.json")


def test_megatron_core_reads_the_etp_export_and_torchtitan_has_no_key(  # type: ignore[no-untyped-def]
        megatron, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 24's proof axis: ep 2 x etp 2 on dp 4: megatron-core's TransformerConfig takes
    --expert-tensor-parallel-size (its default is tp, so the export writes it); torchtitan 0.3's parallelism config
    has no expert_tensor_parallel_degree, which the export's refusal says. Without --disable-bias-linear megatron-core
    refuses etp > 1 ("Bias in Moe is only supported when ETP==1"): the descriptor's extra line."""
    dp4 = dataclasses.replace(llama_plans["dp"], layout=Layout(pp=2, dp=4))
    plan = dataclasses.replace(dp4, layout=dataclasses.replace(dp4.layout, ep=2, etp=2))
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x", moe={"num_experts": 8, "top_k": 2}).text)
    assert (cfg.expert_model_parallel_size, cfg.expert_tensor_parallel_size) == (2, 2) and not cfg.add_bias_linear
    text = export_plan(llama_plans["dp"], Target.TORCHTITAN, "x.args",
                       rename_modules(unit_modules(llama), TITAN_NAMES)).text
    parallelism = titan(text).parallelism
    assert hasattr(parallelism, "expert_parallel_degree") and not hasattr(parallelism, "expert_tensor_parallel_degree")


def test_context_parallelism_export_is_read_by_megatron_core_and_torchtitan(  # type: ignore[no-untyped-def]
        megatron, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 27: cp 2: megatron-core's TransformerConfig takes --context-parallel-size, torchtitan's config its
    context_parallel_degree (with its head-tail load balancer, the one autopp costs)."""
    plan = dataclasses.replace(llama_plans["dp"], layout=dataclasses.replace(llama_plans["dp"].layout, cp=2))
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    assert cfg.context_parallel_size == 2
    sharded = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, zero=ZERO[1]))  # torchtitan's FSDP
    text = export_plan(sharded, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES)).text
    par = titan(text).parallelism
    assert par.context_parallel_degree == 2 and par.context_parallel_load_balancer == "headtail"


def test_torchtitan_parses_selective_recomputation(titan, llama: Profile,  # type: ignore[no-untyped-def]
                                                  llama_plans: dict[str, Plan]) -> None:
    """Every stage selective unit by unit: torchtitan's `activation_checkpoint:selective` subcommand, read by its parser
    as SelectiveAC.Config (op-level, torchtitan 0.3's only selective mode: an
    `--activation_checkpoint.selective_ac_option` override, as older torchtitan had, is an unrecognized option there)."""
    base = llama_plans["1f1b"]
    plan = dataclasses.replace(base, stages=tuple(dataclasses.replace(s, activation=Activation.SELECTIVE_UNITS)
                                                  for s in base.stages))
    text = export_plan(plan, Target.TORCHTITAN, "x.args", rename_modules(unit_modules(llama), TITAN_NAMES)).text
    ac = titan(text).activation_checkpoint
    assert type(ac).__qualname__ == "SelectiveAC.Config"



# ---- what the plan was made for (issue 26, point 5) ---------------------------------------------------------------

def _llama_8b_like(plan: Plan, activation: Activation) -> Plan:
    """`plan` as the planner writes one for an HF Llama config profiled in bf16 at sequence 64: tp 2 with sequence
    parallelism, ZeRO 1, every stage under `activation`."""
    layout = dataclasses.replace(plan.layout, tp=2, sp=True, zero=ZERO[1])
    return dataclasses.replace(plan, layout=layout, tp_plan={"model.layers.*.mlp.up_proj": "colwise"},
                               hf_config={"seq_len": 64, "task": "causal-lm", "model_type": "llama"},
                               dtype="bfloat16",
                               stages=tuple(dataclasses.replace(s, activation=activation) for s in plan.stages))


@pytest.mark.parametrize("activation", [Activation.BLOCKS, Activation.SELECTIVE_UNITS])
def test_torchtitan_takes_sequence_length_precision_sp_and_recomputation(  # type: ignore[no-untyped-def]
        activation: Activation, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """torchtitan's own config classes read what the plan was made for, with HF names mapped by the export itself."""
    plan = _llama_8b_like(llama_plans["dp"], activation)
    cfg = titan(export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama)).text)
    assert cfg.training.seq_len == 64 and cfg.training.dtype == "float32"
    assert (cfg.training.mixed_precision_param, cfg.training.mixed_precision_reduce) == ("bfloat16", "float32")
    par = cfg.parallelism
    assert (par.tensor_parallel_degree, par.enable_sequence_parallel) == (2, True)
    assert par.module_fqns_per_model_part[0][0] == "tok_embeddings"
    assert par.module_fqns_per_model_part[-1][-2:] == ["norm", "output"]
    assert type(cfg.activation_checkpoint).__qualname__ == \
        {Activation.BLOCKS: "FullAC.Config", Activation.SELECTIVE_UNITS: "SelectiveAC.Config"}[activation]


def test_megatron_core_takes_sequence_length_precision_sp_and_recomputation(  # type: ignore[no-untyped-def]
        megatron, llama_plans: dict[str, Plan]) -> None:
    """Megatron's selective recomputation is not exported (its submodules are not autopp's selective policy:
    autopp.schedule.activation); its full recomputation is, every layer one recompute unit."""
    import torch
    plan = _llama_8b_like(llama_plans["dp"], Activation.BLOCKS)
    cfg, batch, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    assert batch["seq_length"] == 64 and cfg.bf16 is True and cfg.params_dtype == torch.bfloat16
    assert (cfg.tensor_model_parallel_size, cfg.sequence_parallel) == (2, True)
    assert cfg.ddp.use_distributed_optimizer is True  # TransformerConfig checks the trio below
    assert (cfg.recompute_granularity, cfg.recompute_method, cfg.recompute_num_layers) == ("full", "uniform", 1)


def test_deepspeed_config_takes_the_precision(deepspeed,  # type: ignore[no-untyped-def]
                                             llama_plans: dict[str, Plan]) -> None:
    from deepspeed.runtime.config import DeepSpeedConfig
    plan = dataclasses.replace(llama_plans["1f1b"], dtype="bfloat16")
    data = json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: 1, get_model_parallel_world_size=lambda: 1)
    cfg = DeepSpeedConfig(data, mpu=mpu)
    assert cfg.bfloat16_config.enabled and not cfg.float16_config.enabled


@pytest.mark.parametrize("zero", [0, 1])
def test_deepspeed_accumulates_bf16_gradients_in_fp32(zero: int, deepspeed,  # type: ignore[no-untyped-def]
                                                      llama_plans: dict[str, Plan]) -> None:
    """autopp's bf16 recipe counts fp32 gradients: DeepSpeed's engine, given the export's config, picks its
    BF16_Optimizer (fp32 accumulation of each microbatch's gradient) at ZeRO 1, where the config says
    `grad_accum_dtype` fp32 (without it, its ZeRO optimizer kept bf16 gradients), and at ZeRO 0, where the key would
    raise "unsupported mix"."""
    import torch
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.constants import BFLOAT16
    from deepspeed.runtime.engine import DeepSpeedEngine
    plan = dataclasses.replace(llama_plans["dp"], dtype="bfloat16")  # dp 2
    plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, zero=ZERO[zero]))
    data = json.loads(export_plan(plan, Target.DEEPSPEED, "x.json").text)
    mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: plan.layout.dp,
                                get_model_parallel_world_size=lambda: 1)
    cfg = DeepSpeedConfig(data, mpu=mpu)
    assert cfg.grad_accum_dtype == ("fp32" if zero else None)
    engine = types.SimpleNamespace(  # what DeepSpeedEngine's check reads of itself
        _config=cfg, pipeline_parallelism=True, global_rank=0, fp16_enabled=lambda: cfg.float16_config.enabled,
        bfloat16_enabled=lambda: cfg.bfloat16_config.enabled, zero_optimization=lambda: cfg.zero_enabled,
        zero_optimization_stage=lambda: cfg.zero_optimization_stage, zero_cpu_offload=lambda: False,
        zero_compute_grad_norm=lambda: cfg.zero_config.compute_grad_norm, zero_allow_untested_optimizer=lambda: False)
    engine.get_data_types = lambda: DeepSpeedEngine.get_data_types(engine)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    assert DeepSpeedEngine._do_optimizer_sanity_check(engine, optimizer) == BFLOAT16


@pytest.mark.parametrize("trainer", ["torchtitan", "megatron"])
def test_llama_3_8b_on_2x8_h100_for_each_trainer_is_taken_by_its_config_classes(  # type: ignore[no-untyped-def]
        trainer: str, titan, megatron, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26, done-when: Llama-3-8B (the shipped analytic profile, sequence 8192, bf16) planned with `--for
    TRAINER` for 2 x 8 H100, exported by `autopp export` with no other flag, and read by the trainer's own config
    classes with the sequence length, the precision, SP and the recomputation of the plan."""
    from autopp.cli import main
    from autopp.data.plan import load_plan
    from .conftest import ROOT
    plan_path = tmp_path / "llama.plan.json"
    assert main(["plan", "--profile", str(ROOT / "profiles" / "llama-3-8b-h100-sxm-s8192"), "--device", "h100-sxm",
                 "--nodes", "2", "--global-batch", "64", "--tp", "auto", "--dp", "auto", "--schedule", "auto",
                 "--for", trainer, "-o", str(plan_path)]) == 0
    assert main(["export", str(plan_path), "--to", trainer]) == 0
    capsys.readouterr()
    plan = load_plan(plan_path)
    text = (tmp_path / f"llama.{trainer}.args").read_text()
    recompute = plan.stages[0].activation
    if trainer == "torchtitan":
        cfg = titan(text)
        assert (cfg.training.seq_len, cfg.training.mixed_precision_param) == (8192, "bfloat16")
        assert cfg.parallelism.tensor_parallel_degree == plan.layout.tp
        assert plan.layout.tp == 1 or cfg.parallelism.enable_sequence_parallel == plan.layout.sp  # SP needs tp > 1
        assert cfg.parallelism.module_fqns_per_model_part[0][0] == "tok_embeddings"
        assert type(cfg.activation_checkpoint).__qualname__ == {
            Activation.KEEP: "NoneType", Activation.BLOCKS: "FullAC.Config",
            Activation.SELECTIVE_UNITS: "SelectiveAC.Config"}[recompute]
    else:
        cfg, batch, calculator = _megatron_config(text)
        assert batch["seq_length"] == 8192 and cfg.bf16 is True
        assert (cfg.tensor_model_parallel_size, cfg.sequence_parallel) == (plan.layout.tp, plan.layout.sp)
        assert cfg.recompute_granularity == {Activation.KEEP: None, Activation.BLOCKS: "full",
                                             Activation.SELECTIVE_UNITS: "selective"}[recompute]
        assert calculator(batch["global_batch_size"], batch["micro_batch_size"], plan.layout.dp, False, 0).get() == \
            plan.num_microbatches
        # the gradient reduction the plan hid (a catalog GPU: the trainers' overlap) is overlapped by Megatron too
        assert plan.overlap is not None and plan.overlap.grad_reduce
        assert cfg.ddp.overlap_grad_reduce == (plan.layout.sync > 1)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_overlap_a_plan_assumed_is_taken_by_megatron_core_and_torchtitan(  # type: ignore[no-untyped-def]
        zero: int, titan, megatron, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Review: the Megatron export writes --overlap-grad-reduce (and with the distributed optimizer
    --overlap-param-gather) where the plan hid the gradient reduction, and --tp-comm-overlap for async TP;
    torchtitan's async TP is its compile switch; each read by the trainer's own config classes."""
    from autopp.data.overlap import Overlap
    plan = dataclasses.replace(_llama_8b_like(llama_plans["dp"], Activation.BLOCKS), device="h100-sxm",
                               overlap=Overlap(async_tp=True))
    plan = dataclasses.replace(plan, layout=dataclasses.replace(plan.layout, zero=ZERO[zero]))
    cfg, _, _ = _megatron_config(export_plan(plan, Target.MEGATRON, "x").text)
    assert (cfg.ddp.overlap_grad_reduce, cfg.ddp.overlap_param_gather) == (True, zero == 1)
    assert cfg.tp_comm_overlap is True and cfg.sequence_parallel is True
    titan_cfg = titan(export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama)).text)
    assert titan_cfg.compile.enable and titan_cfg.compile.enable_async_tensor_parallel


# ---- FP8 (issue 25, point 5) --------------------------------------------------------------------------------------

def _fp8(plan: Plan) -> Plan:
    return dataclasses.replace(_llama_8b_like(plan, Activation.KEEP), precision="fp8")


def test_megatron_core_takes_the_fp8_recipe(megatron, llama_plans: dict[str, Plan]) -> None:  # type: ignore[no-untyped-def]
    """--fp8-format hybrid and --fp8-recipe tensorwise are values of TransformerConfig's own Literal fields (it does
    not check them itself)."""
    import typing
    cfg, _, _ = _megatron_config(export_plan(_fp8(llama_plans["dp"]), Target.MEGATRON, "x").text)
    types_of = {f.name: f.type for f in dataclasses.fields(type(cfg))}
    assert (cfg.fp8, cfg.fp8_recipe, cfg.bf16) == ("hybrid", "tensorwise", True)
    for name in ("fp8", "fp8_recipe"):
        assert getattr(cfg, name) in typing.get_args(typing.get_args(types_of[name])[0])


def test_torchtitan_takes_the_fp8_export_and_sets_float8_in_python(titan, llama: Profile,  # type: ignore[no-untyped-def]
                                                                   llama_plans: dict[str, Plan]) -> None:
    """torchtitan 0.3 parses the FP8 export's overrides (bf16 as ever) and has no command-line key for converters (its
    model spec is suppressed from the CLI); the note names Float8LinearConverter.Config's own recipe field and value,
    read from torchtitan's float8.py (importing it needs triton)."""
    exported = export_plan(_fp8(llama_plans["dp"]), Target.TORCHTITAN, "x.args", unit_modules(llama))
    cfg = titan(exported.text)
    assert (cfg.training.mixed_precision_param, cfg.training.dtype) == ("bfloat16", "float32")
    fields = {n.target.id for n in _trainer_config_class().body if isinstance(n, ast.AnnAssign)}
    assert "converters" not in fields and "model" not in fields
    source = Path(pytest.importorskip("torchtitan").__file__).parent / "components" / "quantization" / "float8.py"
    converter = next(n for n in ast.walk(ast.parse(source.read_text()))
                     if isinstance(n, ast.ClassDef) and n.name == "Float8LinearConverter")
    config = next(n for n in converter.body if isinstance(n, ast.ClassDef) and n.name == "Config")
    recipe = next(n for n in config.body if isinstance(n, ast.AnnAssign) and n.target.id == "recipe_name")
    assert "'rowwise'" in ast.unparse(recipe.annotation)
    assert any('Float8LinearConverter.Config(recipe_name="rowwise")' in n for n in exported.notes)


def test_torchtitan_takes_the_pure_bf16_export(titan, llama: Profile,  # type: ignore[no-untyped-def]
                                               llama_plans: dict[str, Plan]) -> None:
    """torchtitan's config reads a bf16-pure plan's overrides: `training.dtype` bfloat16, which its docstring says
    puts parameters, gradients and optimizer state in bf16 without an fp32 copy, and bf16 compute."""
    plan = dataclasses.replace(_llama_8b_like(llama_plans["dp"], Activation.KEEP), precision="bf16-pure")
    cfg = titan(export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama)).text)
    assert (cfg.training.dtype, cfg.training.mixed_precision_param) == ("bfloat16", "bfloat16")
    source = Path(pytest.importorskip("torchtitan").__file__).parent / "config" / "configs.py"
    assert "without an extra copy of fp32 weights" in source.read_text()


def test_the_refusals_premises_megatron_and_deepspeed_keep_a_master_copy(  # type: ignore[no-untyped-def]
        megatron, deepspeed) -> None:
    """Megatron-Core's OptimizerConfig keeps `main_params_dtype` (fp32 unless its precision-aware optimizer takes
    fp16; Megatron-LM's `--main-params-dtype` offers fp32 and fp16); DeepSpeed's bf16 master weights are a setting of
    their dtype (`bf16_master_weights_and_grads`), not their absence."""
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config
    from megatron.core.optimizer.optimizer_config import OptimizerConfig
    assert "main_params_dtype" in {f.name for f in dataclasses.fields(OptimizerConfig)}
    assert "bf16_master_weights_and_grads" in DeepSpeedBF16Config.model_fields

def test_deepspeed_config_has_no_fp8(deepspeed) -> None:  # type: ignore[no-untyped-def]
    """The refusal's premise: DeepSpeed's config classes know bf16 and fp16, no FP8."""
    from deepspeed.runtime import config
    source = Path(config.__file__).read_text()
    assert "bf16" in source and "fp8" not in source.lower()


def test_a_mixture_of_experts_architecture_is_exported_from_its_config(  # type: ignore[no-untyped-def]
        megatron, tmp_path: Path, llama_plans: dict[str, Plan]) -> None:
    """A tester's Qwen2-MoE and DeepSeek-V3 exports left out their shared experts and DeepSeek's router: read from
    the plan's HF config, the experts' width, the shared experts (gated for Qwen2-MoE) and DeepSeek-V3's sigmoid
    scores, expert bias and scaling are written, as megatron-core's TransformerConfig fields."""
    import json

    from .conftest import ROOT
    moe = {"num_experts": 8, "top_k": 2}
    plan = dataclasses.replace(llama_plans["dp"], layout=dataclasses.replace(llama_plans["dp"].layout, ep=2),
                               hf_config={"task": "causal-lm", "seq_len": 64, "model_type": "deepseek_v3"},
                               model_path=str(ROOT / "examples" / "configs" / "deepseek-v3.json"))
    text = export_plan(plan, Target.MEGATRON, "x", moe=moe).text
    lines = text.splitlines()
    assert lines[lines.index("--moe-ffn-hidden-size 2048"):][:5] == [
        "--moe-ffn-hidden-size 2048", "--moe-shared-expert-intermediate-size 2048", "--moe-router-score-function sigmoid",
        "--moe-router-enable-expert-bias", "--moe-router-topk-scaling-factor 2.5"]
    cfg, _, _ = _megatron_config(text.replace(" 2.5\n", " 2\n"))  # its parser takes floats; this test's, integers
    assert (cfg.moe_ffn_hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.moe_router_score_function) == \
        (2048, 2048, "sigmoid") and cfg.moe_router_enable_expert_bias
    qwen2 = tmp_path / "qwen2moe.json"
    qwen2.write_text(json.dumps({"model_type": "qwen2_moe", "intermediate_size": 5632, "moe_intermediate_size": 1408,
                                 "shared_expert_intermediate_size": 5632, "norm_topk_prob": False,
                                 "tie_word_embeddings": False}))
    text = export_plan(dataclasses.replace(plan, model_path=str(qwen2)), Target.MEGATRON, "x", moe=moe).text
    lines = text.split()
    assert "--moe-shared-expert-gate" in lines and lines[lines.index("--moe-shared-expert-intermediate-size") + 1] == \
        "5632" and lines[lines.index("--moe-ffn-hidden-size") + 1] == "1408"
    cfg, _, _ = _megatron_config(text)  # Qwen2-MoE's weights are a softmax over every expert, not renormalized
    assert cfg.moe_router_pre_softmax and cfg.moe_shared_expert_gate and cfg.moe_shared_expert_intermediate_size == 5632
    dense = export_plan(llama_plans["dp"], Target.MEGATRON, "x").text
    assert "--moe-" not in dense


def test_the_combined_1f1b_a_plan_assumed_is_taken_by_megatron_core(  # type: ignore[no-untyped-def]
        megatron, titan, llama: Profile, llama_plans: dict[str, Plan]) -> None:
    """Issue 30: an interleaved plan with ep 2 that hid its all-to-alls under other microbatches' compute
    (`Overlap.ep_a2a`) asks Megatron for its combined 1F1B, which megatron-core's TransformerConfig takes (it
    asserts a virtual pipeline where pp > 1, expert parallelism, an all-to-all dispatcher, bf16 and no full
    recomputation); torchtitan, which runs none, gets a note and no flag; a 1F1B plan asks for nothing."""
    from autopp.data.overlap import Overlap
    interleaved = llama_plans["interleaved"]
    base = _llama_8b_like(dataclasses.replace(interleaved, layout=dataclasses.replace(interleaved.layout, dp=2)),
                          Activation.KEEP)
    plan = dataclasses.replace(base, device="h100-sxm", overlap=Overlap(ep_a2a=True),
                               layout=dataclasses.replace(base.layout, tp=1, sp=False, ep=2))
    moe = {"num_experts": 8, "top_k": 2}
    text = export_plan(plan, Target.MEGATRON, "x", moe=moe).text
    cfg, _, _ = _megatron_config(text)
    assert cfg.overlap_moe_expert_parallel_comm is True  # delay_wgrad_compute: Megatron-LM copies it to both configs
    assert cfg.ddp.delay_wgrad_compute is True
    assert cfg.virtual_pipeline_model_parallel_size == plan.layout.v and cfg.expert_model_parallel_size == 2
    titan_export = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama), moe=moe)
    assert "overlap" not in titan_export.text
    assert sum("runs them exposed" in n for n in titan_export.notes) == 1
    for bad, said in ((dataclasses.replace(plan, dtype="float32"), "on a bf16 or fp16 model only, and its model is "
                                                                   "float32"),
                      (dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, activation=Activation.BLOCKS)
                                                              for s in plan.stages)),
                       "recomputes every stage .recompute-units., which Megatron-Core refuses together")):
        with pytest.raises(ExportError, match=r"^plan: the plan hid expert all-to-alls \(`overlap` ep_a2a\).*" + said):
            export_plan(bad, Target.MEGATRON, "x", moe=moe)
    one = dataclasses.replace(plan, schedule=ScheduleName.ONE_F_ONE_B, layout=dataclasses.replace(plan.layout, v=1))
    exported = export_plan(one, Target.MEGATRON, "x", moe=moe)
    assert "--overlap-moe-expert-parallel-comm" not in exported.text
    assert sum("no --overlap-moe-expert-parallel-comm" in n for n in exported.notes) == 1

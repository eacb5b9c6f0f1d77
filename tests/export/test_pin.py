"""--pin-from: a trainer's configuration (written by `autopp export` or by hand) read back into the same split."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.cli import main
from autopp.export import ExportError, Target, export_plan, read_pinned, write_export
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.schedule import Activation, ScheduleName
from autopp.export.pin_megatron import SELECTIVE_READ

from .conftest import LLAMA, unit_modules


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "dp"])
@pytest.mark.parametrize("target", [Target.TORCHTITAN, Target.MEGATRON])
def test_export_reads_back_as_the_plan(name: str, target: Target, tmp_path: Path, llama: Profile,
                                       llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans[name]
    out = tmp_path / "x.args"
    write_export(export_plan(plan, target, out, [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]),
                 out)
    pinned = read_pinned(out, llama.meta.unit_names, plan.num_ranks)[0].candidate
    assert pinned.bounds == tuple(s.units for s in plan.stages)
    assert (pinned.schedule, pinned.layout) == (plan.schedule, plan.layout)
    assert (pinned.microbatches, pinned.microbatch_size) == (plan.num_microbatches, plan.microbatch_size)
    assert pinned.activations == tuple(s.activation for s in plan.stages)


def test_hand_written_megatron_args(tmp_path: Path, llama: Profile) -> None:
    args = tmp_path / "run.sh.args"
    args.write_text("# today's run\n--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \\\n"
                    "  --num-layers 4 --micro-batch-size 1 --global-batch-size 8 --use-distributed-optimizer\n"
                    "--recompute-modules core_attn mlp --seq-length 4096\n")
    pinned = read_pinned(args, llama.meta.unit_names, 2)[0].candidate
    assert pinned.bounds == ((0, 3), (3, 6))  # Megatron's even split: E + 2 layers | 2 layers + L
    assert (pinned.schedule, pinned.microbatches) == (ScheduleName.ONE_F_ONE_B, 8)
    args.write_text("--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout 'Et*3|tL'\n"
                    "--micro-batch-size 2 --global-batch-size 8 --recompute-granularity full "
                    "--recompute-method uniform --recompute-num-layers 1\n")
    pinned = read_pinned(args, llama.meta.unit_names, 2)[0].candidate
    assert pinned.bounds == ((0, 4), (4, 6)) and pinned.activations == (Activation.BLOCKS,) * 2
    assert pinned.microbatches == 4
    # uniform chunks of a stage's layers (here 3: 'Et*3') checkpoint each stage whole; chunks of 2 are not modelled
    args.write_text(args.read_text().replace("--recompute-num-layers 1", "--recompute-num-layers 3"))
    assert read_pinned(args, llama.meta.unit_names, 2)[0].candidate.activations == (Activation.RECOMPUTE,) * 2
    args.write_text(args.read_text().replace("--recompute-num-layers 3", "--recompute-num-layers 2"))
    with pytest.raises(ExportError, match=r"--recompute-method uniform --recompute-num-layers 2 is not modelled "
                                          r"\(stages of up to 3 layers\); autopp recomputes each layer or whole "
                                          r"stages"):
        read_pinned(args, llama.meta.unit_names, 2)


def test_hand_written_torchtitan_overrides_and_toml(tmp_path: Path, llama: Profile) -> None:
    over = tmp_path / "today.args"
    over.write_text("--parallelism.pipeline_parallel_degree=2\n--training.local_batch_size=8\n"
                    "--parallelism.pipeline_parallel_schedule=interleaved1f1b\n")
    pin, notes = read_pinned(over, llama.meta.unit_names, 2)
    pinned = pin.candidate
    # torchtitan's default: 2 stages per rank, embedding and output weighing one layer each: 4 + 2 = 6 over 4 stages
    assert pinned.bounds == ((0, 2), (2, 4), (4, 5), (5, 6))
    # torchtitan 0.3's default AC is selective, block by block: read as such (judged so where the profile has its
    # figures)
    assert pinned.schedule is ScheduleName.INTERLEAVED_1F1B and notes == []
    assert pinned.activations == (Activation.SELECTIVE_UNITS,) * 4
    toml = tmp_path / "llama.toml"
    toml.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n'
                    'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
                    '["layers.1", "layers.2", "layers.3", "norm", "output"]]\n'
                    '[training]\nlocal_batch_size = 8\n[activation_checkpoint]\nmode = "full"\n')
    pin, notes = read_pinned(toml, llama.meta.unit_names, 2)
    pinned = pin.candidate
    assert pinned.bounds == ((0, 2), (2, 6)) and pinned.microbatches == 4
    assert pinned.activations == (Activation.BLOCKS,) * 2
    assert notes == []


_MEGATRON_2_4 = "--pipeline-model-parallel-size 2 --num-layers 4 "


@pytest.mark.parametrize("text, match", [
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n",
     r"2 devices are not a multiple of pp 2 x tp 2 x replicate 1 .*; plan with --devices 4$"),
    ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --num-layers 4\n",
     r"2 devices are not a multiple of --pipeline-model-parallel-size 2 x --tensor-model-parallel-size 8 "
     r"\(Megatron's dp = world size / "
     r"\(pp x cp x tp\)\); plan with --devices 16$"),
    ("--parallelism.pipeline_parallel_degree=3\n", r"2 devices are not a multiple of pp 3 .*--devices 3$"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.data_parallel_shard_degree=2\n",
     r"pp 2 x dp 2 \(replicate 1 x shard 2\) != 2 devices; plan with --devices 4"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.data_parallel_shard_degree=0\n", r"must be >= 1 or -1"),
    ("--pipeline-model-parallel-size 3 --num-layers 4 --pipeline-model-parallel-layout Et|t|ttL\n",
     r"2 devices are not a multiple of --pipeline-model-parallel-size 3 .*--devices 3$"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.module_fqns_per_model_part "
     "tok_embeddings,layers.0 layers.1,layers.2 layers.3,norm,output\n", "3 stages are not a multiple of .* 2"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_schedule=Interleaved1F1B\n"
     "--parallelism.pipeline_parallel_layers_per_stage=x\n", "layers_per_stage must be an integer, got 'x'"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_schedule=Interleaved1F1B\n"
     "--parallelism.pipeline_parallel_layers_per_stage=0\n", "layers_per_stage must be >= 1, got 0"),
    ("--parallelism.pipeline_parallel_degree=0\n", "pipeline_parallel_degree must be >= 1, got 0"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_microbatch_size=0\n",
     "microbatch_size must be >= 1, got 0"),
    ("--pipeline-model-parallel-size 0 --num-layers 4\n", "pipeline-model-parallel-size must be >= 1, got 0"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 0\n", "micro-batch-size must be >= 1"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 0\n",
     "num-layers-per-virtual-pipeline-stage must be >= 1, got 0"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 3\n",
     "--num-layers 4 is not a multiple of pp 2 x --num-layers-per-virtual-pipeline-stage 3"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout Et|t|t|tL "
     "--micro-batch-size 1 --global-batch-size 3\n", "groups of pp \\(2\\).* it is 3"),
    ("--parallelism.pipeline_parallel_degree=2\n--training.local_batch_size=8\n--training.global_batch_size=32\n",
     "gradient accumulation"),
    ("--pipeline-model-parallel-size 2 --num-layers 6\n", "profile has 4 blocks"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout 'tt|EtL'\n", "open its first stage with E"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout 'EtE|ttL'\n", "open its first stage with E"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout 'EtL|ttL'\n", "open its first stage with E"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout '|Ett|ttL'\n", "open its first stage with E"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout 'Etttt|L|'\n", "open its first stage with E"),
    (_MEGATRON_2_4 + "--pipeline-model-parallel-layout 'Ett|tmtL'\n", "open its first stage with E"),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.module_fqns_per_model_part "
     "tok_embeddings,layers.0,layers.2 layers.1,layers.3,norm\n", "blocks 0..3 once"),
    ("--something-else 3\n", "neither torchtitan"),
    # a new user's: autopp's own export of a synthesized order; the refusal now says what to do
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_schedule=ZBVZeroBubble\n"
     "--parallelism.pipeline_parallel_schedule_csv=p.torchtitan.csv\n",
     "does not read schedule CSVs yet; remove that line to compare the named schedule it was made on "
     "\\(ZBVZeroBubble\\)$"),
])
def test_what_cannot_be_read_is_one_line(text: str, match: str, tmp_path: Path, llama: Profile) -> None:
    path = tmp_path / "cfg.args"
    path.write_text(text)
    with pytest.raises(ExportError, match=match) as info:
        read_pinned(path, llama.meta.unit_names, 2)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_plan_prints_both_plans(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = tmp_path / "megatron.args"
    args.write_text("--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1 --global-batch-size 8\n")
    code = main(["plan", "--profile", str(LLAMA), "--devices", "2", "--memory", "4GiB", "-o",
                 str(tmp_path / "p.plan.json"), "--pin-from", str(args)])
    out, err = capsys.readouterr()
    assert code == 0 and "your configuration" in out
    # issue 26: without --global-batch the pinned configuration's batch is planned, and said
    assert f"autopp: note: global batch 8 samples per step, that of {args} (the default with --pin-from)" in err
    yours = [line for line in out.splitlines() if line.strip().startswith("yours:")][0]
    assert "1F1B pp 2 x dp 1, v 1, 8 x 1, units per stage 3 x2" in yours
    step = [line.split() for line in out.splitlines() if line.strip().startswith("step time")][0]
    assert step[3] == step[5], step  # issue 26: both figures of a row in one unit (no 9595 ms beside 11.2 s)
    assert "bubble" in out and "peak memory" in out
    assert "as fast as" in out


def test_pin_from_refuses_another_global_batch_before_planning(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = tmp_path / "megatron.args"
    args.write_text("--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1 --global-batch-size 16\n")
    code = main(["plan", "--profile", str(LLAMA), "--devices", "2", "--memory", "4GiB", "--global-batch", "8", "-o",
                 str(tmp_path / "p.plan.json"), "--pin-from", str(args)])
    assert code == 2 and "give --global-batch 16" in capsys.readouterr().err
    assert not (tmp_path / "p.plan.json").exists()


@pytest.mark.parametrize("name, content, match", [
    ("cfg.toml", b"[parallelism]\npipeline_parallel_degree = true\n",
     "pipeline_parallel_degree must be an integer, got True"),
    ("cfg.toml", b"[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2.7\n",
     "microbatch_size must be an integer, got 2.7"),
    ("cfg.toml", b"[parallelism]\npipeline_parallel_degree = 2\n[training]\nlocal_batch_size = 0\n",
     "local_batch_size must be >= 1, got 0"),
    ("cfg.args", b"--num-layers \xff\xfe\x00\x01\n", "not a text file"),
    ("cfg.toml", b"\x89PNG\r\n\x1a\n\x00\x00", "not a text file"),
])
def test_bad_values_and_binary_files_are_one_line(name: str, content: bytes, match: str, tmp_path: Path,
                                                  llama: Profile) -> None:
    """Regression (issue 18 review): `true` was read as 1, 2.7 as 2, and a binary file raised UnicodeDecodeError."""
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ExportError, match=match) as info:
        read_pinned(path, llama.meta.unit_names, 2)
    assert "\n" not in str(info.value) and str(info.value).startswith(str(path))


def test_integral_toml_float_is_taken(tmp_path: Path, llama: Profile) -> None:
    path = tmp_path / "cfg.toml"
    path.write_text("[parallelism]\npipeline_parallel_degree = 2.0\n[training]\nlocal_batch_size = 8\n")
    assert read_pinned(path, llama.meta.unit_names, 2)[0].candidate.layout.pp == 2


_TITAN_V2 = b"--parallelism.pipeline_parallel_degree=2\n--parallelism.pipeline_parallel_schedule=Interleaved1F1B\n"


@pytest.mark.parametrize("content", [
    _TITAN_V2 + b"--parallelism.pipeline_parallel_layers_per_stage=x\n",  # was: ValueError traceback
    _TITAN_V2 + b"--parallelism.pipeline_parallel_layers_per_stage=0\n",  # was: ZeroDivisionError traceback
    b"\xff\xfe\x00binary",                                                # was: UnicodeDecodeError traceback
    b"--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout 'Et|tt||ttL' "
    b"--micro-batch-size 1 --global-batch-size 8\n",                      # was: exit 2 after the plan was written
], ids=["x", "zero", "binary", "empty-stage"])
def test_cli_bad_pin_is_exit_2_one_line_nothing_written(content: bytes, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    pin = tmp_path / "today.args"
    pin.write_bytes(content)
    out = tmp_path / "p.plan.json"
    code = main(["plan", "--profile", str(LLAMA), "--devices", "2", "--memory", "4GiB", "-o", str(out),
                 "--pin-from", str(pin)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(pin) in err[0], err
    assert not out.exists()


def test_cli_missing_pin_file_is_refused_before_profiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from .conftest import ROOT
    monkeypatch.chdir(tmp_path)  # no profiles/gpt here: a late check would profile the model first
    code = main(["plan", str(ROOT / "examples" / "gpt.py"), "--devices", "2", "--memory", "4GiB",
                 "--pin-from", "missing.args"])
    err = capsys.readouterr().err
    assert code == 2 and "missing.args: no such file" in err and "profiling" not in err
    assert list(tmp_path.iterdir()) == []


# ---- every axis, ZeRO, SP and recomputation (issue 26, point 6) ---------------------------------------------------

def _read(tmp_path: Path, llama: Profile, text: str, devices: int,  # type: ignore[no-untyped-def]
          name: str = "cfg.args"):
    path = tmp_path / name
    path.write_text(text)
    return read_pinned(path, llama.meta.unit_names, devices)


@pytest.mark.parametrize("text, tp, sp, dp, zero, policy", [
    # torchtitan: SP on by default; FSDP over the devices left over, kept whole under PP ("default" -> never: ZeRO 1)
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n", 2, True, 2, 1,
     Activation.SELECTIVE_UNITS),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n"
     "--parallelism.no_enable_sequence_parallel\n--parallelism.fsdp_reshard_after_forward=always\n"
     "activation_checkpoint:full\n", 2, False, 2, 3, Activation.BLOCKS),
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.data_parallel_replicate_degree=4\n"
     "--parallelism.data_parallel_shard_degree=1\nactivation_checkpoint:none\n", 1, False, 4, 0, Activation.KEEP),
    # Megatron: dp = world / (pp x tp); --use-distributed-optimizer is ZeRO 1, Megatron-FSDP's strategy ZeRO 3
    ("--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2 --num-layers 4 "
     "--micro-batch-size 1 --global-batch-size 16 --use-distributed-optimizer --recompute-activations\n",
     2, True, 2, 1, Activation.KEEP),  # Megatron's selective: core_attn, nearly nothing under fused attention
    ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --num-layers 4 --global-batch-size 8 "
     "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --recompute-granularity full "
     "--recompute-method uniform --recompute-num-layers 1\n", 4, False, 1, 0, Activation.BLOCKS),
    # Megatron-FSDP with what Megatron-LM requires beside it, and without --use-distributed-optimizer (which its v1
    # sets itself): still ZeRO 3
    ("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --num-layers 4 --global-batch-size 8 "
     "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor\n",
     2, False, 4, 3, Activation.KEEP),
])
def test_tp_sp_zero_and_recomputation_are_read(text: str, tp: int, sp: bool, dp: int, zero: int,
                                               policy: Activation, tmp_path: Path, llama: Profile) -> None:
    """Issue 26, point 6: --pin-from refused tensor parallelism; it reads every axis, ZeRO stage and policy as the
    registries spell them for the trainer (ZeRO needs dp > 1: with dp 1 there is nothing to shard)."""
    pinned, notes = _read(tmp_path, llama, text, 8)
    layout = pinned.candidate.layout
    assert (layout.tp, layout.sp, layout.dp, layout.zero.stage) == (tp, sp, dp, zero)
    assert layout.world == 8 and pinned.candidate.activations == (policy,) * len(pinned.candidate.bounds)
    assert notes == ([SELECTIVE_READ] if "--recompute-activations" in text else [])


def test_megatrons_selective_recomputation_of_other_modules_is_refused(tmp_path: Path, llama: Profile) -> None:
    """Megatron's selective recomputation recomputes whole submodules (`--recompute-modules`), not autopp's
    selective policy: core_attn alone (its default) is read as keep, any other module is refused, not guessed."""
    base = ("--pipeline-model-parallel-size 2 --num-layers 4 --global-batch-size 8 --recompute-granularity selective")
    assert _read(tmp_path, llama, base + " --recompute-modules core_attn\n", 8)[1] == [SELECTIVE_READ]
    with pytest.raises(ExportError, match=r"--recompute-modules core_attn mlp is not modelled .*; pin from a config "
                                          r"with --recompute-granularity full, or none$"):
        _read(tmp_path, llama, base + " --recompute-modules core_attn mlp\n", 8)


def test_hsdp_and_expert_parallelism_are_read(tmp_path: Path, llama: Profile) -> None:
    pinned, notes = _read(tmp_path, llama, "--parallelism.pipeline_parallel_degree=2\n"
                          "--parallelism.data_parallel_replicate_degree=2\n--parallelism.data_parallel_shard_degree=2\n"
                          "--parallelism.expert_parallel_degree=2\n--training.local_batch_size=4\n", 8)
    layout = pinned.candidate.layout
    assert (layout.dp, layout.ep, layout.zero.stage) == (4, 2, 1)
    assert notes == ["HSDP (replicate 2 x shard 2) with expert parallelism is evaluated as ZeRO 1 over all 4 "
                     "data-parallel ranks: autopp plans HSDP without ep"]
    pinned, notes = _read(tmp_path, llama, "--parallelism.data_parallel_replicate_degree=2\n"
                          "--parallelism.data_parallel_shard_degree=4\n--training.local_batch_size=4\n", 8)
    layout = pinned.candidate.layout  # issue 25: torchtitan's HSDP read as HSDP, resharded after forward at pp 1
    assert (layout.dp, layout.dp_replicate, layout.shard, layout.zero.stage, layout.fsdp) == (8, 2, 4, 3, True)
    assert notes == []
    pinned, notes = _read(tmp_path, llama, "--parallelism.data_parallel_shard_degree=8\n"
                          "--parallelism.expert_parallel_degree=2\n--training.local_batch_size=4\n", 8)
    layout = pinned.candidate.layout  # issue 30: FSDP beside ep at pp 1, as torchtitan runs its MoE models
    assert (layout.pp, layout.dp, layout.ep, layout.zero.stage, layout.fsdp) == (1, 8, 2, 3, True)
    assert notes == []
    pinned, _ = _read(tmp_path, llama, "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                      "--num-layers 4 --global-batch-size 8\n", 4)
    assert (pinned.candidate.layout.dp, pinned.candidate.layout.ep, pinned.ep_a2a) == (2, 2, False)
    pinned, _ = _read(tmp_path, llama, "--expert-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                      "--num-layers 4 --global-batch-size 8 --overlap-moe-expert-parallel-comm "
                      "--delay-wgrad-compute\n", 4)
    assert pinned.ep_a2a  # issue 30: the EP A2A overlap the file runs, evaluated with it (`evaluate_pinned`)
    with pytest.raises(ExportError, match=r"cfg.args: .*ep\(3\).*"):
        _read(tmp_path, llama, "--expert-model-parallel-size 3 --pipeline-model-parallel-size 2 --num-layers 4 "
                               "--global-batch-size 8\n", 4)
    # issue 24's proof axis: Megatron's --expert-tensor-parallel-size read back through etp's descriptor alone
    pinned, _ = _read(tmp_path, llama, "--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                      "--pipeline-model-parallel-size 2 --num-layers 4 --global-batch-size 8\n", 8)
    assert (pinned.candidate.layout.dp, pinned.candidate.layout.ep, pinned.candidate.layout.etp) == (4, 2, 2)
    with pytest.raises(ExportError, match=r"cfg.args: ep\(2\) x etp\(2\) must divide dp\(2\)"):
        _read(tmp_path, llama, "--expert-model-parallel-size 2 --expert-tensor-parallel-size 2 "
                               "--pipeline-model-parallel-size 2 --num-layers 4 --global-batch-size 8\n", 4)


@pytest.mark.parametrize("text", ["--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n",
                                  "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --num-layers 4\n"])
def test_an_axis_autopp_does_not_plan_is_refused_naming_key_and_value(text: str, tmp_path: Path, llama: Profile,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An axis whose descriptor says another issue adds it (as cp's did until then) is refused in one line naming
    the trainer's key and the value; the reader takes the axes from the registry, so tp stands in here."""
    from dataclasses import replace
    from autopp.data import axes
    monkeypatch.setitem(axes.AXES, "tp", replace(axes.AXES["tp"], unplanned="issue 99"))
    key = "parallelism.tensor_parallel_degree" if "parallelism" in text else "--tensor-model-parallel-size"
    with pytest.raises(ExportError, match=rf"cfg.args: {key} 2: autopp does not plan tensor parallelism \(issue 99\) "
                                          rf"yet, so it cannot judge this configuration; compare one with {key} 1$"):
        _read(tmp_path, llama, text, 4)


@pytest.mark.parametrize("name", ["1f1b", "dp"])
@pytest.mark.parametrize("target", [Target.TORCHTITAN, Target.MEGATRON])
def test_a_3d_export_reads_back_as_the_plan(name: str, target: Target, tmp_path: Path, llama: Profile,
                                            llama_plans: dict[str, Plan]) -> None:
    """tp 2 with SP, ZeRO 1 where dp > 1, every stage recomputing: written by the exporter, read back the same."""
    from dataclasses import replace
    from autopp.data.zero import ZERO
    base = llama_plans[name]
    layout = replace(base.layout, tp=2, sp=True, zero=ZERO[1] if base.layout.dp > 1 else ZERO[0])
    plan = replace(base, layout=layout, stages=tuple(replace(s, activation=Activation.BLOCKS) for s in base.stages))
    out = tmp_path / "x.args"
    write_export(export_plan(plan, target, out, unit_modules(llama)), out)
    pinned = read_pinned(out, llama.meta.unit_names, plan.num_ranks)[0].candidate
    assert (pinned.layout, pinned.bounds) == (plan.layout, tuple(s.units for s in plan.stages))
    assert pinned.activations == tuple(s.activation for s in plan.stages)


# ---- the newcomer's comparison (issue 26, done-when) --------------------------------------------------------------

@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_hand_written_tp8_torchtitan_config_for_llama_3_8b_on_2x8_h100(capsys: pytest.CaptureFixture[str],
                                                                      tmp_path: Path) -> None:
    """examples/torchtitan/llama-3-8b-tp8-2x8-h100.toml (TP 8 x PP 2 with SP, selective AC) compared with autopp's plan
    on the shipped analytic Llama-3-8B profile: the first screen is "yours vs autopp's", each with where its time
    goes, and the terms add up to each step."""
    from .conftest import ROOT
    toml = ROOT / "examples" / "torchtitan" / "llama-3-8b-tp8-2x8-h100.toml"
    code = main(["plan", "--profile", str(ROOT / "profiles" / "llama-3-8b-h100-sxm-s8192"), "--device", "h100-sxm",
                 "--nodes", "2", "--global-batch", "16", "--pin-from", str(toml), "-o", str(tmp_path / "p.plan.json")])
    out, err = capsys.readouterr()
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"your configuration ({toml}) beside autopp's plan")  # the first screen
    assert lines[1] == "  yours:  1F1B pp 2 x dp 1 x tp 8 + SP, v 1, 16 x 1, units per stage 17 x2"
    assert lines[3].split() == ["yours", "autopp"]
    labels = [line.strip().split("  ")[0] for line in lines[4:13]]
    end = labels.index("fits")
    assert [x for x in labels[:end + 1] if x != "data-parallel sync"] == \
        ["step time", "compute and sends", "pipeline bubble", "optimizer step", "bubble", "peak memory", "fits"]
    assert lines[5 + end].strip().startswith(("autopp's plan is predicted", "your configuration is predicted"))
    assert any("activation policy selective-units evaluated as keep" in line for line in lines)  # none at tp 8
    assert out.index("autopp's plan in full:") < out.index("wrote plan")
    from autopp.data.plan import load_plan
    from autopp.export.compare import time_terms
    plan = load_plan(tmp_path / "p.plan.json")
    assert sum(s for _, s in time_terms(plan)) == pytest.approx(plan.predicted.step_time_s, rel=1e-12)
    # autopp's plan is searched for the file's trainer (a plan torchtitan runs, so "yours vs autopp's" compares two
    # configurations both run), said after the search, with the unrestricted optimum beside it
    assert "autopp: note: --for torchtitan, the trainer of " in err
    assert "without --for torchtitan" in out
    from autopp.data.profile import load_profile
    names = load_profile(ROOT / "profiles" / "llama-3-8b-h100-sxm-s8192").unit_modules()
    assert export_plan(plan, Target.TORCHTITAN, "x.args", names).text  # torchtitan runs it: no refusal


def test_the_profile_made_for_pin_from_has_rows_of_its_tp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A model profiled by `autopp plan` for --pin-from gets tensor-parallel rows of the file's tp (read before any
    profile exists: `config_degrees`), besides those of the request's."""
    from autopp.cli import plan as cli_plan
    from autopp.errors import AutoppError
    from autopp.export import config_degrees
    from .conftest import ROOT
    asked: list[int | None] = []

    def stop(args: object, tp: int | None = 1) -> None:
        asked.append(tp)
        raise AutoppError("stopped before profiling")
    monkeypatch.setattr(cli_plan, "profile_for", stop)
    monkeypatch.chdir(tmp_path)
    pin = tmp_path / "t.args"
    for text, flags, want in [("--parallelism.tensor_parallel_degree=2\n", [], 2),
                              ("--parallelism.pipeline_parallel_degree=2\n", [], 1),
                              ("--tensor-model-parallel-size 2 --num-layers 4\n", ["--tp", "2"], 2),
                              ("--tensor-model-parallel-size 2 --num-layers 4\n", ["--tp", "auto"], None)]:
        pin.write_text(text)
        assert config_degrees(pin)["tp"] == (2 if "tensor" in text else 1)
        assert main(["plan", str(ROOT / "examples" / "gpt.py"), "--devices", "4", "--memory", "4GiB", *flags,
                     "--pin-from", str(pin)]) == 2
        assert "stopped before profiling" in capsys.readouterr().err
    assert asked == [2, 1, 2, None]


@pytest.mark.parametrize("text", [
    # torchtitan: FSDP is on whenever dp_shard > 1 or cp > 1 (ParallelDims.fsdp_enabled), over dp_shard x cp
    "--parallelism.pipeline_parallel_degree=2\n--parallelism.context_parallel_degree=2\n"
    "--parallelism.data_parallel_shard_degree=1\n",
    # Megatron: the distributed optimizer shards over the data-parallel group with cp (dp x cp ranks)
    "--pipeline-model-parallel-size 2 --context-parallel-size 2 --num-layers 4 --global-batch-size 8 "
    "--use-distributed-optimizer\n"])
def test_zero_over_cp_alone_is_read(text: str, tmp_path: Path, llama: Profile) -> None:
    """Review: with dp 1 and cp 2 the trainers shard over the 2 cp ranks (`Layout.sync`), which --pin-from read as
    ZeRO 0 (it kept a ZeRO stage only for dp > 1), so the pinned plan was costed with whole replicas."""
    pinned, _ = _read(tmp_path, llama, text, 4)
    layout = pinned.candidate.layout
    assert (layout.dp, layout.cp, layout.sync, layout.zero.stage) == (1, 2, 2, 1)


def test_hsdp_over_cp_alone_is_read_as_fsdp_over_dp_and_cp(tmp_path: Path, llama: Profile) -> None:
    """torchtitan's HSDP whose shard group is the cp ranks alone (shard 1): FSDP over all dp x cp ranks, said."""
    pinned, notes = _read(tmp_path, llama, "--parallelism.pipeline_parallel_degree=2\n"
                          "--parallelism.context_parallel_degree=2\n--parallelism.data_parallel_replicate_degree=2\n"
                          "--parallelism.data_parallel_shard_degree=1\n--training.local_batch_size=4\n", 8)
    layout = pinned.candidate.layout
    assert (layout.dp, layout.cp, layout.dp_replicate, layout.zero.stage) == (2, 2, 1, 1)
    assert notes == ["HSDP (replicate 2 x shard 1 x cp 2) is evaluated as ZeRO 1 over all 2 x 2 data-parallel and "
                     "cp ranks: autopp's HSDP shards over dp ranks"]


@pytest.mark.parametrize("text, suffix, seq", [
    ("[training]\nseq_len = 8192\n[parallelism]\npipeline_parallel_degree = 2\n", ".toml", 8192),
    ("--parallelism.pipeline_parallel_degree=2\n--training.seq_len=4096\n", ".args", 4096),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --seq-length 2048\n", ".args", 2048),
    ("--pipeline-model-parallel-size 2 --num-layers 4\n", ".args", None)])
def test_the_configuration_s_sequence_length_is_read(text: str, suffix: str, seq: int | None,
                                                     tmp_path: Path) -> None:
    from autopp.export import config_seq_len
    pin = tmp_path / f"c{suffix}"
    pin.write_text(text)
    assert config_seq_len(pin) == seq


@pytest.mark.parametrize("text, suffix, kernels", [
    ("[compile]\nenable = true\n[parallelism]\npipeline_parallel_degree = 2\n", ".toml", "fused"),
    ("[compile]\nenable = false\n", ".toml", "eager"),
    ("--parallelism.pipeline_parallel_degree=2\n--compile.enable\n", ".args", "fused"),
    ("--parallelism.pipeline_parallel_degree=2\n", ".args", "eager"),
    ("--pipeline-model-parallel-size 2 --num-layers 4\n", ".args", "fused"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --transformer-impl local\n", ".args", "eager")])
def test_the_configuration_s_kernels_are_read(text: str, suffix: str, kernels: str, tmp_path: Path) -> None:
    """torchtitan fuses only with compile.enable; Megatron-LM unless --transformer-impl local (autopp.export.pin)."""
    from autopp.cli.pin_from import _kernels_note
    from autopp.export import config_kernels
    pin = tmp_path / f"c{suffix}"
    pin.write_text(text)
    assert config_kernels(pin)[0] == kernels

    class Counted:  # a profile's metadata, as `_kernels_note` reads it
        class meta:
            extra = {"analytic": {"kernels": "eager"}}
    note = _kernels_note(str(pin), Counted())
    assert note == ([] if kernels == "eager" else [f"{pin} runs fused elementwise kernels ({config_kernels(pin)[1]}), "
                                                   "the profile counted eager: both configurations are predicted "
                                                   "with eager kernels, so yours runs faster than its prediction; "
                                                   "count the profile with `--kernels fused` to judge it as it runs"])


def test_pin_from_profiles_at_the_configuration_s_sequence_length(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26: `plan --hf-config C --pin-from TOML` profiled at the 512-token default a TOML of 8192 tokens; the
    file's length is now the profile's, said in one line (and in the profile command it stands for), and another
    --seq-len is refused before any work."""
    from autopp.cli import plan as cli_plan
    from autopp.errors import AutoppError
    from .conftest import ROOT
    seen: list[int | None] = []

    def stop(args: object, tp: int | None = 1) -> None:
        seen.append(getattr(args, "seq_len"))
        raise AutoppError("stopped before profiling")
    monkeypatch.setattr(cli_plan, "profile_for", stop)
    monkeypatch.chdir(tmp_path)
    pin = tmp_path / "t.args"
    pin.write_text("--parallelism.pipeline_parallel_degree=2\n--training.seq_len=16\n")
    tiny = ["plan", "--hf-config", str(ROOT / "examples" / "configs" / "tiny-llama.json"), "--devices", "2",
            "--memory", "4GiB", "--pin-from", str(pin)]
    assert main(tiny) == 2 and main([*tiny, "--seq-len", "16"]) == 2
    assert seen == [16, 16]
    capsys.readouterr()
    assert main([*tiny, "--seq-len", "8"]) == 2
    assert capsys.readouterr().err.strip() == (f"autopp: error: {pin}: its sequence length is 16 tokens, --seq-len "
                                               "is 8; give --seq-len 16 so both plans train the same sequences")
    assert seen == [16, 16] and not list(tmp_path.glob("*.json"))


def test_torchtitan_without_pp_runs_the_microbatches_as_accumulation_steps(tmp_path: Path, llama: Profile) -> None:
    """At pp 1 torchtitan's forward takes `local_batch_size` samples and repeats global / (local x dp) times
    (trainer.py: gradient_accumulation_steps); the export writes the plan's microbatches that way, not as one local
    batch of m x b, and --pin-from reads them back."""
    from autopp.data.layout import LayoutPins
    from autopp.data.zero import ZERO
    from .conftest import plan_for
    plan = plan_for(llama, devices=2, pins=LayoutPins(pp=1, dp=2, zero=ZERO[3]), num_microbatches=4)
    assert (plan.layout.pp, plan.num_microbatches, plan.microbatch_size) == (1, 4, 1)
    lines = export_plan(plan, Target.TORCHTITAN, "x.args", unit_modules(llama)).text.splitlines()
    assert "--training.local_batch_size=1" in lines and "--training.global_batch_size=8" in lines
    pinned, _ = _read(tmp_path, llama, "\n".join(lines[:-1]) + "\n", 2)  # without the activation subcommand
    c = pinned.candidate
    assert (c.microbatches, c.microbatch_size, c.layout.pp, c.layout.dp) == (4, 1, 1, 2)


def test_a_faster_configuration_of_yours_says_which_pin_held_autopps_search() -> None:
    """A new user's `--pin-from l70m.args --pp 4`: theirs (pp 8) was faster and the table said it lay outside
    autopp's search "e.g. more memory than --memory allows"; it names the pins autopp's search kept that theirs
    does not, and says the generic reason only where there is none."""
    from dataclasses import replace

    from autopp.data.layout import LayoutPins
    from autopp.data.plan import load_plan
    from autopp.export.compare import format_comparison
    ours = load_plan(Path(__file__).resolve().parents[1] / "solve" / "golden" / "gpt-pp2-1f1b.json")
    yours = replace(ours, layout=replace(ours.layout, dp=2),
                    predicted=replace(ours.predicted, step_time_s=ours.predicted.step_time_s / 2))
    held = format_comparison(yours, ours, "cfg.args", pins=LayoutPins(pp=2, dp=1))
    assert "your configuration is predicted 2.00x as fast as autopp's plan (autopp's search was held to `dp` 1 " \
           "(yours 2))" in held
    free = format_comparison(yours, ours, "cfg.args", pins=LayoutPins(pp=2, dp=None))
    assert "(it lies outside autopp's search, e.g. more memory than `memory_bytes` allows)" in free

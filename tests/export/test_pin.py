"""--pin-from: a trainer's configuration (written by `autopp export` or by hand) read back into the same split."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.cli import main
from autopp.export import ExportError, Target, export_plan, read_pinned, write_export
from autopp.data.plan import Plan
from autopp.data.profile import Profile
from autopp.schedule import Activation, ScheduleName

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
    assert pinned.bounds == ((0, 4), (4, 6)) and pinned.activations == (Activation.RECOMPUTE,) * 2
    assert pinned.microbatches == 4


def test_hand_written_torchtitan_overrides_and_toml(tmp_path: Path, llama: Profile) -> None:
    over = tmp_path / "today.args"
    over.write_text("--parallelism.pipeline_parallel_degree=2\n--training.local_batch_size=8\n"
                    "--parallelism.pipeline_parallel_schedule=interleaved1f1b\n")
    pin, notes = read_pinned(over, llama.meta.unit_names, 2)
    pinned = pin.candidate
    # torchtitan's default: 2 stages per rank, embedding and output weighing one layer each: 4 + 2 = 6 over 4 stages
    assert pinned.bounds == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert pinned.schedule is ScheduleName.INTERLEAVED_1F1B and "'selective' is evaluated as none" in notes[0]
    toml = tmp_path / "llama.toml"
    toml.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n'
                    'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
                    '["layers.1", "layers.2", "layers.3", "norm", "output"]]\n'
                    '[training]\nlocal_batch_size = 8\n[activation_checkpoint]\nmode = "full"\n')
    pin, notes = read_pinned(toml, llama.meta.unit_names, 2)
    pinned = pin.candidate
    assert pinned.bounds == ((0, 2), (2, 6)) and pinned.microbatches == 4
    assert pinned.activations == (Activation.RECOMPUTE,) * 2
    assert notes == []


_MEGATRON_2_4 = "--pipeline-model-parallel-size 2 --num-layers 4 "


@pytest.mark.parametrize("text, match", [
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n",
     r"tensor_parallel_degree = 2: --pin-from does not read .*autopp plan --tp T --pp P --dp D --zero Z"),
    ("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 2 --num-layers 4\n",
     r"--tensor-model-parallel-size 8: --pin-from does not read .*autopp plan --tp T"),
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

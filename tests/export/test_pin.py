"""--pin-from: a trainer's configuration (written by `autopp export` or by hand) read back into the same split."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.cli import main
from autopp.export import ExportError, Target, export_plan, read_pinned, write_export
from autopp.plan import Plan
from autopp.profile import Profile
from autopp.schedule import ScheduleName

from .conftest import LLAMA, unit_modules


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "dp"])
@pytest.mark.parametrize("target", [Target.TORCHTITAN, Target.MEGATRON])
def test_export_reads_back_as_the_plan(name: str, target: Target, tmp_path: Path, llama: Profile,
                                       llama_plans: dict[str, Plan]) -> None:
    plan = llama_plans[name]
    out = tmp_path / "x.args"
    write_export(export_plan(plan, target, out, [[m.replace("model.", "") for m in ms] for ms in unit_modules(llama)]),
                 out)
    pinned, _ = read_pinned(out, llama.meta.unit_names, plan.num_ranks)
    assert pinned.bounds == tuple(s.units for s in plan.stages)
    assert (pinned.schedule.value, pinned.pp, pinned.dp, pinned.virtual_stages) == \
        (plan.schedule, plan.pp, plan.dp, plan.virtual_stages)
    assert (pinned.microbatches, pinned.microbatch_size) == (plan.num_microbatches, plan.microbatch_size)
    assert pinned.recompute == tuple(s.recompute for s in plan.stages)


def test_hand_written_megatron_args(tmp_path: Path, llama: Profile) -> None:
    args = tmp_path / "run.sh.args"
    args.write_text("# today's run\n--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \\\n"
                    "  --num-layers 4 --micro-batch-size 1 --global-batch-size 8 --use-distributed-optimizer\n"
                    "--recompute-modules core_attn mlp --seq-length 4096\n")
    pinned, _ = read_pinned(args, llama.meta.unit_names, 2)
    assert pinned.bounds == ((0, 3), (3, 6))  # Megatron's even split: E + 2 layers | 2 layers + L
    assert (pinned.schedule, pinned.microbatches) == (ScheduleName.ONE_F_ONE_B, 8)
    args.write_text("--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout 'Et*3|tL'\n"
                    "--micro-batch-size 2 --global-batch-size 8 --recompute-granularity full "
                    "--recompute-method uniform --recompute-num-layers 1\n")
    pinned, _ = read_pinned(args, llama.meta.unit_names, 2)
    assert pinned.bounds == ((0, 4), (4, 6)) and pinned.recompute == (True, True) and pinned.microbatches == 4


def test_hand_written_torchtitan_overrides_and_toml(tmp_path: Path, llama: Profile) -> None:
    over = tmp_path / "today.args"
    over.write_text("--parallelism.pipeline_parallel_degree=2\n--training.local_batch_size=8\n"
                    "--parallelism.pipeline_parallel_schedule=interleaved1f1b\n")
    pinned, notes = read_pinned(over, llama.meta.unit_names, 2)
    # torchtitan's default: 2 stages per rank, embedding and output weighing one layer each: 4 + 2 = 6 over 4 stages
    assert pinned.bounds == ((0, 2), (2, 4), (4, 5), (5, 6))
    assert pinned.schedule is ScheduleName.INTERLEAVED_1F1B and "'selective' is evaluated as none" in notes[0]
    toml = tmp_path / "llama.toml"
    toml.write_text('[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_microbatch_size = 2\n'
                    'module_fqns_per_model_part = [["tok_embeddings", "layers.0"], '
                    '["layers.1", "layers.2", "layers.3", "norm", "output"]]\n'
                    '[training]\nlocal_batch_size = 8\n[activation_checkpoint]\nmode = "full"\n')
    pinned, notes = read_pinned(toml, llama.meta.unit_names, 2)
    assert pinned.bounds == ((0, 2), (2, 6)) and pinned.microbatches == 4 and pinned.recompute == (True, True)
    assert notes == []


@pytest.mark.parametrize("text, match", [
    ("--parallelism.pipeline_parallel_degree=2\n--parallelism.tensor_parallel_degree=2\n", "tensor"),
    ("--parallelism.pipeline_parallel_degree=3\n", r"pp 3 x dp 0 != 2 devices"),
    ("--parallelism.pipeline_parallel_degree=2\n--training.local_batch_size=8\n--training.global_batch_size=32\n",
     "gradient accumulation"),
    ("--pipeline-model-parallel-size 2 --num-layers 6\n", "profile has 4 blocks"),
    ("--pipeline-model-parallel-size 2 --num-layers 4 --pipeline-model-parallel-layout tt|EtL\n", "start with E"),
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
    out = capsys.readouterr().out
    assert code == 0 and "your configuration" in out
    yours = [line for line in out.splitlines() if line.strip().startswith("yours:")][0]
    assert "1F1B pp 2 x dp 1, v 1, 8 x 1, units per stage 3 3" in yours
    assert "step time" in out and "bubble" in out and "peak memory" in out
    assert "as fast as" in out


def test_pin_from_refuses_another_global_batch_before_planning(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    args = tmp_path / "megatron.args"
    args.write_text("--pipeline-model-parallel-size 2 --num-layers 4 --micro-batch-size 1 --global-batch-size 16\n")
    code = main(["plan", "--profile", str(LLAMA), "--devices", "2", "--memory", "4GiB", "-o",
                 str(tmp_path / "p.plan.json"), "--pin-from", str(args)])
    assert code == 2 and "give --global-batch 16" in capsys.readouterr().err
    assert not (tmp_path / "p.plan.json").exists()

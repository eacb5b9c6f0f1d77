"""`autopp run` of a plan with vocabulary parallelism (autopp.run.vocab_run): planned with `--vocab auto` on a
head-heavy model (examples/gpt_big_vocab.py) it is chosen, and it runs 3 steps of the plan's optimizer validated
(every step's loss and gradients, the vocabulary shards included, and its optimizer update, against one process from
the same parameters) under 1F1B and GPipe on 2 ranks, and pinned (`--vocab 2`) on 4 ranks; a reference that skips
the optimizer step fails the GPipe run's ranks (replayed); what it does not run is refused in one line before any
rank starts."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.data.layout import Layout
from autopp.data.plan import Plan, Prediction, StagePlan
from autopp.data.vocab import VocabVariant
from autopp.errors import RunError
from autopp.model.contract import ModelFile
from autopp.data.plan import load_plan
from autopp.run import runner
from autopp.run.options import Nodes, RunOptions
from autopp.run.steps import ReferenceModel
from autopp.run.vocab_run import VOCAB_NOTE, vocab_job, vocab_reference
from autopp.schedule import ScheduleName

ROOT = Path(__file__).parent.parent.parent
BIG_VOCAB = ROOT / "examples" / "gpt_big_vocab.py"


def _plan() -> Plan:
    stages = tuple(StagePlan(index=i, rank=i, units=u, unit_names=names, split_point="h.1" if i else None,
                             forward_s=1.0, backward_s=2.0, memory_bytes=10)
                   for i, (u, names) in enumerate([((0, 2), ("tok_emb", "h.0")), ((2, 4), ("h.1", "ln_f"))]))
    pred = Prediction(step_time_s=12.0, peak_memory_bytes=(10, 10), bubble_fraction=0.25)
    return Plan(model_path=str(BIG_VOCAB), fingerprint="abc", schedule=ScheduleName.GPIPE, layout=Layout(pp=2),
                num_microbatches=4, microbatch_size=1, memory_limit_bytes=100, stages=stages, predicted=pred,
                vocab=VocabVariant.VOCAB_2, seed=3)


def test_the_plan_becomes_the_vocabulary_job() -> None:
    job = vocab_job(_plan(), RunOptions())
    assert (job.split_points, job.schedule, job.pp, job.num_microbatches, job.microbatch_size, job.v, job.seed) == \
        (("h.1",), ScheduleName.GPIPE, 2, 4, 1, 1, 3)
    assert job.variant is VocabVariant.VOCAB_2
    assert vocab_job(replace(_plan(), vocab=VocabVariant.VOCAB_1), RunOptions()).variant is VocabVariant.VOCAB_1


@pytest.mark.parametrize("options,plan", [
    (RunOptions(nodes=Nodes(nnodes=2)), _plan()),
    (RunOptions(backend="nccl"), _plan()),
    (RunOptions(), replace(_plan(), hf_config={"seq_len": 8, "task": "causal-lm"})),
])
def test_what_it_does_not_run_is_refused_in_one_line(options: RunOptions, plan: Plan) -> None:
    with pytest.raises(RunError, match=r"^vocabulary parallelism \(vocab-2\) runs a model file on local gloo ranks "
                                       r"only: drop --nnodes and --backend nccl \(plans of an HF config: not yet\)$"):
        vocab_job(plan, options)


def _validated(path: Path, shards: set[str], optimizer: str = "sgd", run_dir: Path | None = None) -> None:
    """`autopp run PATH --steps 3 --optimizer OPTIMIZER` (the ranks' files kept in `run_dir`, if given): every step
    validated, the shards among the gradients compared, measured vs predicted reported."""
    kept = ["--run-dir", str(run_dir)] if run_dir else []
    assert main(["run", str(path), "--steps", "3", "--optimizer", optimizer, "--timeout", "600", *kept]) == 0
    report = json.loads(path.with_suffix(".report.json").read_text())
    assert report["passed"] and report["failed_steps"] == [] and report["grad_max_rel_diff"] < 1e-4
    assert len(report["losses"]) == len(report["reference_losses"]) == len(report["step_times_s"]) == 3
    assert report["optimizer"] == optimizer and VOCAB_NOTE in report["notes"]
    assert report["measured_step_time_s"] > 0 and report["step_time_ratio"] is not None
    assert shards <= {d["name"] for d in report["grad_diffs"]}


@pytest.mark.integration
def test_planned_on_a_head_heavy_model_and_run_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prof = tmp_path / "prof"
    assert main(["profile", str(BIG_VOCAB), "--microbatch-sizes", "1", "--repeats", "2", "--warmup", "1",
                 "-o", str(prof)]) == 0
    assert json.loads((prof / "meta.json").read_text())["extra"]["vocab"]["head"] == "head"
    plans = {"1F1B": tmp_path / "a.json", "GPipe": tmp_path / "b.json"}
    common = ["--profile", str(prof), "--devices", "2", "--memory", "4GiB", "--pp", "2", "--global-batch", "4"]
    assert main(["plan", *common, "--schedule", "1F1B", "-o", str(plans["1F1B"])]) == 0  # --vocab auto, the default
    assert main(["plan", *common, "--schedule", "GPipe", "--vocab", "2", "-o", str(plans["GPipe"])]) == 0
    ranks = tmp_path / "ranks"
    for schedule, path in plans.items():
        data = json.loads(path.read_text())
        assert data["vocab"] == "vocab-2" and data["schedule"] == schedule
        _validated(path, {"head.weight[0:16384]", "head.weight[16384:32768]", "tok_emb.weight[0:16384]"},
                   run_dir=ranks if schedule == "GPipe" else None)
    assert main(["export", str(plans["1F1B"]), "--to", "megatron"]) == 2

    # The GPipe run's ranks replayed (their results and parameters, no new launch) against a reference that skips
    # its optimizer step: the parameters after steps 1 and 2 no longer match it.
    def replay(plan: Plan, options: RunOptions, run_dir: Path) -> None:
        for kept in [ranks / "results.json", *ranks.glob("check*.pt")]:
            shutil.copy(kept, run_dir / kept.name)

    def lazy(plan: Plan, mf: ModelFile, options: RunOptions) -> ReferenceModel:  # the reference skips its step
        return vocab_reference(plan, mf, replace(options, lr=0.0))
    monkeypatch.setattr(runner, "run_vocab_ranks", replay)
    monkeypatch.setattr(runner, "vocab_reference", lazy)
    report = runner.run_plan(load_plan(plans["GPipe"]), RunOptions(steps=3, timeout_s=600, check=False))
    assert not report.passed and report.failed_steps == (1, 2, 3) and report.error is not None  # the last step too
    assert "after the optimizer step differ from one process's sgd step" in report.error


@pytest.mark.integration
def test_pinned_on_four_ranks_and_run_validated(tmp_path: Path) -> None:
    """Vocab-2 pinned on 4 ranks under 1F1B with 4 microbatches (the planner alone takes GPipe with one): every
    rank's embedding and head shards validated, the adam step too (tests/run/test_vocab.py runs 2 ranks alone)."""
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    assert main(["profile", str(ROOT / "tests" / "models" / "vocabgpt.py"), "--microbatch-sizes", "1", "--repeats",
                 "1", "--warmup", "0", "-o", str(prof)]) == 0
    assert main(["plan", "--profile", str(prof), "--devices", "4", "--memory", "4GiB", "--pp", "4", "--global-batch",
                 "4", "--vocab", "2", "--schedule", "1F1B", "--microbatches", "4", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert (data["vocab"], data["schedule"], data["num_microbatches"]) == ("vocab-2", "1F1B", 4)
    _validated(plan, {f"{w}.weight[{64 * r}:{64 * (r + 1)}]" for w in ("head", "tok_emb") for r in range(4)},
               optimizer="adam")



@pytest.mark.integration
def test_tied_model_on_one_microbatch_keeps_a_body_stage_and_runs(tmp_path: Path) -> None:
    """Regression: `autopp plan tests/models/tiedlm.py --pp 2 --vocab 2 --global-batch 4` gave stage 0 the tied
    embedding alone (GPipe, one microbatch: every split of the body ties, and the empty one was taken), and
    `autopp run` of it failed on both ranks: "splitting at 1 points gave 1 pieces, expected 2". Every stage now
    holds a block, and the run is validated, the tied shard (one tensor for the embedding and the head) included."""
    prof, plan = tmp_path / "prof", tmp_path / "p.json"
    assert main(["profile", str(ROOT / "tests" / "models" / "tiedlm.py"), "--microbatch-sizes", "4", "--repeats", "1",
                 "--warmup", "0", "-o", str(prof)]) == 0
    assert main(["plan", "--profile", str(prof), "--devices", "2", "--memory", "4GiB", "--pp", "2", "--global-batch",
                 "4", "--microbatches", "1", "--schedule", "GPipe", "--vocab", "2", "-o", str(plan)]) == 0
    data = json.loads(plan.read_text())
    assert data["vocab"] == "vocab-2" and data["num_microbatches"] == 1
    assert all(any(n.startswith("blocks.") for n in s["unit_names"]) for s in data["stages"])
    _validated(plan, {"embed.weight[0:8]", "embed.weight[8:16]"})

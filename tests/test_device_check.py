"""scripts/device_check.sh (issue 29, item 5): its CPU path end to end, its fail-fast line, and the summary of
scripts/device_check.py on a prepared folder. No GPU has run the CUDA path (docs/accuracy.md, "Device check")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .conftest import ROOT, load_script

SCRIPT = ROOT / "scripts" / "device_check.sh"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHON": sys.executable})


def _helper() -> ModuleType:
    return load_script("device_check")


@pytest.mark.integration
def test_cpu_path_runs_every_step_and_keeps_the_results(tmp_path: Path) -> None:
    out = tmp_path / "check"
    done = _check("--cpu", "-o", str(out), "--budget", "900")
    assert done.returncode == 0, done.stdout + done.stderr
    steps = dict(line.split("\t")[:2] for line in (out / "steps.tsv").read_text().splitlines())
    assert steps == {"probe": "ok", "profile-gpt": "ok", "profile-gpt-bf16": "skipped", "profile-tiny-llama": "ok",
                     "calibrate-gpt": "ok", "calibrate-tiny-llama": "ok", "plan-gpt-1gpu": "ok",
                     "run-gpt-1gpu": "ok", "memory-llama": "skipped", "nccl": "skipped"}
    env = json.loads((out / "env.json").read_text())
    assert env["kind"] == "cpu" and env["catalog"] == "cpu" and env["gpus"] == 0
    ops = json.loads((out / "ops.json").read_text())
    assert [r["op"] for r in ops["rows"]] == ["matmul", "attention fwd (causal)", "copy", "gelu"]
    assert all(r["rate"] > 0 and 0 < r["fraction"] for r in ops["rows"]) and "fp8" in ops["skipped"][0]
    for name in ("gpt", "tiny-llama"):
        assert (out / "profiles" / name / "meta.json").is_file()
        assert json.loads((out / "calibration" / f"{name}.json").read_text())["device"] == "cpu"
    report = json.loads((out / "reports" / "gpt-1gpu.report.json").read_text())
    assert report["passed"] and report["num_ranks"] == 1 and report["memory_method"] == "live"
    summary = (out / "summary.txt").read_text()
    assert "calibration:" in summary and "gpt-1gpu" in summary and "PASSED" in summary
    assert done.stdout.count(" ok (") == 7 and "done in " in done.stdout


@pytest.mark.integration
def test_a_failing_step_stops_the_check_with_one_line(tmp_path: Path) -> None:
    done = _check("--cpu", "-o", str(tmp_path / "check"), "--budget", "1")
    assert done.returncode == 1
    err = done.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("device_check: step probe failed (exit 124 after ")
    assert "ran out of the budget's 1 s" in err[0] and "logs/probe.log" in err[0]
    assert "profile-gpt" not in done.stdout
    wrong = _check("--gpu")
    assert wrong.returncode == 2 and wrong.stderr.startswith("device_check: unknown argument --gpu")


def test_summary_lists_steps_calibrations_and_memory_per_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    (tmp_path / "calibration").mkdir()
    (tmp_path / "reports").mkdir()
    (tmp_path / "env.json").write_text(json.dumps({"device": "cuda (NVIDIA H200)", "catalog": "h200", "gpus": 1,
                                                   "torch": "2.13.0"}))
    (tmp_path / "steps.tsv").write_text("probe\tok\t3\nnccl\tskipped\t0\n")
    (tmp_path / "calibration" / "llama-1b-bf16.json").write_text(json.dumps(
        {"dtype": "bfloat16", "compute_efficiency": 0.61, "memory_efficiency": 0.8, "op_overhead_s": 5e-6,
         "call_overhead_s": 0.0, "median_error": 0.12, "worst_error": 0.3}))
    (tmp_path / "reports" / "gpt-1gpu.report.json").write_text(json.dumps(
        {"backend": "nccl", "num_ranks": 1, "measured_step_time_s": 0.02, "predicted_step_time_s": 0.025,
         "step_time_ratio": 0.8, "passed": True, "memory_method": "cuda.max_memory_allocated",
         "ranks": [{"peak_memory_bytes": 300 * 2**20, "predicted_peak_memory_bytes": 280 * 2**20}]}))
    _helper().summary(tmp_path)
    text = capsys.readouterr().out
    assert text.startswith("device check of cuda (NVIDIA H200) (catalog h200, 1 GPUs, torch 2.13.0)")
    assert "ok         3.0 s  probe" in text and "skipped    0.0 s  nccl" in text
    assert "llama-1b-bf16          bfloat16   0.610  0.800        5         0      12.0%   30.0%" in text
    assert "300/280 MiB (cuda.max_memory_allocated)" in text and "0.80" in text and "PASSED" in text


def test_fp8_is_skipped_with_a_reason_off_the_gpu() -> None:
    import torch
    why = _helper()._fp8_matmul(torch.device("cpu"), 16, 1, None)
    assert why == "fp8 matmul: needs a CUDA device of compute capability >= 8.9 (H100/H200, L40S)"

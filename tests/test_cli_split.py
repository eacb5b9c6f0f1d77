"""`autopp plan --split`: the shipped gpt profile planned on a hand-written split, shown, and (integration) run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.solve.assemble.pinned import SPLIT_NOTE

from .conftest import EXAMPLES, ONE_PIPELINE, SHIPPED


def _plan_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict[str, object], str]:
    """profiles/gpt on 2 ranks with stages beginning at units 0 and 2 (autopp's own split is elsewhere)."""
    plan = tmp_path / "split.json"
    assert main(["plan", "--profile", str(SHIPPED / "gpt"), "--devices", "2", "--memory", "1GiB", "--global-batch",
                 "8", *ONE_PIPELINE, "--split", "2", "--recompute-stages", "1", "-o", str(plan)]) == 0
    return plan, json.loads(plan.read_text()), capsys.readouterr().out


def test_plan_split_writes_the_pinned_split_beside_autopps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, data, out = _plan_split(tmp_path, capsys)
    assert [s["units"] for s in data["stages"]] == [[0, 2], [2, 8]]
    assert [s["activation"] for s in data["stages"]] == ["keep", "recompute"]
    own = data["baselines"]["autopp"]["stage_units"]
    assert own != [[0, 2], [2, 8]] and data["predicted"]["fits"] is True
    assert SPLIT_NOTE in data["notes"] and "note: split pinned (--split): evaluated, not searched" in out
    rows = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "pinned" in rows and "autopp" in rows and "fits" in out
    assert main(["show", str(plan), "-o", str(tmp_path / "split.png")]) == 0
    assert "wrote timeline" in capsys.readouterr().out and (tmp_path / "split.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["--split", "2,1"], "--split 2,1: unit indices must increase"),
    (["--split", "9"], "--split 9: stages begin at unit indices 1..7"),
    (["--split", "2,4"], "--split 2,4 gives 3 stages, but this request's configurations have 2"),
    (["--split", "2", "--recompute-stages", "1", "--recompute", "all"], "drop --recompute all"),
])
def test_a_bad_split_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                            message: str) -> None:
    out = tmp_path / "p.json"
    assert main(["plan", "--profile", str(SHIPPED / "gpt"), "--devices", "2", "--memory", "1GiB", *ONE_PIPELINE,
                 *args, "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopp: error: ") and message in err[0], err
    assert not out.exists()


@pytest.mark.integration
def test_a_pinned_split_runs_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan, _, _ = _plan_split(tmp_path, capsys)
    report = tmp_path / "r.json"
    assert main(["run", str(plan), "--steps", "1", "--report", str(report)]) == 0
    assert json.loads(report.read_text())["passed"] is True
    assert "PASSED" in capsys.readouterr().out


def test_a_decreasing_split_is_refused_before_profiling(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # profiles/gpt would be written here
    assert main(["plan", str(EXAMPLES / "gpt.py"), "--devices", "2", "--memory", "1GiB", "--split", "4,2"]) == 2
    assert "--split 4,2: unit indices must increase" in capsys.readouterr().err
    assert not (tmp_path / "profiles").exists()

"""Regression (issue 30): tiny HF mixture-of-experts model files planned and ran validated on 2 CPU ranks before the
meta-device work; after it, every model was checked and its units found on fake tensors, and both failed:

    $ autopp plan tests/models/hf_mixtral.py --devices 2 --memory 4GiB
    E... torch/_subclasses/fake_tensor.py:3090] failed while attempting to run meta for aten._grouped_mm.default
    ... (22 lines of traceback)
    autopp: error: .../tests/models/hf_mixtral.py: forward() on sample_batch(2) raised RuntimeError: Expected inputs
    of BF16 type but got mat_a.dtype=torch.float32 and mat_b.dtype=torch.float32. (at __init__.py:1750)

(torch 2.13's meta kernel of `aten._grouped_mm` takes bfloat16 only; autopp.model.fake.grouped_mm_on_fake). Each model
is planned through the CLI on 2 devices and its plan run on 2 gloo ranks, loss and every gradient validated against
one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopp.cli import main

from .conftest import MODELS, ONE_PIPELINE

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _needs_transformers() -> None:
    pytest.importorskip("transformers")


@pytest.mark.parametrize("model", ["hf_mixtral.py", "hf_qwen2_moe.py"])
def test_moe_model_file_plans_and_runs_validated_on_two_ranks(model: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the default profile directory is ./profiles/MODEL
    plan, report = tmp_path / "plan.json", tmp_path / "report.json"
    assert main(["plan", str(MODELS / model), "--devices", "2", "--memory", "4GiB", "--global-batch", "4",
                 *ONE_PIPELINE, "-o", str(plan)]) == 0
    err = capsys.readouterr().err
    assert "BF16" not in err and "Traceback" not in err
    assert len(json.loads(plan.read_text())["stages"]) == 2
    assert main(["run", str(plan), "--steps", "1", "--report", str(report)]) == 0
    result = json.loads(report.read_text())
    assert result["passed"] is True and result["grad_max_rel_diff"] is not None

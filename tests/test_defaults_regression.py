"""Issue 26, item 1: the newcomer's job took five flags. `autopp plan --profile P --device h100-sxm --nodes 2` for
Llama-3-8B failed with "1F1B needs microbatches >= stages (8 < 16): use a global batch of at least 16 (it is 8),
fewer devices, or another --schedule", and `--nodes 8` with "cannot split 34 units into 64 stages ... or --dp
auto": the defaults were 1F1B, dp 1, tp 1, ZeRO 0, no recomputation and a global batch of 8. Every free choice is
searched now, and a sequence model's global batch defaults to about 2^20 tokens, said in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from autopp.cli import main
from autopp.data.synthetic_profile import synthetic_profile

from .conftest import ONE_PIPELINE


def _llama_like(path: Path) -> Path:
    """34 units as Llama-3-8B's (embedding, 32 blocks, norm and head), built from an HF config of sequence 512."""
    profile = synthetic_profile(34, hidden=4096, seq=512)
    hf = {"seq_len": 512, "task": "causal-lm", "model_type": "llama"}
    return replace(profile, meta=replace(profile.meta, extra={**profile.meta.extra, "hf_config": hf})).save(path)


@pytest.mark.integration  # two full searches with CP-SAT synthesis (~10-30 s)
@pytest.mark.parametrize("nodes, old_failure", [
    ("2", "1F1B needs microbatches >= stages (8 < 16): use a global batch of at least 16 (it is 8)"),
    ("8", "cannot split 34 units into 64 stages"),
])
def test_the_newcomers_command_needs_no_other_flag(nodes: str, old_failure: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prof, out = _llama_like(tmp_path / "prof"), tmp_path / "p.json"
    command = ["plan", "--profile", str(prof), "--device", "h100-sxm", "--nodes", nodes, "-o", str(out)]
    assert main([*command, "--global-batch", "8", *ONE_PIPELINE]) == 2  # the old defaults, pinned: still refused
    assert old_failure in capsys.readouterr().err
    assert main(command) == 0
    err = capsys.readouterr().err
    assert "autopp: note: global batch 2048 sequences of 512 tokens per step (the default for a sequence model: " \
           "2^20 tokens / seq_len, rounded to a power of two); give --global-batch N" in err
    plan = json.loads(out.read_text())
    assert plan["pp"] * plan["dp"] * plan.get("tp", 1) == plan["num_ranks"] == 8 * int(nodes)
    assert plan["num_microbatches"] * plan["microbatch_size"] * plan["dp"] == 2048 and plan["predicted"]["fits"]

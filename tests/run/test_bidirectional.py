"""Chimera on CPU ranks: two pipelines over the same ranks, run by autopp's runtime on torch's stages and validated
against one process (the loss and every gradient, the two replicas' gradients summed before the comparison and
before the optimizer step, over two steps: the second starts from the first step's update)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.data.layout import Layout
from autopp.errors import RunError
from autopp.run import GRAD_RTOL, RunOptions, measured_timeline, run_plan

from .conftest import GPT, LINRELU, pipeline_plan


@pytest.mark.parametrize(("pp", "model", "splits", "m"), [(2, GPT, ["h.2"], 4), (4, LINRELU, ["1", "2", "3"], 8)],
                         ids=["gpt-2", "linrelu-4"])
@pytest.mark.integration
def test_chimera_matches_one_process_on_2_and_4_ranks(pp: int, model: Path, splits: list[str], m: int) -> None:
    """On 2 ranks examples/gpt.py, a chained model whose values are relayed (its embedding and head among the
    compared gradients); on 4 ranks a plain MLP."""
    plan = pipeline_plan(model, splits, "Chimera", Layout(pp=pp), num_microbatches=m)
    report = run_plan(plan, RunOptions(steps=2, timeout_s=180))
    assert report.passed and report.complete and report.error is None
    assert report.losses == pytest.approx(report.reference_losses, rel=1e-5) and len(report.losses) == 2
    assert report.grad_max_rel_diff is not None and report.grad_max_rel_diff <= GRAD_RTOL
    if model == GPT:
        assert {"tok_emb.weight", "head.weight"} <= {d.name for d in report.grad_diffs}
    # rank r holds stage r (down) and stage p - 1 - r (up)
    assert [m.stages for m in report.ranks] == [tuple(sorted({r, pp - 1 - r})) for r in range(pp)]
    timeline = measured_timeline(report)
    runs = {(e.rank, e.action.stage, e.action.microbatch >= m // 2) for e in timeline.events}
    assert runs == {(s if not up else pp - 1 - s, s, up) for s in range(pp) for up in (False, True)}
    assert len(timeline.events) == 2 * pp * m
    assert timeline.mirror == m // 2  # its picture says which lanes run down and which up (tests/schedule/test_draw)


def test_chimera_with_data_parallelism_is_refused_before_any_rank_starts() -> None:
    from autopp.run.pipeline import build_stages
    from autopp.model import load_model_file
    import torch
    plan = pipeline_plan(LINRELU, ["2"], "Chimera", Layout(pp=2, dp=2), num_microbatches=2)
    with pytest.raises(RunError, match=r"the runner runs Chimera without data, tensor or ZeRO parallelism"):
        build_stages(load_model_file(LINRELU), plan, 0, torch.device("cpu"), None)

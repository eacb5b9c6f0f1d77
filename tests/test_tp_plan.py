"""autopp.data.tp_plan: whether a profile's tensor-parallel rows are those a plan needs."""

from __future__ import annotations

from autopp.data.tp_plan import LOSS_PARALLEL, tp_outdated

GATHERED = {"model.layers.*.mlp.up_proj": "colwise", "lm_head": "colwise_gather_output"}
SHARDED = {**GATHERED, "lm_head": LOSS_PARALLEL}


def test_tp_rows_outdated_for_a_missing_degree_or_another_plan() -> None:
    """A degree the plan needs missing; rows counted with another TP plan than the model's now (an HF config's head
    gathered, before loss parallelism), when the plan may use them (a degree needed, or any: None)."""
    assert tp_outdated(SHARDED, (2,), (2, 4), SHARDED) == "it has no tensor-parallel rows of degree 4"
    why = ("its tensor-parallel rows were counted with another TP plan (at 'lm_head': colwise_gather_output then, "
           "colwise_loss_parallel now)")
    assert tp_outdated(GATHERED, (2,), (2,), SHARDED) == why
    assert tp_outdated(GATHERED, (2, 4), None, SHARDED) == why


def test_tp_rows_current_when_the_plan_is_the_same_or_no_rows_are_used() -> None:
    """The same plan (a model file's gathered head stays gathered), a plan pinned to tp 1 (`needs` ()), a profile
    without rows, or a model without a plan now: current."""
    assert tp_outdated(GATHERED, (2,), (2,), GATHERED) is None
    assert tp_outdated(SHARDED, (2, 4), (2,), SHARDED) is None
    assert tp_outdated(GATHERED, (2,), (), SHARDED) is None
    assert tp_outdated({}, (), None, SHARDED) is None
    assert tp_outdated(GATHERED, (2,), (2,), None) is None

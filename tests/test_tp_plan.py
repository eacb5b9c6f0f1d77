"""autopp.data.tp_plan: whether a profile's tensor-parallel rows are those a plan needs."""

from __future__ import annotations

from autopp.data.tp_plan import LOSS_PARALLEL, tp_outdated


def test_tp_rows_outdated_for_a_missing_degree_or_an_hf_configs_gathered_head() -> None:
    """A plan's degree missing; an HF config's rows counting its head's logits gathered (before loss parallelism);
    a model file's gathered head (its own loss reads whole logits) and rows with the head sharded are current."""
    gathered, sharded = {"lm_head": "colwise_gather_output"}, {"lm_head": LOSS_PARALLEL}
    assert tp_outdated(sharded, (2,), (2, 4), True) == "it has no tensor-parallel rows of degree 4"
    assert tp_outdated(gathered, (2,), (2,), True) == ("its tensor-parallel rows gather the head's logits on every "
                                                       "rank, counted before loss parallelism")
    assert tp_outdated(gathered, (2,), (2,), False) is None
    assert tp_outdated(sharded, (2, 4), (2,), True) is None
    assert tp_outdated(gathered, (), None, True) is None  # no rows: nothing counted either way

"""Unit tests of the worker's pure helpers: rank layout, world-size check, replica slices."""

from __future__ import annotations

import pytest
import torch

from autopp.errors import RunError
from autopp.run.worker import check_world_size, ranks_of, replica_slice

from .conftest import LINRELU, pipeline_plan


def test_global_rank_is_replica_times_pp_plus_pipeline_rank() -> None:
    r = ranks_of(5, pp=2, dp=3)
    assert (r.replica, r.pp_rank) == (2, 1)
    assert r.pipeline == (4, 5) and r.data_parallel == (1, 3, 5)
    assert ranks_of(0, pp=4, dp=1).pipeline == (0, 1, 2, 3)


def test_world_size_must_match_the_plan() -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", pp=2, dp=2)
    check_world_size(plan, 4)
    with pytest.raises(RunError, match=r"^plan needs 4 ranks \(pp 2 x dp 2\) but WORLD_SIZE is 3$"):
        check_world_size(plan, 3)


def test_replica_gets_its_contiguous_slice() -> None:
    batch = torch.arange(8)
    assert replica_slice(batch, 1, 2).tolist() == [4, 5, 6, 7]
    assert replica_slice(batch, 0, 4).tolist() == [0, 1]
    assert replica_slice(batch, 0, 1) is batch

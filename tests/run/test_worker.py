"""Unit tests of the worker's pure helpers: rank layout, world-size check, replica slices, the error line; and
(integration) what a rank imports."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopp.data.layout import Layout
from autopp.data.zero import ZERO
from autopp.errors import RunError
from autopp.run.worker import check_world_size, describe_error, ranks_of, replica_slice

from .conftest import LINRELU, pipeline_plan


def test_global_rank_is_pipeline_rank_times_dp_plus_replica() -> None:
    r = ranks_of(5, Layout(pp=2, dp=3))  # the planner's layout (Cluster.placed): a stage's replicas are neighbours
    assert (r.replica, r.pp_rank) == (2, 1)
    assert r.pipeline == (2, 5) and r.data_parallel == (3, 4, 5)
    assert ranks_of(0, Layout(pp=4)).pipeline == (0, 1, 2, 3)


def test_tensor_parallel_rank_is_innermost() -> None:
    # (pp_rank * dp + replica) * tp + tp_rank, torchtitan's ("pp", "dp", "tp") mesh
    r = ranks_of(5, Layout(pp=2, dp=2, tp=2))
    assert (r.pp_rank, r.replica, r.tp_rank) == (1, 0, 1)
    assert r.pipeline == (1, 5) and r.data_parallel == (5, 7)


def test_world_size_must_match_the_plan() -> None:
    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2))
    check_world_size(plan, 4)
    with pytest.raises(RunError, match=r"^plan needs 4 ranks \(pp\(2\) x dp\(2\)\) but WORLD_SIZE is 3$"):
        check_world_size(plan, 3)


def test_replica_gets_its_contiguous_slice() -> None:
    batch = torch.arange(8)
    assert replica_slice(batch, 1, 2).tolist() == [4, 5, 6, 7]
    assert replica_slice(batch, 0, 4).tolist() == [0, 1]
    assert replica_slice(batch, 0, 1) is batch


USER_CODE = '''
def forward(step):
    if step > 1:
        raise RuntimeError("injected fault on rank 1 after step 1")
'''


def _wrapped_user_error(path: Path) -> BaseException:
    """A user's error as torch's stage raises it: `RuntimeError("[Stage 1] failed to run forward: ...") from e`."""
    namespace: dict[str, object] = {}
    exec(compile(USER_CODE, str(path), "exec"), namespace)  # noqa: S102 - the test's own code, named as a model file
    try:
        try:
            namespace["forward"](2)  # type: ignore[operator]
        except Exception as e:
            try:
                {}["cleanup"]  # an error while handling: its context is the user's error, not its cause
            except KeyError:
                raise RuntimeError("[Stage 1] failed to run forward:\nargs: ...") from e
    except RuntimeError as exc:
        return exc
    raise AssertionError("not raised")


# Issue 13, point 4: the user saw only
# `rank 1 failed: RuntimeError: [Stage 1] failed to run forward: (at stage.py:900)`.
def test_error_line_carries_the_users_own_exception_and_place(tmp_path: Path) -> None:
    model = tmp_path / "faulty.py"
    exc = _wrapped_user_error(model)
    assert describe_error(exc, [str(model)]) == ("RuntimeError: injected fault on rank 1 after step 1 "
                                                 "(at faulty.py:4 in forward)")
    # Without knowing the model file: still the innermost exception of the chain.
    assert describe_error(exc).startswith("RuntimeError: injected fault on rank 1 after step 1 (at faulty.py:4")


def test_error_line_of_a_non_user_error_names_its_innermost_frame() -> None:
    try:
        int("x")
    except ValueError as exc:
        line = describe_error(exc, ["/nowhere/model.py"])
    assert line.startswith("ValueError: invalid literal for int() with base 10: 'x' (at test_worker.py:")


def test_tied_weights_are_refused_with_tensor_or_context_parallelism_or_zero() -> None:
    from autopp.run.pipeline import RankStages
    from autopp.run.worker import _check_untied

    plan = pipeline_plan(LINRELU, ["2"], "1F1B", Layout(pp=2, dp=2, zero=ZERO[1]))
    _check_untied(plan, RankStages([], None, {"0.weight": [torch.nn.Parameter(torch.zeros(1))]}, {}))
    with pytest.raises(RunError, match=r"^the model ties 'wte.weight' between stages, .* \(plan has tp 1, cp 1, zero "
                                       r"1\): run it with tp 1, cp 1 and zero 0$"):
        _check_untied(plan, RankStages([], None, {}, {"wte.weight": (0, 1)}))


def test_replicas_average_the_local_shards_of_tensor_parallel_gradients(one_rank_group: None) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from autopp.run.worker import _average_grads

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    p = torch.nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.full((4,), 2.0), mesh, [Shard(0)])
    _average_grads([p], dist.group.WORLD, ranks=2)  # one rank standing for two replicas: the sum is itself, halved
    assert p.grad.to_local().tolist() == [1.0] * 4


@pytest.mark.integration
def test_a_rank_imports_neither_pandas_nor_networkx() -> None:
    """Every rank of every run imports the worker: pandas and networkx (the profile tables, ~0.45 s of CPU per
    process, 12% of the worker's imports) stay out of it (autopp.display names Profile for typing only)."""
    code = "import sys, autopp.run.worker; print(sorted({'pandas', 'networkx'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"

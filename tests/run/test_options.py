"""RunOptions: checked once, with the numbers in the message; the worker flags they set, spelt in one place."""

from __future__ import annotations

import pytest

from autopp.errors import RunError
from autopp.run.options import Nodes, RunOptions


@pytest.mark.parametrize("given, message", [
    (dict(steps=0), r"steps must be at least 1, got 0"),
    (dict(lr=-0.1), r"the learning rate must be a finite number >= 0, got -0.1"),
    (dict(lr=float("nan")), r"the learning rate must be a finite number >= 0, got nan"),
    (dict(timeout_s=0.0), r"the timeout must be more than 0 seconds, got 0.0"),
    (dict(backend="mpi"), r"backend must be 'gloo' or 'nccl' \(or None: chosen\), got 'mpi'"),
])
def test_bad_run_options_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(RunError, match=message):
        RunOptions(**given)  # type: ignore[arg-type]


def test_worker_flags_and_launcher() -> None:
    options = RunOptions(steps=5, lr=0.5, timeout_s=30.0, backend="nccl", optimizer="adam")
    assert options.worker_args() == ["--steps", "5", "--lr", "0.5", "--optimizer", "adam", "--backend", "nccl",
                                     "--timeout-s", "30.0"]
    assert options.launcher == "local" and RunOptions(nodes=Nodes(nnodes=2)).launcher == "torchrun"
    unset = RunOptions(validate=False).worker_args()
    assert unset[5] == "sgd" and unset[7] == "gloo" and unset[-1] == "--no-validate"  # autopp.run.resolve sets them

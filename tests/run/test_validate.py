"""Unit tests of validation: tensor differences, parameter coverage, the single-process reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autopp.errors import RunError
from autopp.modelfile import load_model_file
from autopp.run.validate import check_coverage, compare_grads, compare_losses, reference_run, tensor_diff


def test_tensor_diff() -> None:
    ref = torch.tensor([2.0, -4.0])
    assert tensor_diff(ref + torch.tensor([0.0, 0.4]), ref) == pytest.approx((0.4, 0.1))
    assert tensor_diff(torch.zeros(3), torch.zeros(3)) == (0.0, 0.0)
    assert tensor_diff(torch.ones(3), torch.zeros(3)) == (1.0, math.inf)
    with pytest.raises(RunError, match=r"pipelined \(2,\) vs reference \(3,\)"):
        tensor_diff(torch.zeros(2), torch.zeros(3))


def test_coverage_accepts_a_partition_and_tied_copies() -> None:
    assert check_coverage(["a", "b", "c"], {0: ["a"], 1: ["b", "c"]}) == {}
    assert check_coverage(["a", "b", "c"], {0: ["a", "b"], 1: ["b", "c"]}) == {"b": [0, 1]}


@pytest.mark.parametrize("stages, message", [
    ({0: ["a"], 1: ["b"]}, r"1 parameters are on no stage, e.g. 'c'"),
    ({0: ["a", "b"], 1: ["c", "d"]}, r"stages hold 1 parameters the model does not have, e.g. 'd'"),
])
def test_coverage_refuses(stages: dict[int, list[str]], message: str) -> None:
    with pytest.raises(RunError, match=message):
        check_coverage(["a", "b", "c"], stages)


def test_compare_grads_names_stage_and_keeps_reference_order() -> None:
    ref = {"b": torch.ones(2), "a": torch.full((2,), 2.0)}
    diffs = compare_grads(ref, {0: {"a": torch.full((2,), 2.0)}, 1: {"b": torch.tensor([1.0, 1.5])}})
    assert [(d.name, d.stage) for d in diffs] == [("b", 1), ("a", 0)]
    assert diffs[0].max_rel == pytest.approx(0.5) and diffs[1].max_abs == 0.0


def test_each_copy_of_a_tied_weight_is_compared_with_the_tensors_gradient() -> None:
    ref = {"emb": torch.ones(2)}
    diffs = compare_grads(ref, {0: {"emb": torch.ones(2)}, 1: {"emb": torch.tensor([1.0, 0.2])}})
    assert [(d.name, d.stage) for d in diffs] == [("emb", 0), ("emb", 1)]
    assert diffs[0].max_rel == 0.0 and diffs[1].max_rel == pytest.approx(0.8)


def test_compare_losses() -> None:
    assert compare_losses([1.0, 2.2], [1.0, 2.0]) == pytest.approx((0.2, 0.1))
    with pytest.raises(RunError, match="reported 1 losses, reference 2"):
        compare_losses([1.0], [1.0, 2.0])


def test_reference_run_is_reproducible_and_learns(tmp_path: Path) -> None:
    path = tmp_path / "tiny.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "def build_model():\n    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))\n"
                    "def sample_batch(n):\n    return torch.randn(n, 4), torch.zeros(n, 2)\n")
    mf = load_model_file(path)
    one = reference_run(mf, seed=3, global_batch=8, steps=3, lr=0.1)
    two = reference_run(mf, seed=3, global_batch=8, steps=3, lr=0.1)
    assert one.losses == two.losses and one.losses[2] < one.losses[0]
    assert list(one.grads) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert one.aliases == {n: n for n in one.grads}
    assert all(torch.equal(one.grads[k], two.grads[k]) for k in one.grads)

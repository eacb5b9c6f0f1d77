"""Unit tests of validation: tensor differences, parameter coverage, tolerances and verdicts (the reference:
test_steps.py)."""

from __future__ import annotations

import math

import pytest
import torch

from autopp.errors import RunError
from autopp.run.validate import (GRAD_RTOL, Reference, check_coverage, compare_grads, compare_losses, failure,
                                 grad_atol, non_finite, stage_atols, tensor_diff)


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


def _ref(grads: dict[str, torch.Tensor], losses: tuple[float, ...] = (2.0,), dtype: str = "float32") -> Reference:
    return Reference(losses=losses, grads=grads, dtype=dtype)


# Issue 13, point 2: HF BERT on 2 ranks ended "FAILED: gradient of ...attention.self.key.bias differs ... by 5.82e-02
# relative (max abs 7.39e-13)"; the key bias gradient is zero in exact arithmetic, both sides rounding noise.
def test_rounding_noise_of_a_zero_gradient_passes_against_the_floor() -> None:
    ref = {"value.weight": torch.full((4,), 0.19), "key.bias": torch.full((4,), 1.27e-11)}
    got = {"value.weight": ref["value.weight"].clone(), "key.bias": ref["key.bias"] + 7.39e-13}
    atol = grad_atol(ref, "float32")
    assert atol == pytest.approx(0.19 * torch.finfo(torch.float32).eps)
    assert compare_grads(ref, {0: got})[1].max_rel == pytest.approx(5.82e-2, rel=0.01)  # without the floor: fails
    floor = atol / GRAD_RTOL
    (_, key_bias) = compare_grads(ref, {0: got}, floor)
    assert key_bias.max_rel < 1e-4 and failure(compare_grads(ref, {0: got}, floor), [2.0], _ref(ref), {0: got}) is None


@pytest.mark.parametrize("scale", [0.2, 1.01, 1e-3])
def test_the_floor_still_catches_wrong_gradients_above_rounding(scale: float) -> None:
    # A tied copy not summed (GPT-2: 0.8 relative), a 1 % error, a gradient 1000x too small, on the largest
    # parameter and on a small one (1e-4 of the largest gradient): each above eps x the largest, so each still fails.
    ref = {"emb": torch.full((4,), 0.5), "small": torch.full((4,), 5e-5)}
    for name in ref:
        got = {**ref, name: ref[name] * scale}
        diffs = compare_grads(ref, {0: got}, grad_atol(ref, "float32") / GRAD_RTOL)
        error = failure(diffs, [2.0], _ref(ref), {0: got})
        assert error is not None and error.startswith(f"gradient of {name} (stage 0) differs") and "1e-04" in error
    assert GRAD_RTOL == 1e-4


def test_the_floor_is_the_stage_s_not_the_model_s() -> None:
    # Review of issue 13.2: with G the model's largest gradient, a bfloat16 stage whose gradients are all below
    # eps / rtol = 15.6 % of it was checked only at an absolute 7.8e-3 G. The head (stage 1) holds G = 1; stage 0's
    # largest is 0.1, and its 6 % error (6e-3 absolute, below 7.8e-3 G) is far above its own rounding.
    ref = {"w0": torch.full((4,), 0.1), "head": torch.full((4,), 1.0)}
    got = {0: {"w0": ref["w0"] * 1.06}, 1: {"head": ref["head"].clone()}}
    rtol = 5e-2  # bfloat16's
    model_wide = compare_grads(ref, got, grad_atol(ref, "bfloat16") / rtol)
    assert model_wide[0].max_rel < rtol  # the old floor let it pass
    atols = stage_atols(ref, got, "bfloat16")
    assert atols == pytest.approx({0: 0.1 * 2**-7, 1: 2**-7})
    floors = {s: a / rtol for s, a in atols.items()}
    diffs = compare_grads(ref, got, floors)
    error = failure(diffs, [2.0], _ref(ref, dtype="bfloat16"), got, floors)
    assert error is not None and error.startswith("gradient of w0 (stage 0) differs from the single-process "
                                                  "reference by 6.00e-02 relative (max abs")
    assert "vs floor" not in error  # its own scale decided


def test_a_failure_the_floor_decided_says_so() -> None:
    ref = {"big": torch.full((4,), 1.0), "tiny": torch.full((4,), 1e-9)}
    got = {0: {"big": ref["big"].clone(), "tiny": ref["tiny"] + 1e-6}}
    floors = {s: a / GRAD_RTOL for s, a in stage_atols(ref, got, "float32").items()}
    error = failure(compare_grads(ref, got, floors), [2.0], _ref(ref), got, floors)
    assert error is not None and error.startswith("gradient of tiny (stage 0) differs from the single-process "
                                                  "reference by 8.39e-04 relative vs floor (the stage's atol 1.19e-07 "
                                                  "is above rtol x the parameter's max |gradient| = 1.00e-13) (max "
                                                  "abs 1.00e-06), above the tolerance 1e-04")


def test_floor_ignores_non_finite_elements_and_scales_with_the_dtype() -> None:
    grads = {"a": torch.tensor([1.0, float("nan")]), "b": torch.tensor([-4.0])}
    assert grad_atol(grads, "float32") == pytest.approx(4 * 2**-23)
    assert grad_atol(grads, "bfloat16") == pytest.approx(4 * 2**-7)
    assert grad_atol({}, "float32") == 0.0


# Issue 13, point 1: a model whose batches are all NaN was reported PASSED (every comparison with NaN is false).
def test_nan_everywhere_fails_and_names_both_sides() -> None:
    nan = float("nan")
    ref = _ref({"w": torch.full((3,), nan)}, losses=(nan, nan))
    got = {1: {"w": torch.full((3,), nan)}}
    diffs = compare_grads(ref.grads, got, grad_atol(ref.grads, "float32") / GRAD_RTOL)
    error = failure(diffs, [nan, nan], ref, got)
    assert error == ("non-finite values on both sides: the single-process reference's loss nan at step 1, the "
                     "pipelined run's loss nan at step 1; the model produces them without pipelining (check "
                     "sample_batch, loss_fn and the weights of the model file)")


def test_non_finite_names_the_side_and_the_parameter() -> None:
    ref = _ref({"a": torch.ones(2), "b": torch.ones(4)}, losses=(1.0, 0.5))
    fine = {0: {"a": torch.ones(2)}, 1: {"b": torch.ones(4)}}
    assert non_finite([1.0, 0.5], fine, ref) is None
    bad = {0: {"a": torch.ones(2)}, 1: {"b": torch.tensor([1.0, float("inf"), float("nan"), 1.0])}}
    assert non_finite([1.0, 0.5], bad, ref) == ("the pipelined run has a non-finite gradient of b (stage 1) "
                                                "(2 of 4 elements nan/inf) where the single-process reference is "
                                                "finite")
    assert non_finite([1.0, float("inf")], fine, ref) == ("the pipelined run has a non-finite loss inf at step 2 "
                                                          "where the single-process reference is finite")
    ref_bad = _ref({"a": torch.ones(2), "b": torch.full((4,), float("nan"))}, losses=(1.0, 0.5))
    assert non_finite([1.0, 0.5], fine, ref_bad) == ("the single-process reference has a non-finite gradient of b "
                                                     "(4 of 4 elements nan) where the pipelined run is finite")

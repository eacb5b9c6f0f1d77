"""ProfileOptions and MeasureOptions: normalized and checked once, with the numbers in the message."""

from __future__ import annotations

import pytest
import torch

from autopp.measure.options import MeasureOptions, ProfileOptions


def test_sizes_and_degrees_are_sorted_and_deduplicated() -> None:
    options = ProfileOptions(microbatch_sizes=[4, 1, 4], tp_degrees=[4, 2, 2])  # type: ignore[arg-type]
    assert options.microbatch_sizes == (1, 4) and options.tp_degrees == (2, 4)
    assert ProfileOptions(tp_degrees=None).tp_degrees is None
    assert ProfileOptions(dtype="bfloat16").torch_dtype is torch.bfloat16


@pytest.mark.parametrize("given, message", [
    (dict(microbatch_sizes=(0, 2)), r"microbatch sizes must be positive integers, got \[0, 2\]"),
    (dict(microbatch_sizes=()), r"microbatch sizes must be positive integers, got \[\]"),
    (dict(optimizer="lamb"), r"optimizer must be one of \['adam', 'adamw', 'momentum', 'sgd'\], got 'lamb'"),
    (dict(dtype="float16"), r"dtype must be one of \['bfloat16', 'float32'\], got 'float16'"),
])
def test_bad_profile_options_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ProfileOptions(**given)  # type: ignore[arg-type]


@pytest.mark.parametrize("given, message", [
    (dict(repeats=0), r"warmup must be >= 0 \(2\), repeats >= 1 \(0\) and threads >= 1 \(1\)"),
    (dict(warmup=-1), r"warmup must be >= 0 \(-1\)"),
    (dict(time_budget_s=0.0), r"time_budget_s must be a positive number of seconds, got 0.0"),
    (dict(device="tpu"), r"device must be 'cpu' or 'cuda', got 'tpu'"),
    (dict(co_runners=-1), r"co_runners must be >= 0, got -1"),
    (dict(memory_limit_bytes=-5), r"memory_limit_bytes must be >= 0, got -5"),
])
def test_bad_measure_options_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MeasureOptions(**given)  # type: ignore[arg-type]


def test_a_profile_records_its_options() -> None:
    from autopp.data.synthetic_profile import synthetic_profile
    meta = synthetic_profile(4, tp_degrees=(2,)).meta
    options = ProfileOptions.recorded(meta)
    assert (options.microbatch_sizes, options.optimizer, options.dtype, options.tp_degrees) == (
        tuple(meta.microbatch_sizes), meta.optimizer, meta.dtype, tuple(meta.tp_degrees))


def test_options_are_frozen_and_keyword_only() -> None:
    with pytest.raises(TypeError):
        ProfileOptions((1, 2))  # type: ignore[misc]
    with pytest.raises(AttributeError):
        MeasureOptions().repeats = 3  # type: ignore[misc]


def test_the_recipe_is_the_dtypes_unless_given() -> None:
    """Every dtype has a recipe (fp32, bf16), filled in so that options compare equal; fp8 computes in bfloat16."""
    assert (ProfileOptions(dtype="float32").precision, ProfileOptions(dtype="bfloat16").precision) == ("fp32", "bf16")
    assert ProfileOptions(dtype="bfloat16") == ProfileOptions(dtype="bfloat16", precision="bf16")
    assert ProfileOptions(dtype="bfloat16", precision="fp8").recipe.matmul_peak == "float8"
    with pytest.raises(ValueError, match="precision fp8 computes in bfloat16, not float32"):
        ProfileOptions(precision="fp8")

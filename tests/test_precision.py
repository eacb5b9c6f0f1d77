"""The mixed-precision recipes (autopp.data.precision): bytes per parameter as the trainers keep them, the peaks each
recipe runs at on a catalog device, and how a plan's recipe is found."""

from __future__ import annotations

import pytest

from autopp.data.catalog import device_names, load_device
from autopp.data.precision import DEFAULT_RECIPE, RECIPES, plan_recipe, recipe, recipe_of_dtype
from autopp.errors import ProfileError

#: The devices whose vendors publish dense FP8 tensor-core figures (Hopper, Blackwell, Ada, CDNA 3).
FP8_DEVICES = {"h100-sxm", "h100-pcie", "h200", "h800", "b200", "mi300x", "l40s"}


def test_bytes_per_parameter_are_megatrons() -> None:
    """Megatron's distributed-optimizer guide: bf16 params with fp32 grads keep 18 bytes per parameter with Adam, of
    which 6 (weights + gradients) stay whole and 12 (master + two moments) are split; fp32 keeps 16 (8 + 8/d)."""
    bf16, fp32 = RECIPES["bf16"], RECIPES["fp32"]
    assert (bf16.bytes_per_param(2), fp32.bytes_per_param(2)) == (18, 16)
    assert (bf16.weight_bytes + bf16.grad_bytes, bf16.master_bytes + 2 * bf16.state_bytes) == (6, 12)
    assert (fp32.weight_bytes + fp32.grad_bytes, fp32.master_bytes + 2 * fp32.state_bytes) == (8, 8)
    fp8 = RECIPES["fp8"]  # FP8 keeps what bf16 keeps: only the matmuls change
    assert (fp8.dtype, fp8.bytes_per_param(2), fp8.step_bytes(2)) == ("bfloat16", 18, bf16.step_bytes(2))
    assert fp32.step_bytes(2) == 4 * 5 + 4 * 2 * 2  # the float32 step before recipes: 5 passes + 2 per state
    assert DEFAULT_RECIPE is bf16


def test_fp8_peaks_are_in_the_catalog_where_the_vendor_gives_them() -> None:
    with_fp8 = {n for n in device_names() if "float8" in load_device(n).peak_flops}
    assert with_fp8 == FP8_DEVICES
    base, linear = RECIPES["fp8"].peaks(load_device("h100-sxm"))
    assert (base, linear) == (load_device("h100-sxm").peak("bfloat16"), load_device("h100-sxm").peak("float8"))
    assert RECIPES["bf16"].peaks(load_device("h100-sxm")) == (base, base)


def test_fp8_on_a_device_without_it_is_one_line_naming_it() -> None:
    with pytest.raises(ProfileError, match=r"precision fp8 needs a float8 peak, which device a100-80gb does not "
                                           r"have .*give `precision` bf16$"):
        RECIPES["fp8"].peaks(load_device("a100-80gb"))


def test_a_plans_recipe_is_its_own_else_its_dtypes() -> None:
    assert plan_recipe("fp8", "bfloat16") is RECIPES["fp8"]
    assert plan_recipe(None, "bfloat16") is RECIPES["bf16"]
    assert plan_recipe(None, "float32") is RECIPES["fp32"]
    assert plan_recipe(None, None) is None and recipe_of_dtype("float16") is None
    with pytest.raises(ProfileError, match="precision 'fp16' does not exist; give one of fp32, bf16, fp8, bf16-pure"):
        recipe("fp16")


def test_only_deepspeed_refuses_fp8() -> None:
    fp8 = RECIPES["fp8"]
    assert fp8.refusal("deepspeed") is not None and "`precision` bf16" in str(fp8.refusal("deepspeed"))
    assert fp8.refusal("megatron") is None and fp8.refusal("torchtitan") is None
    assert all(r.refusal(t) is None for r in (RECIPES["bf16"], RECIPES["fp32"]) for t in ("deepspeed", "megatron"))


def test_the_fp8_recipe_dispatches_fp8_values_with_a_scale_per_128_and_the_others_as_they_compute() -> None:
    """DeepSeek-V3 s.3.3.4: under fp8 the expert-parallel dispatch sends e4m3 values and one fp32 scale per 128
    elements, 1.03 bytes per bf16 activation element of 2; the combine, and every other recipe, as computed."""
    assert RECIPES["fp8"].dispatch_bytes == 1 + 4 / 128
    assert RECIPES["fp8"].dispatch_scale() == pytest.approx(0.515625)
    assert RECIPES["bf16"].dispatch_scale() == RECIPES["fp32"].dispatch_scale() == 1.0


def test_pure_bf16_keeps_8_bytes_per_parameter_and_no_master() -> None:
    """NeMo AutoModel's recipe (the model cast to bf16 by `initialize_weights`, torch.optim.Adam's moments in the
    parameters' dtype, bf16 gradients): 2 + 2 + 0 + 2 x 2 = 8 bytes per parameter with Adam, against bf16's 18;
    the step reads and writes the bf16 weights (the master) and moments: 3 x 2 + 2 x 2 + 2 x 2 x 2 = 18 bytes."""
    pure = recipe("bf16-pure")
    assert (pure.weight_bytes, pure.grad_bytes, pure.master_bytes, pure.state_bytes) == (2, 2, 0, 2)
    assert (pure.bytes_per_param(2), pure.step_bytes(2), pure.bytes_per_param(0)) == (8, 18, 4)
    assert (pure.dtype, pure.peak, pure.matmul_peak) == ("bfloat16", "bfloat16", "bfloat16")
    assert pure.peaks(load_device("h100-sxm")) == RECIPES["bf16"].peaks(load_device("h100-sxm"))
    assert pure.dispatch_scale() == 1.0 and "no fp32 master" in pure.what


def test_bfloat16_still_means_bf16_mixed_precision() -> None:
    """A profile or plan in bfloat16 that records no recipe was counted before the recipes, in bf16 mixed precision:
    pure bf16 and fp8 are recorded by name, never implied by the dtype."""
    assert recipe_of_dtype("bfloat16") is RECIPES["bf16"] is DEFAULT_RECIPE
    assert [r.name for r in RECIPES.values() if r.implied] == ["fp32", "bf16"]
    assert plan_recipe("bf16-pure", "bfloat16") is RECIPES["bf16-pure"]


def test_pure_bf16_is_torchtitans_training_dtype_and_refused_by_megatron_and_deepspeed() -> None:
    """torchtitan's `training.dtype=bfloat16` puts parameters, gradients and optimizer state in bf16 with no fp32
    copy (torchtitan/config/configs.py); Megatron-LM's `--main-params-dtype` takes fp32 or fp16 and DeepSpeed's
    `bf16_master_weights_and_grads` clones a bf16 master partition: each keeps a master copy, so both refuse."""
    pure = RECIPES["bf16-pure"]
    assert pure.torchtitan == ("--training.dtype=bfloat16", "--training.mixed_precision_param=bfloat16")
    assert pure.refusal("torchtitan") is None
    for trainer, says in (("megatron", "--main-params-dtype"), ("deepspeed", "bf16_master_weights_and_grads")):
        why = pure.refusal(trainer)
        assert why is not None and says in why and why.endswith(
            "count the profile again with `precision` bf16 (the recipe is the profile's), then re-plan")

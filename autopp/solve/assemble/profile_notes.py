"""What a plan says of the profile it was made from: a microbatch size outside the profiled ones, a profile counted
before the precision recipes or before the model's output was recorded, a model normalizing with BatchNorm, a
profile counted with fused elementwise kernels."""

from __future__ import annotations

from ...data.precision import recorded_kernels
from ...data.profile import Profile

__all__ = ["profile_notes"]


def profile_notes(profile: Profile, microbatches: int, size: int, vocab: bool = False) -> list[str]:
    """The notes of a plan of `microbatches` microbatches of `size` samples made from `profile` (`vocab`: with
    vocabulary parallelism, whose last stage holds the hidden states it hands the output pass, not the model's
    output: `autopp.costmodel.vocab.body_arrays`)."""
    return [*_batch_norm_note(profile, microbatches, size), *_recipe_note(profile),
            *([] if vocab else _output_note(profile)), *_size_note(profile, size), *_kernels_note(profile)]


def _kernels_note(profile: Profile) -> list[str]:
    """A profile counted with fused elementwise kernels (`extra.analytic.kernels`, autopp.measure.fusion) times what
    a trainer that fuses them runs: said, since `autopp run` and an eager trainer run each op as its own kernel."""
    if recorded_kernels(profile.meta.extra) != "fused":
        return []
    return ["the profile counts fused elementwise kernels (`--kernels fused`: a chain of elementwise ops between "
            "matmuls one kernel, nearest torch.compile's fusion, which also recomputes in the backward what they "
            "need not keep): a run of eager kernels, op by op (autopp run's, a trainer's without torch.compile or "
            "fused kernels), takes longer and keeps more activation memory than predicted"]


def _size_note(profile: Profile, size: int) -> list[str]:
    """A microbatch size outside the profiled ones is extrapolated (autopp.costmodel.units.ProfileTable): said."""
    sizes = sorted(profile.meta.microbatch_sizes)
    if sizes[0] <= size <= sizes[-1]:
        return []
    how = "in proportion to the one profiled" if len(sizes) == 1 else \
        f"along the line through {sizes[:2] if size < sizes[0] else sizes[-2:]}"
    return [f"microbatch size {size} is outside the profiled sizes {sizes}: its times and bytes are extrapolated "
            f"{how}; profile it (--microbatch-sizes {','.join(map(str, sorted({*sizes, size})))}) to measure them"]


def _recipe_note(profile: Profile) -> list[str]:
    """A bf16 profile that records no precision recipe and counts its gradients at the weights' 2 bytes was counted
    before them (autopp.data.precision): said, as what the plan's memory lacks. A measured bf16 profile records no
    recipe either (bfloat16 implies bf16) and counts fp32 gradients: no note."""
    held = profile.units[profile.units.param_bytes > 0]
    if profile.meta.dtype != "bfloat16" or "precision" in profile.meta.extra or held.empty or \
            bool((held.grad_bytes > held.param_bytes).any()):
        return []
    return ["the profile records no precision recipe (counted before autopp's recipes): its gradients are counted "
            "at the weights' 2 bytes a parameter, where the bf16 recipe keeps them in fp32 (4 bytes, as Megatron-LM's "
            "--bf16 and torchtitan's float32 reduction do), so the plan's memory lacks 2 bytes a parameter; count "
            "the profile again (`autopp profile --analytic DEVICE`) for the recipe's bytes"]


def _batch_norm_note(profile: Profile, microbatches: int, size: int) -> list[str]:
    """Issue 26: a model that normalizes with BatchNorm (the profile's `extra.batch_norm`), said at plan time: its
    statistics are per microbatch under pipelining (autopp.run.steps.batch_norm_refusal)."""
    norms = profile.meta.extra.get("batch_norm") or []
    if not norms or microbatches == 1:
        return []
    more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
    return [f"the model normalizes with BatchNorm ({norms[0]}{more}), whose statistics are per microbatch "
            f"({size} samples here, not the global batch), so a pipelined step differs from the "
            "single-process one by design: `autopp run` measures it only with --no-validate; GroupNorm or LayerNorm "
            "normalize each sample and validate"]


def _output_note(profile: Profile) -> list[str]:
    """A profile whose last unit records no output bytes was made before the model's output was recorded
    (2026-12-06): the plan's last stage lacks what torch's stage holds of it per in-flight microbatch
    (`autopp.costmodel.units.UnitArrays.model_output`), said with what to do."""
    last = profile.units[profile.units.unit == profile.num_units - 1]
    if bool((last.output_bytes > 0).any()):
        return []
    return ["the profile records no bytes for the model's output (made before 2026-12-06): the last stage's memory "
            "lacks the output torch's pipelining stage holds for the loss per in-flight microbatch (an LM's logits); "
            "profile the model again for them"]

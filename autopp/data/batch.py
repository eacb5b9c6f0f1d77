"""The global batch a plan trains when the user gives none: a token budget for a sequence model, else a count per
device (`autopp plan` says which in one line)."""

from __future__ import annotations

import math

__all__ = ["TOKENS_PER_STEP", "SAMPLES_PER_DEVICE", "default_global_batch", "default_global_batch_said"]

#: The default token budget of a step for a sequence model: 2^20, about a million tokens. Published runs train with
#: 0.5M tokens per step (GPT-3 125M-350M; Brown et al. 2020, Table 2.1), 1M (GPT-3 760M-2.7B), 2M (GPT-3 6.7B-13B)
#: and 4M (Llama 2, every size; Touvron et al. 2023, section 2.2): 1M sits in that range; a larger run gives its own.
TOKENS_PER_STEP = 2**20

#: The default samples per step per device for a model without a sequence length: with every device one pipeline
#: stage (p stages, dp 1) that is m = 8p microbatches of 1, whose 1F1B bubble (p - 1) / (m + p - 1) stays under 1/9
#: (Narayanan et al. 2021, section 2.2), so the default batch does not make the bubble the answer.
SAMPLES_PER_DEVICE = 8


def default_global_batch(num_devices: int, seq_len: int | None, multiple: int = 1) -> int:
    """The global batch when the user gives none: for a model of `seq_len` tokens per sample, `TOKENS_PER_STEP` /
    `seq_len` sequences rounded to the nearest power of two (so that every power-of-two dp divides it), at least 1;
    otherwise `SAMPLES_PER_DEVICE` x `num_devices`; either rounded up to a multiple of `multiple` (a pinned
    microbatch count)."""
    if seq_len is not None:
        batch = 2 ** max(0, round(math.log2(TOKENS_PER_STEP / seq_len)))
    else:
        batch = SAMPLES_PER_DEVICE * num_devices
    return -(-batch // multiple) * multiple


def default_global_batch_said(num_devices: int, seq_len: int | None, microbatches: int = 1, dp: int = 1
                              ) -> tuple[int, str]:
    """`default_global_batch` rounded up to a multiple of the pinned `microbatches` x `dp` replicas (each replica
    streams its share in that many microbatches), and the words that say how it was made."""
    batch, plain = default_global_batch(num_devices, seq_len, microbatches * dp), default_global_batch(num_devices,
                                                                                                     seq_len)
    what = (f"{batch} sequences of {seq_len} tokens per step (the default for a sequence model: 2^20 tokens / seq_len, "
            "rounded to a power of two" if seq_len is not None else
            f"{batch} samples per step (the default: {SAMPLES_PER_DEVICE} per device")
    if batch != plain:  # only the flags given (above 1) are named
        named = " x ".join(f"{f} {v}" for f, v in (("--dp", dp), ("--microbatches", microbatches)) if v > 1)
        what += f", {plain}, then up to a multiple of {named}"
    return batch, what + ")"

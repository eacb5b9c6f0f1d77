"""The default global batch (autopp.data.batch): a token budget for a sequence model, else a count per device."""

from __future__ import annotations

import pytest

from autopp.data.batch import SAMPLES_PER_DEVICE, TOKENS_PER_STEP, default_global_batch


@pytest.mark.parametrize("seq, batch", [(512, 2048), (4096, 256), (8192, 128), (1000, 1024), (1500, 512),
                                        (2**21, 1)])
def test_a_sequence_model_gets_about_a_million_tokens_in_a_power_of_two(seq: int, batch: int) -> None:
    assert default_global_batch(16, seq) == batch
    assert TOKENS_PER_STEP / 2 ** 0.5 <= batch * seq <= TOKENS_PER_STEP * 2 ** 0.5 or batch == 1


def test_other_models_get_samples_per_device() -> None:
    assert default_global_batch(2, None) == 2 * SAMPLES_PER_DEVICE == 16
    assert default_global_batch(64, None) == 512


def test_a_pinned_microbatch_count_rounds_it_up_to_a_multiple() -> None:
    assert default_global_batch(2, None, 3) == 18
    assert default_global_batch(16, 512, 3) == 2049
    assert default_global_batch(16, 512, 4) == 2048


def test_the_default_batch_divides_over_the_pinned_replicas_and_microbatches_and_says_so() -> None:
    """A tester: `--dp 2 --microbatches 3` got 2,049 sequences ("rounded to a power of two"), which dp 2 cannot
    split, and the error named that batch instead of what was wrong with the request."""
    from autopp.data.batch import default_global_batch_said
    assert default_global_batch_said(8, 512) == (2048, "2048 sequences of 512 tokens per step (the default for a "
                                                       "sequence model: 2^20 tokens / seq_len, rounded to a power of "
                                                       "two)")
    batch, what = default_global_batch_said(8, 512, microbatches=3, dp=2)
    assert batch == 2052 and batch % 6 == 0
    assert what.endswith("rounded to a power of two, 2048, then up to a multiple of --dp 2 x --microbatches 3)")
    assert default_global_batch_said(4, None, microbatches=3)[1] == (
        "33 samples per step (the default: 8 per device, 32, then up to a multiple of --microbatches 3)")
    # a reviewer: --dp 3 alone named a --microbatches 1 never given
    assert default_global_batch_said(6, 8192, dp=3)[1].endswith("128, then up to a multiple of --dp 3)")

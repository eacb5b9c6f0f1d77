"""The LM head measured on slices of its vocabulary (autopp.measure.head): on a tiny Llama, every byte count of the
last unit comes out exactly the unsliced measurement's, and its times are the larger slice's scaled by k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from autopp.measure.head import HeadSlice, extrapolate, find_head
from autopp.measure.options import MeasureOptions, ProfileOptions
from autopp.measure.pieces import SizeResult, measure_pieces
from autopp.measure.settings import Settings
from autopp.model.hf import hf_model_file
from autopp.model.meta import build_units

CONFIG = Path(__file__).parents[2] / "examples" / "configs" / "tiny-llama.json"
BYTES = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes", "recompute_keep_bytes",
         "selective_activation_bytes")


def _measure(head_slice_numel: int | None) -> tuple[SizeResult, Any]:
    mf = hf_model_file(CONFIG, seq_len=16)
    meta, units, _ = build_units(mf, torch.float32)
    now = [0.0]

    def clock() -> float:
        now[0] += 1e-3
        return now[0]
    settings = Settings(ProfileOptions(optimizer="adamw"), MeasureOptions(warmup=0, repeats=1, clock=clock))
    return measure_pieces(mf, meta, units, 2, settings, limit_bytes=0, optimizer_per_piece=True,
                          head_slice_numel=head_slice_numel), meta


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_sliced_head_records_the_full_heads_bytes_exactly() -> None:
    whole, _ = _measure(None)
    sliced, meta = _measure(64 * 256)  # tiny-llama's head: 2048 x 64, measured at 32, 128 and 256 rows
    assert whole.head_slice is None
    assert sliced.head_slice == {"unit": 5, "module": "lm_head", "vocab": 2048, "rows": [32, 128, 256], "k": 8.0,
                                 "how": sliced.head_slice["how"]}
    last_whole, last_sliced = whole.rows[-1], sliced.rows[-1]
    assert last_whole["activation_bytes"] > 2 * 16 * 2048 * 4  # logits-sized tensors are kept: the case is real
    for key in BYTES:
        assert last_sliced[key] == last_whole[key], key
    # the peak is a maximum over the run's moments: affine in the rows only while one moment holds it
    assert sliced.peaks[5] == pytest.approx(whole.peaks[5], rel=0.01)
    assert sliced.rows[:-1] == whole.rows[:-1]  # the other units are not touched
    # the fake clock gives every timed call 1 ms whatever the rows: times that do not grow with the vocabulary
    # (an intercept) are not multiplied by k = 8
    assert last_sliced["forward_s"] == pytest.approx(last_whole["forward_s"]) == pytest.approx(1e-3)
    assert last_sliced["backward_s"] == pytest.approx(last_whole["backward_s"])
    assert sliced.optimizer_step_s == pytest.approx(whole.optimizer_step_s)
    assert tuple(meta.model.lm_head.weight.shape) == (2048, 64) and meta.materialized_bytes == 0  # restored


@pytest.mark.integration  # about a second or more: the unit tier stays under a minute
def test_find_head_skips_small_tied_and_non_linear_heads() -> None:
    mf = hf_model_file(CONFIG, seq_len=16)
    meta, units, _ = build_units(mf, torch.float32)
    from autopp.model.meta import meta_pieces
    pipe, *_ = meta_pieces(mf, meta, [u.split_point for u in units[1:] if u.split_point], 1, torch.float32)
    calls = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]
    last, first = (pipe.split_gm.get_submodule(str(calls[k].target)) for k in (-1, 0))
    target = torch.zeros(1, 16, dtype=torch.long)
    assert find_head(last, meta.model, target, 64 * 256) == HeadSlice("lm_head", 2048, 64, (32, 128, 256))
    assert find_head(last, meta.model, target, 2048 * 64) is None  # fits in the slice: measured whole
    assert find_head(last, meta.model, target.float(), 64 * 256) is None  # targets that are not classes
    assert find_head(first, meta.model, target, 64) is None  # unit 0 ends with no head
    meta.model.lm_head.weight = meta.model.model.embed_tokens.weight  # tied
    assert find_head(last, meta.model, target, 64 * 256) is None


def test_extrapolate_is_affine_in_the_rows() -> None:
    head = HeadSlice("lm_head", 1000, 10, (10, 50, 100))
    low = {"forward_s": 0.2 + 0.01 * 10, "forward_spread_s": 0.5, "activation_bytes": 10**6, "name": "x"}
    middle = {"activation_bytes": 7 + 3 * 50, "name": "x"}  # bytes only (not timed)
    high = {"forward_s": 0.2 + 0.01 * 100, "forward_spread_s": 0.1, "activation_bytes": 7 + 3 * 100, "name": "x"}
    out = extrapolate((low, middle, high), head)
    assert out["activation_bytes"] == 7 + 3 * 1000 and isinstance(out["activation_bytes"], int)  # last two
    assert out["forward_s"] == pytest.approx(0.2 + 0.01 * 1000)  # first and last: the intercept kept once
    assert out["forward_spread_s"] == pytest.approx(1.0) and out["name"] == "x"  # spread: the last's x k

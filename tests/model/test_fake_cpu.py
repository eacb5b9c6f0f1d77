"""Attention counted as a GPU runs it (autopp.model.fake_cpu.fused_attention): a value head size other than the
query's (DeepSeek's multi-head latent attention) makes the CPU fall back to the math path, which saves the scores;
the count then runs the memory-efficient kernel, which saves output and log-sum-exp only; one head size is left to
the CPU's flash kernel, so dense models count as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from autopp.measure.analytic import analytic_profile, count_model
from autopp.measure.options import ProfileOptions

ATTENTION = '''
import torch
from torch import nn

HEADS, QK, V, HIDDEN, SEQ = 4, {qk}, 16, 64, {seq}

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(HIDDEN, HEADS * QK), nn.Linear(HIDDEN, HEADS * QK)
        self.v, self.o = nn.Linear(HIDDEN, HEADS * V), nn.Linear(HEADS * V, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k = (p(x).view(b, s, HEADS, QK).transpose(1, 2) for p in (self.q, self.k))
        v = self.v(x).view(b, s, HEADS, V).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, s, HEADS * V))

def build_model():
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), Attention(), Attention(), nn.Linear(HIDDEN, 8))

def sample_batch(b):
    return torch.randn(b, SEQ, HIDDEN), torch.randn(b, SEQ, 8)
'''


def _saved(tmp_path: Path, qk: int, seq: int, fused: bool) -> int:
    """Bytes the first attention unit saves for backward, counted at microbatch 1."""
    path = tmp_path / f"attention_{qk}_{seq}.py"
    path.write_text(ATTENTION.format(qk=qk, seq=seq))
    counts = count_model(path, ProfileOptions(microbatch_sizes=(1,)), fused_attention=fused)
    return counts.rows[1].counts.activation_bytes


@pytest.mark.integration  # over 2 s: six models split and counted
def test_attention_with_a_value_head_of_its_own_saves_no_scores_on_a_gpu(tmp_path: Path) -> None:
    # was (profiles/deepseek-v3-h800-s4096): 11.4 GiB saved per layer at 4,096 tokens, the 128 x 4,096^2 scores kept
    heads, seq, floats = 4, 256, 4
    cpu, gpu = _saved(tmp_path, 24, seq, False), _saved(tmp_path, 24, seq, True)
    # the math path keeps the heads x s x s probabilities (float32 here); the fused kernel its log-sum-exp (heads x s,
    # float32) and two 8-byte random-number scalars instead; the rest (q, k, v, output) alike
    assert cpu - gpu == heads * seq * seq * floats - heads * seq * floats - 2 * 8
    # linear in s once fused: twice the tokens, twice the bytes, less the kernel's two 8-byte random-number scalars
    assert 2 * gpu - _saved(tmp_path, 24, 2 * seq, True) == 2 * 8
    same = _saved(tmp_path, 16, seq, False)  # one head size: the CPU's flash kernel, already fused, unchanged
    assert _saved(tmp_path, 16, seq, True) == same


@pytest.mark.integration  # over 2 s: a model counted three times
def test_an_analytic_profile_of_a_gpu_counts_fused_attention(tmp_path: Path) -> None:
    path = tmp_path / "attention.py"
    path.write_text(ATTENTION.format(qk=24, seq=64))
    options = ProfileOptions(microbatch_sizes=(1,))
    gpu = analytic_profile(path, "h100-sxm", options).units.activation_bytes[1]
    cpu = analytic_profile(path, "cpu", options).units.activation_bytes[1]
    assert gpu < cpu
    counts = count_model(path, options)  # as the CPU dispatches (calibration counts measured CPU profiles so)
    with pytest.raises(ValueError, match="counts were made with fused_attention=False, not for h100-sxm"):
        analytic_profile(path, "h100-sxm", options, counts=counts)

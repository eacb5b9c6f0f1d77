"""examples/gpt.py's GPT with a head that outweighs its body: vocabulary 32768 (256 x the width 128), two blocks, so
the LM head and its loss are several blocks of work and no split of the layers balances two pipeline ranks (the
vocabulary-parallelism benchmark, scripts/bench_vocab.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

_spec = importlib.util.spec_from_file_location("autopp_example_gpt", Path(__file__).with_name("gpt.py"))
assert _spec is not None and _spec.loader is not None
gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpt)

VOCAB = 32768
LAYERS = 2


def build_model() -> nn.Module:
    return gpt.GPT(vocab=VOCAB, layers=LAYERS)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, gpt.CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

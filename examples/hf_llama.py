"""A tiny Hugging Face Llama (transformers) built from a config with random weights: offline, no hub download.

Not a chain: the rotary tables and the causal mask are computed once before the blocks and read by every block, so
they are live across every cut (the profile says which of them can be recomputed instead of relayed). Units are
found without SPLIT_POINTS: the blocks of `model.layers`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 2048
WIDTH = 64
HEADS = 4
KV_HEADS = 2
LAYERS = 4
CONTEXT = 32


def build_model() -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

"""A tiny Hugging Face GPT-NeoX (transformers) built from a config with random weights: offline, no hub download.

Not a chain: the rotary tables and the causal mask are made once before the blocks and read by every block (the
model of issue 13, point 3: planned with `--schedule auto` on 4 devices it used to fail at run time). Units: the
embedding, each block of `gpt_neox.layers`, the final norm with the head (8 units).
"""

from __future__ import annotations

import torch
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

VOCAB = 256
WIDTH = 32
HEADS = 4
LAYERS = 6
CONTEXT = 16


def build_model() -> torch.nn.Module:
    config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, max_position_embeddings=CONTEXT,
                           rotary_pct=0.5, bos_token_id=0, eos_token_id=0, use_cache=False,
                           tie_word_embeddings=False, attention_dropout=0.0, hidden_dropout=0.0)
    return GPTNeoXForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


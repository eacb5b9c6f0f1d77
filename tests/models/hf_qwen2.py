"""A tiny Hugging Face Qwen2 (transformers) built from a config with random weights: offline, no hub download.

Not a chain: the rotary tables (cos, sin) and the causal mask are made once before the blocks and read by every
block, so they skip stages; the planner's default schedule (1F1B) must still run it on 4 ranks. Units: the
embedding, each block of `model.layers`, the final norm with the head (8 units, enough for 2 stages per rank on 4).
"""

from __future__ import annotations

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 256
WIDTH = 32
HEADS = 4
KV_HEADS = 2
LAYERS = 6
CONTEXT = 16


def build_model() -> torch.nn.Module:
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=CONTEXT,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


"""A tiny Hugging Face Mixtral (transformers) built from a config with random weights: offline, no hub download.

A mixture of experts: each block's feed-forward is 4 experts with top-2 routing (`MixtralSparseMoeBlock`), which
transformers 5 runs through `torch._grouped_mm` (its default `grouped_mm` experts implementation). The model of
issue 30's regression: it planned and ran before the meta-device work, then failed on fake tensors with
`Expected inputs of BF16 type but got mat_a.dtype=torch.float32`. Units: the embedding, each block of
`model.layers`, the final norm with the head (6 units).
"""

from __future__ import annotations

import torch
from transformers import MixtralConfig, MixtralForCausalLM

VOCAB = 256
WIDTH = 32
HEADS = 4
KV_HEADS = 2
LAYERS = 4
EXPERTS = 4
TOP_K = 2
CONTEXT = 16


def build_model() -> torch.nn.Module:
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, max_position_embeddings=CONTEXT, bos_token_id=0, eos_token_id=0,
                           pad_token_id=0, use_cache=False, tie_word_embeddings=False, router_jitter_noise=0.0)
    return MixtralForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]

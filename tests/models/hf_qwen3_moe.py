"""A tiny Hugging Face Qwen3-MoE (transformers) built from a config with random weights: offline, no hub download.

A mixture of experts without a shared expert: each block's feed-forward is 4 experts with top-2 routing and the
top-k weights renormalised (`norm_topk_prob`, as Qwen3-30B-A3B sets it), run through `torch._grouped_mm` in
transformers 5; attention has per-head q/k norms. Units: the embedding, each block of `model.layers`, the final
norm with the head (6 units).
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

VOCAB = 256
WIDTH = 32
HEADS = 4
KV_HEADS = 2
LAYERS = 4
EXPERTS = 4
TOP_K = 2
CONTEXT = 16


def build_model() -> torch.nn.Module:
    config = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                            moe_intermediate_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=KV_HEADS, head_dim=WIDTH // HEADS, num_experts=EXPERTS,
                            num_experts_per_tok=TOP_K, norm_topk_prob=True, max_position_embeddings=CONTEXT,
                            bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
                            tie_word_embeddings=False)
    return Qwen3MoeForCausalLM(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]

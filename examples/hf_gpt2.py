"""A tiny Hugging Face GPT-2 (transformers) built from a config with random weights: offline, no hub download.

The token embedding and the LM head share one weight (GPT-2's default `tie_word_embeddings`): the profile lists it
as a tied parameter group. Units are found without SPLIT_POINTS: the blocks of `transformer.h`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 2048
WIDTH = 64
HEADS = 2
LAYERS = 4
CONTEXT = 32


def build_model() -> torch.nn.Module:
    config = GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=False)
    return GPT2LMHeadModel(config)


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

"""A tiny Hugging Face BERT for masked-language modelling (transformers), built from a config with random weights:
offline, no hub download.

Inputs are token ids and a padding mask (the last tokens of every other sample are padding). BERT turns the mask into
an extended attention mask once, before the blocks, and every block reads it: it is live across every cut, and as it
is made from a model input it is relayed, not recomputed. The word embedding and the MLM decoder share one weight
(`tie_word_embeddings`): the profile lists it as a tied parameter group. Units are found without SPLIT_POINTS: the
blocks of `bert.encoder.layer`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import BertConfig, BertForMaskedLM

VOCAB = 1024
WIDTH = 64
HEADS = 2
LAYERS = 4
CONTEXT = 16
PAD = 4  # padding tokens at the end of every other sample


def build_model() -> torch.nn.Module:
    config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        intermediate_size=4 * WIDTH, max_position_embeddings=CONTEXT, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=0, tie_word_embeddings=True)
    return BertForMaskedLM(config)


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch_size, CONTEXT))
    mask = torch.ones(batch_size, CONTEXT, dtype=torch.long)
    mask[1::2, -PAD:] = 0
    ids = ids * mask
    target = torch.where(mask.bool(), torch.randint(1, VOCAB, (batch_size, CONTEXT)), -100)
    return (ids, mask), target


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)

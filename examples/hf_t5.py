"""A tiny Hugging Face T5 (transformers) encoder-decoder, built from a config with random weights: offline, no hub
download.

`forward(input_ids, attention_mask, decoder_input_ids)`: the encoder reads the source tokens, the decoder the
target tokens shifted right (teacher forcing), and every decoder block's cross-attention reads the encoder's output:
a value live from the last encoder unit to every decoder unit, relayed across the decoder stages between. The
relative-position biases made by the first block of each stack are read by the later blocks of that stack.
The token embedding is shared by the encoder, the decoder and the LM head (a tied parameter group).

Units are found without SPLIT_POINTS: the model has two repeated-block containers, `encoder.block` and
`decoder.block`, and every block of each is a unit, in call order; what runs between them (the encoder's final norm,
the decoder's embedding) folds into the last encoder unit.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = 512
WIDTH = 32
HEADS = 2
LAYERS = 3
SOURCE = 12
TARGET = 8


def build_model() -> torch.nn.Module:
    config = T5Config(vocab_size=VOCAB, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=2 * WIDTH, num_layers=LAYERS,
                      num_decoder_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8,
                      dropout_rate=0.0, use_cache=False, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    source = torch.randint(2, VOCAB, (batch_size, SOURCE))
    mask = torch.ones(batch_size, SOURCE, dtype=torch.long)
    labels = torch.randint(2, VOCAB, (batch_size, TARGET))
    decoder_input = torch.cat([torch.zeros(batch_size, 1, dtype=torch.long), labels[:, :-1]], dim=1)
    return (source, mask, decoder_input), labels


def loss_fn(output, target: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    logits = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

"""A tiny causal LM model file that `autopp run` may run in sequence chunks (Seq1F1B): its attention is causal SDPA
without a mask and its token positions are an input, so it declares SEQUENCE_CHUNKS (autopp.run.seq_chunks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, KV_HEADS, LAYERS, SEQ = 32, 16, 4, 2, 4, 12
SEQUENCE_CHUNKS = True
SPLIT_POINTS = [f"blocks.{i}" for i in range(1, LAYERS)]


class Block(nn.Module):
    """Pre-norm attention (grouped-query: KV_HEADS heads of K and V) and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.kv = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH * KV_HEADS // HEADS)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).reshape(b, n, HEADS, -1).transpose(1, 2)
        k, v = (t.reshape(b, n, KV_HEADS, -1).transpose(1, 2) for t in self.kv(h).chunk(2, dim=-1))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, n, WIDTH))
        return x + self.mlp(self.norm2(x))


class SeqLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.Sequential(*(Block() for _ in range(LAYERS)))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.tok(idx) + self.pos(positions))))


def build_model() -> nn.Module:
    return SeqLM()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(token ids, their positions), next tokens: every tensor (batch, SEQ)."""
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return (tokens[:, :-1], torch.arange(SEQ).repeat(batch_size, 1)), tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))

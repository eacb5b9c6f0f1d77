"""A tiny causal LM whose attention runs over sequence chunks (`autopp.run.seq_chunks.ChunkedAttention`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopp.run.seq_chunks import ChunkedAttention

VOCAB, WIDTH, HEADS, LAYERS, SEQ = 32, 16, 2, 4, 12


class Block(nn.Module):
    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.cache = ChunkedAttention(chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        x = x + self.proj(self.cache.attend(q, k, v).transpose(1, 2).reshape(b, n, WIDTH))
        return x + self.mlp(self.norm2(x))


class First(nn.Module):
    """Token and position embeddings and the first ``layers`` blocks."""

    def __init__(self, chunks: int, layers: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.Sequential(*(Block(chunks) for _ in range(layers)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        start = self.blocks[0].cache.offset() if torch.is_grad_enabled() else 0
        positions = torch.arange(start, start + idx.shape[1], device=idx.device)
        return self.blocks(self.tok(idx) + self.pos(positions))


class Middle(nn.Module):
    """``layers`` blocks."""

    def __init__(self, chunks: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(chunks) for _ in range(layers)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class Last(nn.Module):
    """The last ``layers`` blocks, the final norm and the LM head."""

    def __init__(self, chunks: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(chunks) for _ in range(layers)))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(x)))


def build(chunks: int, pieces: int = 2, seed: int = 0) -> nn.Sequential:
    """First, Middle..., Last (``pieces`` of LAYERS / pieces blocks): the same weights for every chunk count and
    piece count with one seed (modules are made in the same order)."""
    torch.manual_seed(seed)
    per = LAYERS // pieces
    middles = [Middle(chunks, per) for _ in range(pieces - 2)]
    return nn.Sequential(First(chunks, per), *middles, Last(chunks, per))


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def batch(m: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (m, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]

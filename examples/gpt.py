"""A small GPT in plain torch: token and position embedding, N blocks, final norm, LM head.

The vocabulary is large next to the width, so the embedding and the LM head are the heaviest units.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 8192
WIDTH = 128
HEADS = 4
LAYERS = 6
CONTEXT = 64


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embedding, a stack of blocks, final LayerNorm, untied LM head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS,
                 layers: int = LAYERS, context: int = CONTEXT) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, width)
        self.pos_emb = nn.Embedding(context, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.h:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch_size, CONTEXT + 1))
    return idx[:, :-1], idx[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))

"""A plain-torch decoder LM with a TP_PLAN and no sequence-parallel styles (a new user's model file): embeddings,
pre-norm blocks, then a final norm and the head called in the model's own forward, so that with sequence
parallelism the norm's unit is a step of the residual stream read by a module outside it (the head)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEAD_DIM, LAYERS, SEQ = 32, 16, 4, 2, 8
SPLIT_POINTS = [f"blocks.{i}" for i in range(1, LAYERS)] + ["norm"]
TP_PLAN = {"blocks.*.q": "colwise", "blocks.*.k": "colwise", "blocks.*.v": "colwise", "blocks.*.proj": "rowwise",
           "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.q, self.k, self.v, self.proj = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)  # heads from the local width: the colwise shards hold 1/tp of them
        q, k, v = (m(h).reshape(b, n, -1, HEAD_DIM).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PlainLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model() -> nn.Module:
    return PlainLM()


def sample_batch(batch_size: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    t = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return (t[:, :-1], torch.arange(SEQ).repeat(batch_size, 1)), t[:, 1:]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))

"""A tiny language model whose LM head is its token embedding (tied, as GPT-2's): split between them, each stage
holds a copy, and the copies' gradients must be summed across the ranks (autopp.run.tied)."""

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, WIDTH, SEQ = 16, 8, 6


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(3)))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def build_model() -> nn.Module:
    return TiedLM()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, VOCAB), target.reshape(-1))

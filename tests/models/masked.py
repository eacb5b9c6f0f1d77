"""Not a chain: a causal mask computed once before the blocks and read by every block, and a long residual from the
embedding to the head. Tiny, so that live values across each cut can be checked byte for byte."""
import torch
from torch import nn

T = 6
WIDTH = 8
BLOCKS = 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, mask):
        scores = (x @ x.transpose(1, 2)).masked_fill(mask, float("-inf"))
        return x + scores.softmax(-1) @ self.lin(x)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h0 = self.emb(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), diagonal=1)
        h = h0
        for block in self.blocks:
            h = block(h, mask)
        return self.head(torch.cat([h, h0], dim=-1)[..., :WIDTH] + h0)


def build_model():
    return Masked()


def sample_batch(batch_size):
    return torch.randn(batch_size, T, 4), torch.randn(batch_size, T, 2)

"""Two repeated-block containers, as an encoder-decoder has: `enc` blocks, a bridge module between them, `dec`
blocks, each dec block also reading the encoder's output (a value relayed across the dec units); plus a container of
containers (`stages`, whose stages' blocks are the units) and a block with a small same-class list inside it, which
is nested in a container already taken and so is not split."""
import torch
from torch import nn

WIDTH = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norms = nn.ModuleList(nn.LayerNorm(WIDTH) for _ in range(2))  # nested in `enc`: never a container

    def forward(self, x):
        return self.norms[1](x + self.lin(self.norms[0](x)))


class CrossBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x, memory):
        return x + self.lin(torch.cat([x, memory], dim=-1))


class TwoStacks(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(4, WIDTH)
        self.enc = nn.ModuleList(Block() for _ in range(3))
        self.bridge = nn.Linear(WIDTH, WIDTH)
        self.stages = nn.Sequential(nn.Sequential(Block(), Block()), nn.Sequential(Block(), Block()))
        self.dec = nn.ModuleList(CrossBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        memory = self.emb(x)
        for block in self.enc:
            memory = block(memory)
        h = self.stages(self.bridge(memory))
        for block in self.dec:
            h = block(h, memory)
        return self.head(h)


def build_model():
    return TwoStacks()


def sample_batch(batch_size):
    return torch.randn(batch_size, 3, 4), torch.randn(batch_size, 3, 2)

"""A tiny Vision Transformer in plain torch (timm needs torchvision, which breaks next to CPU torch here).

Patch embedding, class token and position embedding, a stack of pre-norm encoder blocks, final norm and a linear
head on the class token, as timm's `VisionTransformer`. Units are found without SPLIT_POINTS: the blocks of `blocks`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

IMAGE = 32
PATCH = 8
CHANNELS = 3
WIDTH = 64
HEADS = 4
DEPTH = 4
CLASSES = 10


class Block(nn.Module):
    """Pre-norm encoder block: self-attention and an MLP, each in a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Images (B, C, H, W) to class logits (B, CLASSES)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(CHANNELS, WIDTH, kernel_size=PATCH, stride=PATCH)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, WIDTH))
        self.pos_embed = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2 + 1, WIDTH) * 0.02)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def build_model() -> nn.Module:
    return ViT()


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, CHANNELS, IMAGE, IMAGE), torch.randint(0, CLASSES, (batch_size,))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)

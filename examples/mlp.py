"""A chain of Linear layers of very uneven widths: an nn.Sequential whose children are the units.

The widths make some layers cost ~100x others, so an even split by layer count is far from balanced.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTHS = [256, 4096, 256, 256, 8192, 256, 256, 256, 16]


def build_model() -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    # Group each Linear with its ReLU so that a unit is one layer.
    return nn.Sequential(*[nn.Sequential(*layers[i:i + 2]) for i in range(0, len(layers), 2)])


def sample_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch_size, WIDTHS[0]), torch.randn(batch_size, WIDTHS[-1])


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)

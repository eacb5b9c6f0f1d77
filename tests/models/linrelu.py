"""Linear/ReLU chain with known saved-tensor bytes: Linear saves its input, ReLU its output."""
import torch
from torch import nn

WIDTHS = [8, 32, 16, 4]


def build_model():
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))


def sample_batch(batch_size):
    return torch.randn(batch_size, 8), torch.randn(batch_size, 4)

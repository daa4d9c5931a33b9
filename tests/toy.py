"""A small tanh MLP and a seeded random data source, for tests that run the
executors on real tensors without a catalog model (imported by test modules;
pytest puts this folder on the path)."""

from __future__ import annotations

import torch
from torch import nn


def tanh_layers(n: int, width: int, classes: int, *, seed: int, weight_scale: float) -> list[nn.Module]:
    """``n`` layers: Linear(width, width) + Tanh, then Linear(width, classes),
    weights drawn from ``seed`` (times ``weight_scale``; biases times 0.1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lin = nn.Linear(width, width if i < n - 1 else classes)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * weight_scale)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
        out.append(nn.Sequential(lin, nn.Tanh()) if i < n - 1 else lin)
    return out


class SeededData:
    """Micro-batch i: ``batch`` random inputs of ``width`` and class targets,
    drawn from seed ``first_seed + i``."""

    def __init__(self, batch: int, width: int, classes: int, first_seed: int):
        self.size, self.width, self.classes, self.first_seed = batch, width, classes, first_seed

    def batch(self, i):
        g = torch.Generator().manual_seed(self.first_seed + i)
        return (
            torch.randn(self.size, self.width, generator=g),
            torch.randint(0, self.classes, (self.size,), generator=g),
        )

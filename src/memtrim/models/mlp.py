"""The seed experiment's MLP: 784-256-128-64-10 with ReLU and log_softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SeedMLP"]


class SeedMLP(nn.Module):
    """784-256-128-64-10 MLP with ReLU (``inplace=`` as in ``nn.ReLU``) and a log_softmax output.

    Accepts images ``(N, 1, 28, 28)`` or flat ``(N, 784)``; returns log-probabilities ``(N, 10)`` for
    ``F.nll_loss``.
    """

    def __init__(self, inplace: bool = False, sizes: tuple[int, ...] = (784, 256, 128, 64, 10)) -> None:
        super().__init__()
        self.sizes = tuple(sizes)
        self.inplace = inplace
        self.fc1 = nn.Linear(sizes[0], sizes[1])
        self.fc2 = nn.Linear(sizes[1], sizes[2])
        self.fc3 = nn.Linear(sizes[2], sizes[3])
        self.fc4 = nn.Linear(sizes[3], sizes[4])
        self.act1 = nn.ReLU(inplace=inplace)
        self.act2 = nn.ReLU(inplace=inplace)
        self.act3 = nn.ReLU(inplace=inplace)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``(N, 10)`` for images ``(N, 1, 28, 28)`` or flat ``(N, 784)``."""
        x = x.reshape(x.shape[0], -1)
        x = self.act1(self.fc1(x))
        x = self.act2(self.fc2(x))
        x = self.act3(self.fc3(x))
        return F.log_softmax(self.fc4(x), dim=1)

"""The seed MLP's shape with its hidden layers as additive couplings: the demo's reversible workload."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..techniques.reversible import AdditiveCoupling, ReversibleSequential

__all__ = ["CouplingMLP"]


class CouplingMLP(nn.Module):
    """784 -> 256, ``depth`` additive couplings on width 256 (f, g = Linear(128) + ReLU), 256 -> 10, log_softmax.

    Why: the seed experiment's network with hidden layers that can be made reversible, to show activation memory
    staying constant in depth. The same seed gives the same weights whether ``reversible`` or not, so the two
    forms train side by side in :func:`memtrim.verify`.

    Args:
        depth: the number of coupling blocks.
        reversible: hold them in a :class:`~memtrim.ReversibleSequential` (with ``check_drift=1e-3``) rather
            than an ``nn.Sequential``.
        exact: the reversible stack's fixed-point mode.
        seed: ``torch.manual_seed(seed)`` before building (as the demo's experiments did); ``None`` leaves the
            global generator alone.

    Example::

        plain, rev = CouplingMLP(8), CouplingMLP(8, reversible=True)
        torch.equal(plain(x), rev(x))   # True: the same weights, the same forward
    """

    def __init__(self, depth: int, reversible: bool = False, exact: bool = False, seed: int | None = 0) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        blocks = [AdditiveCoupling(nn.Sequential(nn.Linear(128, 128), nn.ReLU())) for _ in range(depth)]
        self.inp = nn.Linear(784, 256)
        self.hidden = (ReversibleSequential(*blocks, exact=exact, check_drift=1e-3) if reversible
                       else nn.Sequential(*blocks))
        self.out = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Log-probabilities ``(N, 10)`` for images ``(N, 1, 28, 28)`` or flat ``(N, 784)``."""
        return F.log_softmax(self.out(self.hidden(torch.relu(self.inp(x.reshape(x.shape[0], -1))))), dim=1)

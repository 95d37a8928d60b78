"""``memtrim.nn``: module forms of :mod:`memtrim.functional`, with torch's constructor signatures."""

from __future__ import annotations

import torch
from torch import nn

from . import functional as MF

__all__ = [
    "CELU", "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "Mish", "ReLU", "ReLU6", "SELU",
    "SiLU", "Sigmoid", "Softplus", "Tanh",
]


def owner(module: nn.Module) -> str:
    """How errors name ``module``: by its name in the model when :func:`memtrim.convert` converted it."""
    return getattr(module, "memtrim_owner", None) or f"memtrim.nn.{type(module).__name__}"


class ReLU(nn.ReLU):
    """``nn.ReLU`` keeping only its output (``save="mask"``: a 1-bit mask) for backward."""

    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.relu(input, self.inplace, save=self.save, _owner=owner(self))


class LeakyReLU(nn.LeakyReLU):
    def __init__(self, negative_slope: float = 0.01, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(negative_slope, inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.leaky_relu(input, self.negative_slope, self.inplace, save=self.save, _owner=owner(self))


class Hardtanh(nn.Hardtanh):
    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *,
                 save: str = "output") -> None:
        super().__init__(min_val, max_val, inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.hardtanh(input, self.min_val, self.max_val, self.inplace, save=self.save, _owner=owner(self))


class ReLU6(nn.ReLU6):
    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.relu6(input, self.inplace, save=self.save, _owner=owner(self))


class ELU(nn.ELU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.elu(input, self.alpha, self.inplace, _owner=owner(self))


class CELU(nn.CELU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.celu(input, self.alpha, self.inplace, _owner=owner(self))


class SELU(nn.SELU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.selu(input, self.inplace, _owner=owner(self))


class Sigmoid(nn.Sigmoid):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.sigmoid(input, _owner=owner(self))


class Tanh(nn.Tanh):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.tanh(input, _owner=owner(self))


class Hardsigmoid(nn.Hardsigmoid):
    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.hardsigmoid(input, self.inplace, save=self.save, _owner=owner(self))


class Softplus(nn.Softplus):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.softplus(input, self.beta, self.threshold, _owner=owner(self))


class SiLU(nn.SiLU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.silu(input, self.inplace, _owner=owner(self))


class GELU(nn.GELU):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.gelu(input, self.approximate, _owner=owner(self))


class Mish(nn.Mish):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.mish(input, self.inplace, _owner=owner(self))


class Hardswish(nn.Hardswish):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return MF.hardswish(input, self.inplace, _owner=owner(self))

"""``memtrim.nn``: module forms of :mod:`memtrim.functional`, with torch's constructor signatures."""

from __future__ import annotations

import torch
from torch import nn

from ..guards import owner
from . import functional as MF

__all__ = [
    "CELU", "ELU", "GELU", "Hardsigmoid", "Hardswish", "Hardtanh", "LeakyReLU", "Mish", "ReLU", "ReLU6", "SELU",
    "SiLU", "Sigmoid", "Softplus", "Tanh",
]


class ReLU(nn.ReLU):
    """``nn.ReLU`` keeping only its output (``save="mask"``: a 1-bit mask) for backward."""

    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.relu` of ``input`` with this module's settings."""
        return MF.relu(input, self.inplace, save=self.save, _owner=owner(self))


class LeakyReLU(nn.LeakyReLU):
    """``nn.LeakyReLU`` keeping only its output (``save="mask"``: a 1-bit mask); a negative slope keeps the input."""

    def __init__(self, negative_slope: float = 0.01, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(negative_slope, inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.leaky_relu` of ``input`` with this module's settings."""
        return MF.leaky_relu(input, self.negative_slope, self.inplace, save=self.save, _owner=owner(self))


class Hardtanh(nn.Hardtanh):
    """``nn.Hardtanh`` keeping only its output (``save="mask"``: a 1-bit mask) for backward."""

    def __init__(self, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *,
                 save: str = "output") -> None:
        super().__init__(min_val, max_val, inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.hardtanh` of ``input`` with this module's settings."""
        return MF.hardtanh(input, self.min_val, self.max_val, self.inplace, save=self.save, _owner=owner(self))


class ReLU6(nn.ReLU6):
    """``nn.ReLU6`` keeping only its output (``save="mask"``: a 1-bit mask) for backward."""

    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.relu6` of ``input`` with this module's settings."""
        return MF.relu6(input, self.inplace, save=self.save, _owner=owner(self))


class ELU(nn.ELU):
    """``nn.ELU`` keeping only its output for backward (alpha > 0; otherwise its input)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.elu` of ``input`` with this module's settings."""
        return MF.elu(input, self.alpha, self.inplace, _owner=owner(self))


class CELU(nn.CELU):
    """``nn.CELU`` keeping only its output for backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.celu` of ``input`` with this module's settings."""
        return MF.celu(input, self.alpha, self.inplace, _owner=owner(self))


class SELU(nn.SELU):
    """``nn.SELU`` keeping only its output for backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.selu` of ``input`` with this module's settings."""
        return MF.selu(input, self.inplace, _owner=owner(self))


class Sigmoid(nn.Sigmoid):
    """``nn.Sigmoid`` keeping only its output for backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.sigmoid` of ``input`` with this module's settings."""
        return MF.sigmoid(input, _owner=owner(self))


class Tanh(nn.Tanh):
    """``nn.Tanh`` keeping only its output for backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.tanh` of ``input`` with this module's settings."""
        return MF.tanh(input, _owner=owner(self))


class Hardsigmoid(nn.Hardsigmoid):
    """``nn.Hardsigmoid`` keeping only its output (``save="mask"``: a 1-bit mask) for backward."""

    def __init__(self, inplace: bool = False, *, save: str = "output") -> None:
        super().__init__(inplace)
        self.save = save

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.hardsigmoid` of ``input`` with this module's settings."""
        return MF.hardsigmoid(input, self.inplace, save=self.save, _owner=owner(self))


class Softplus(nn.Softplus):
    """``nn.Softplus`` keeping its output where that determines the gradient (see
    :func:`memtrim.functional.softplus_keeps_output`), its input otherwise."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.softplus` of ``input`` with this module's settings."""
        return MF.softplus(input, self.beta, self.threshold, _owner=owner(self))


class SiLU(nn.SiLU):
    """``nn.SiLU`` keeping only its input for backward (``inplace=True`` keeps a copy of it, as torch does)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.silu` of ``input`` with this module's settings."""
        return MF.silu(input, self.inplace, _owner=owner(self))


class GELU(nn.GELU):
    """``nn.GELU`` (exact or ``approximate="tanh"``) keeping only its input for backward."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.gelu` of ``input`` with this module's settings."""
        return MF.gelu(input, self.approximate, _owner=owner(self))


class Mish(nn.Mish):
    """``nn.Mish`` keeping only its input for backward (``inplace=True`` keeps a copy of it, as torch does)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.mish` of ``input`` with this module's settings."""
        return MF.mish(input, self.inplace, _owner=owner(self))


class Hardswish(nn.Hardswish):
    """``nn.Hardswish`` keeping only its input for backward (``inplace=True`` keeps a copy of it)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """:func:`memtrim.functional.hardswish` of ``input`` with this module's settings."""
        return MF.hardswish(input, self.inplace, _owner=owner(self))

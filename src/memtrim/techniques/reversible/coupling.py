"""Invertible coupling blocks: additive (NICE/RevNet) and affine (RealNVP-style, scale kept invertible)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import InvalidInputError

__all__ = ["AdditiveCoupling", "AffineCoupling"]


def _split(module: nn.Module, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() <= dim or x.shape[dim] % 2:
        raise InvalidInputError(
            f"memtrim.{type(module).__name__}: the input's dimension {dim} has size "
            f"{x.shape[dim] if x.dim() > dim else 'none'}; a coupling splits it into two equal halves, so it must "
            "be even. Pad the features or choose another split_dim."
        )
    x1, x2 = x.chunk(2, dim=dim)
    return x1, x2


def _checked(module: nn.Module, name: str, out: Any, like: torch.Tensor, channels: int = 1) -> torch.Tensor:
    expected = list(like.shape)
    dim = module.split_dim
    assert isinstance(dim, int)
    expected[dim] *= channels
    if not isinstance(out, torch.Tensor) or list(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidInputError(
            f"memtrim.{type(module).__name__}: {name} must return a tensor of shape {tuple(expected)} (the shape of "
            f"half the input{', times 2 along split_dim' if channels == 2 else ''}), got {got}."
        )
    return out


# A coupling's arithmetic is written once, in ``couple`` (forward) and ``uncouple`` (inverse); what stands for
# ``f(half)`` is passed in (``evaluate``), so ReversibleSequential runs the same arithmetic while capturing,
# replaying or recording around each of f and g. See NOTE [ reversible without backward inside backward ].
Evaluate = Callable[[str, nn.Module, torch.Tensor], Any]


def _call(name: str, fn: nn.Module, half: torch.Tensor) -> Any:
    return fn(half)


class AdditiveCoupling(nn.Module):
    """``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``: exactly invertible in exact arithmetic.

    Args:
        f, g: modules mapping one half to a tensor of the same shape. ``g=None`` uses a deep copy of ``f``.
        split_dim: the dimension split into two equal halves (default 1, channels / features).
    """

    def __init__(self, f: nn.Module, g: nn.Module | None = None, split_dim: int = 1) -> None:
        super().__init__()
        self.f = f
        self.g = g if g is not None else copy.deepcopy(f)
        self.split_dim = split_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split ``x`` into halves along ``split_dim``, couple them (:meth:`couple`), and join the result."""
        y1, y2 = self.couple(*_split(self, x, self.split_dim), self.checked_call)
        return torch.cat([y1, y2], dim=self.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The block's input rebuilt from its output ``y`` (:meth:`uncouple` on its halves)."""
        x1, x2 = self.uncouple(*_split(self, y, self.split_dim), _call)
        return torch.cat([x1, x2], dim=self.split_dim)

    def checked_call(self, name: str, fn: nn.Module, half: torch.Tensor) -> torch.Tensor:
        """``fn(half)``, which must have the half's shape (else InvalidInputError naming f or g)."""
        return _checked(self, name, fn(half), half)

    def couple(self, x1: torch.Tensor, x2: torch.Tensor, evaluate: Evaluate) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward on the halves: ``y1 = x1 + f(x2)``, ``y2 = x2 + g(y1)``, ``evaluate(name, fn, half)``
        standing for ``fn(half)``."""
        y1 = x1 + evaluate("f", self.f, x2)
        y2 = x2 + evaluate("g", self.g, y1)
        return y1, y2

    def uncouple(self, y1: torch.Tensor, y2: torch.Tensor, evaluate: Evaluate) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse on the halves: ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)`` (g first, then f)."""
        x2 = y2 - evaluate("g", self.g, y1)
        x1 = y1 - evaluate("f", self.f, x2)
        return x1, x2


class AffineCoupling(nn.Module):
    """``y1 = x1 * s_f + t_f`` with ``(s_f, t_f) = f(x2)``; ``y2 = x2 * s_g + t_g`` with ``(s_g, t_g) = g(y1)``.

    ``f`` and ``g`` return twice the half's size along ``split_dim`` (a raw scale, then a shift); the scale used is
    ``sigmoid(raw + 2)``, in (0, 1) and never 0, so the block stays invertible (as memcnn's affine adapter).
    """

    def __init__(self, f: nn.Module, g: nn.Module, split_dim: int = 1) -> None:
        super().__init__()
        self.f, self.g, self.split_dim = f, g, split_dim

    def scale_shift(self, name: str, fn: nn.Module, half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(s, t)`` from ``fn(half)``: the scale ``sigmoid(raw + 2)`` and the shift."""
        raw, shift = _checked(self, name, fn(half), half, channels=2).chunk(2, dim=self.split_dim)
        return torch.sigmoid(raw + 2.0), shift

    @staticmethod
    def mix(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """One half's update, ``x * scale + shift``."""
        return x * scale + shift

    @staticmethod
    def unmix(y: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        """:meth:`mix` undone, ``(y - shift) / scale``."""
        return (y - shift) / scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Split ``x`` into halves along ``split_dim``, couple them (:meth:`couple`), and join the result."""
        y1, y2 = self.couple(*_split(self, x, self.split_dim), self.scale_shift)
        return torch.cat([y1, y2], dim=self.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """The block's input rebuilt from its output ``y`` (:meth:`uncouple` on its halves)."""
        x1, x2 = self.uncouple(*_split(self, y, self.split_dim), self.scale_shift)
        return torch.cat([x1, x2], dim=self.split_dim)

    def couple(self, x1: torch.Tensor, x2: torch.Tensor, scale_shift: Evaluate) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward on the halves, ``scale_shift(name, fn, half)`` standing for :meth:`scale_shift`."""
        y1 = self.mix(x1, *scale_shift("f", self.f, x2))
        y2 = self.mix(x2, *scale_shift("g", self.g, y1))
        return y1, y2

    def uncouple(self, y1: torch.Tensor, y2: torch.Tensor, scale_shift: Evaluate) -> tuple[torch.Tensor, torch.Tensor]:
        """The inverse on the halves (g first, then f)."""
        x2 = self.unmix(y2, *scale_shift("g", self.g, y1))
        x1 = self.unmix(y1, *scale_shift("f", self.f, x2))
        return x1, x2

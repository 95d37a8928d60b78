"""Invertible coupling blocks: additive (NICE/RevNet) and affine (RealNVP-style, scale kept invertible)."""

from __future__ import annotations

import copy
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
    expected[module.split_dim] *= channels  # type: ignore[operator]
    if not isinstance(out, torch.Tensor) or list(out.shape) != expected:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidInputError(
            f"memtrim.{type(module).__name__}: {name} must return a tensor of shape {tuple(expected)} (the shape of "
            f"half the input{', times 2 along split_dim' if channels == 2 else ''}), got {got}."
        )
    return out


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
        x1, x2 = _split(self, x, self.split_dim)
        y1 = x1 + _checked(self, "f", self.f(x2), x2)
        y2 = x2 + _checked(self, "g", self.g(y1), y1)
        return torch.cat([y1, y2], dim=self.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        y1, y2 = _split(self, y, self.split_dim)
        x2 = y2 - self.g(y1)
        x1 = y1 - self.f(x2)
        return torch.cat([x1, x2], dim=self.split_dim)


class AffineCoupling(nn.Module):
    """``y1 = x1 * s_f + t_f`` with ``(s_f, t_f) = f(x2)``; ``y2 = x2 * s_g + t_g`` with ``(s_g, t_g) = g(y1)``.

    ``f`` and ``g`` return twice the half's size along ``split_dim`` (a raw scale, then a shift); the scale used is
    ``sigmoid(raw + 2)``, in (0, 1) and never 0, so the block stays invertible (as memcnn's affine adapter).
    """

    def __init__(self, f: nn.Module, g: nn.Module, split_dim: int = 1) -> None:
        super().__init__()
        self.f, self.g, self.split_dim = f, g, split_dim

    def _scale_shift(self, name: str, fn: nn.Module, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raw, shift = _checked(self, name, fn(h), h, channels=2).chunk(2, dim=self.split_dim)
        return torch.sigmoid(raw + 2.0), shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = _split(self, x, self.split_dim)
        s, t = self._scale_shift("f", self.f, x2)
        y1 = x1 * s + t
        s, t = self._scale_shift("g", self.g, y1)
        y2 = x2 * s + t
        return torch.cat([y1, y2], dim=self.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        y1, y2 = _split(self, y, self.split_dim)
        s, t = self._scale_shift("g", self.g, y1)
        x2 = (y2 - t) / s
        s, t = self._scale_shift("f", self.f, x2)
        x1 = (y1 - t) / s
        return torch.cat([x1, x2], dim=self.split_dim)

"""Pointwise helpers shared by the norm + activation modules: the fastest torch kernels for a per-channel affine
map, and cached constant tensors (mean 0, variance 1) to feed torch's fused normalization kernels."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["native_batch_norm", "per_channel", "zeros_and_ones"]

native_batch_norm = torch.ops.aten.native_batch_norm.default

# (shape, dtype, device) -> (zeros, ones); never written to (the kernels fed them only read them)
_CONSTANTS: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def zeros_and_ones(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros and ones shaped like ``like``, made once per shape, dtype and device."""
    key = (tuple(like.shape), like.dtype, like.device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = (torch.zeros_like(like), torch.ones_like(like))
    return found


def per_channel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x * scale + shift`` per channel (dimension 1), by BatchNorm's inference kernel with mean 0, variance 1 and
    eps 0, whose per-channel terms are then exactly ``scale`` and ``shift``: on CPU two to three times as fast as a
    broadcast ``addcmul``, and in the input's dtype."""
    zeros, ones = zeros_and_ones(scale)
    return native_batch_norm(x, scale, shift, zeros, ones, False, 0.0, 0.0)[0]

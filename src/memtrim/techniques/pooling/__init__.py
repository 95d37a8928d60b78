"""Max pooling that keeps each window's argmax as a one-byte offset instead of an int64 index.

NOTE [ compact max-pool indices ]
torch's 2-D max pool keeps its input and an int64 index per output element (the flat position ``h * W + w`` of the
window's maximum in the input plane) for backward: with a 3x3 window the indices take twice the output's float32
bytes. The position is always one of the ``kH * kW`` window cells, so an offset in the window identifies it: one
byte for windows up to 256 cells. The forward runs torch's own kernel, then encodes

    offset = inverse[index - base]          base[oh, ow] = (oh * sH - pH) * W + (ow * sW - pW)

(``index - base`` is ``i * dH * W + j * dW`` for the window cell (i, j), and ``inverse`` maps it back to
``i * kW + j``); backward decodes ``index = deltas[offset] + base`` with ``deltas[i * kW + j] = i * dH * W + j * dW``
(computed in place from ``offset``, no gather: ``_decoded``) and calls torch's own backward kernel with it. Two
cells of one window may give the same ``index - base`` only when they are the same input position (a kernel wider
than the input), so the round trip is exact and the gradients are bitwise torch's. Encoding is two passes over the
output's int64 indices and decoding five, where the alternative that keeps no indices at all (recompute the pool in
backward) runs the whole pool again, a window's worth of reads per output element. The tables are a few small ops
per call, never cached (a tracker or a fake-tensor mode sees them as any op's). Double backward works (the backward
is torch's differentiable op). Under torch.compile and torch.func, with grad off or with an input that needs no
gradient, the pool is torch's own.
"""

from __future__ import annotations

from typing import Any, TypeGuard

import torch
from torch import nn

from ..guards import plain_apply, plain_only

__all__ = ["LIMITS", "MaxPool2d", "compactable", "max_pool2d", "offset_dtype"]

LIMITS = (
    "the window's argmax is kept as its cell in the window (one byte up to 256 cells) and decoded in backward "
    "(bitwise); double backward exact",
    "steps aside under torch.compile and torch.func",
)
"""What convert's report says about a compact max pool (``Change.limits``)."""

_aten = torch.ops.aten


def _dtype(cells: int) -> torch.dtype:
    return torch.uint8 if cells <= 256 else torch.int16 if cells <= 2 ** 15 else torch.int32


def _two(value: Any, name: str = "kernel_size") -> tuple[int, int]:
    """A pooling argument as torch reads it: an int or a one-element sequence for both dimensions, or two; anything
    else raises torch's error (three elements ran as the first two, 2.5 as 2, until 2026-12-03: an adversarial
    pass)."""
    items = list(value) if isinstance(value, (tuple, list, torch.Size)) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, torch.SymInt)) and not hasattr(item, "__index__"):
            raise TypeError(f"max_pool2d(): argument '{name}' must be tuple of ints, not {type(item).__name__}")
    if len(items) not in (1, 2):
        raise RuntimeError(f"max_pool2d: {name} must either be a single int, or a tuple of two ints")
    return int(items[0]), int(items[-1])


def offset_dtype(module: nn.MaxPool2d) -> torch.dtype:
    """The dtype of the offsets ``module`` keeps once compact: uint8 for windows up to 256 cells."""
    kernel = _two(module.kernel_size)
    return _dtype(kernel[0] * kernel[1])


def _grid(rows: int, cols: int, row_step: int, col_step: int, width: int, start: tuple[int, int],
          device: torch.device) -> torch.Tensor:
    """``(start[0] + i * row_step) * width + start[1] + j * col_step`` for i < rows, j < cols: flat positions in a
    plane ``width`` wide."""
    # three ops (two aranges and a broadcast add: integers, exact), not seven: they run at every call, forward and
    # backward, and on a GPU each is a kernel launch
    r = torch.arange(start[0] * width, (start[0] + rows * row_step) * width, row_step * width, device=device)
    c = torch.arange(start[1], start[1] + cols * col_step, col_step, device=device)
    return r.view(-1, 1) + c.view(1, -1)


def _tables(in_hw: tuple[int, int], out_hw: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
            padding: tuple[int, int], dilation: tuple[int, int],
            device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, deltas) of NOTE [ compact max-pool indices ] for one geometry: built on the device at each call (a few
    small ops, no host copy), never cached, so a tracker or fake-tensor mode sees them as any op's."""
    width = in_hw[1]
    base = _grid(*out_hw, *stride, width, (-padding[0], -padding[1]), device)
    return base, _grid(*kernel, *dilation, width, (0, 0), device).flatten()


def _inverse(deltas: torch.Tensor, kernel: tuple[int, int], dilation: tuple[int, int], width: int) -> torch.Tensor:
    """``inverse[deltas[k]] = k``: the window cell of ``index - base`` (NOTE [ compact max-pool indices ])."""
    dtype = _dtype(deltas.numel())
    inverse = torch.zeros(kernel[0] * dilation[0] * width + kernel[1] * dilation[1], dtype=dtype, device=deltas.device)
    inverse[deltas] = torch.arange(deltas.numel(), dtype=dtype, device=deltas.device)
    return inverse


def _decoded(offsets: torch.Tensor, in_hw: tuple[int, int], out_hw: tuple[int, int], kernel: tuple[int, int],
             stride: tuple[int, int], padding: tuple[int, int], dilation: tuple[int, int],
             device: torch.device) -> torch.Tensor:
    """torch's int64 indices of the window cells ``offsets`` (``k = i * kW + j``): ``deltas[k] + base`` computed as
    ``k * dW + (k // kW) * (dH * W - kW * dW) + base`` in place in one int64 tensor, the only temporary
    ``k // kW`` in the offsets' dtype. A gather from ``deltas`` (an int32 copy of the offsets, the gathered int64
    tensor and a second one for ``+ base``) put 2.5 int64 tensors beside torch's one, and raised the step's peak by
    18 % where the pool's backward was the peak (found by an adversarial pass on 2026-12-03)."""
    base = _grid(*out_hw, *stride, in_hw[1], (-padding[0], -padding[1]), device)
    index = offsets.to(torch.int64).mul_(dilation[1])
    index.add_(torch.div(offsets, kernel[1], rounding_mode="floor"),
               alpha=dilation[0] * in_hw[1] - kernel[1] * dilation[1])
    return index.add_(base)


class _CompactMaxPool2d(torch.autograd.Function):
    """torch's max_pool2d_with_indices forward and backward; the indices kept as window offsets in between."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
                padding: tuple[int, int], dilation: tuple[int, int], ceil_mode: bool) -> torch.Tensor:
        out, index = _aten.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
        geometry = ((x.shape[-2], x.shape[-1]), (out.shape[-2], out.shape[-1]), kernel, stride, padding, dilation,
                    x.device)
        base, deltas = _tables(*geometry)
        # in place: torch's index is this call's own, and a second int64 tensor beside it raised the forward's peak
        offsets = torch.take(_inverse(deltas, kernel, dilation, x.shape[-1]), index.sub_(base))
        del index
        ctx.save_for_backward(x, offsets)
        ctx.geometry, ctx.ceil_mode = geometry, ceil_mode
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, offsets = ctx.saved_tensors
        _, _, kernel, stride, padding, dilation, _ = ctx.geometry
        index = _decoded(offsets, *ctx.geometry)
        grad_x = _aten.max_pool2d_with_indices_backward(grad, x, kernel, stride, padding, dilation, ctx.ceil_mode,
                                                        index)
        return grad_x, None, None, None, None, None


_apply_compact = plain_apply(_CompactMaxPool2d)  # (max_pool2d has found plain_only false)


def max_pool2d(x: torch.Tensor, kernel_size: Any, stride: Any = None, padding: Any = 0, dilation: Any = 1,
               ceil_mode: bool = False, return_indices: bool = False) -> Any:
    """``torch.nn.functional.max_pool2d`` keeping one byte per output element for backward instead of eight (NOTE
    [ compact max-pool indices ]); the same output and bitwise the same gradients. Torch's own op where nothing is
    kept (grad off, ``x`` needs no gradient), with ``return_indices=True`` (the caller keeps the indices then) and
    under torch.compile and torch.func."""
    if return_indices or plain_only() or not (torch.is_grad_enabled() and x.requires_grad):
        return nn.functional.max_pool2d(x, kernel_size, stride, padding, dilation, ceil_mode=ceil_mode,
                                        return_indices=return_indices)  # type: ignore[call-overload]
    if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0):  # torch's default
        stride = kernel_size
    return _apply_compact(x, _two(kernel_size), _two(stride, "stride"), _two(padding, "padding"),
                          _two(dilation, "dilation"), bool(ceil_mode))


class MaxPool2d(nn.MaxPool2d):
    """``nn.MaxPool2d`` keeping one byte per output element for backward instead of an int64 index (NOTE [ compact
    max-pool indices ]): the same output and bitwise the same gradients; torch's own forward with
    ``return_indices=True`` (the caller keeps the indices then)."""

    def forward(self, input: torch.Tensor) -> Any:
        """The pooled ``input`` (and its indices with ``return_indices=True``, by torch's forward)."""
        return max_pool2d(input, self.kernel_size, self.stride, self.padding, self.dilation, self.ceil_mode,
                          self.return_indices)


def compactable(module: nn.Module) -> TypeGuard[nn.MaxPool2d]:
    """Whether ``module`` is exactly an ``nn.MaxPool2d`` (torch's class and forward) not returning its indices: the
    pools :func:`memtrim.convert` swaps to :class:`MaxPool2d`."""
    return type(module) is nn.MaxPool2d and "forward" not in module.__dict__ and not module.return_indices

"""Transformer pieces that keep less: a norm that keeps its output, and an activation + Linear that keeps only the
pre-activation.

NOTE [ norms that keep their output ]
``nn.LayerNorm`` keeps its input (plus mean and rstd); the Linear after it keeps the norm's output. Keeping the
output instead (one tensor for both) drops the input: backward recovers ``xhat = (n - beta) / gamma``, rebuilds
``x = mean + xhat / rstd`` and calls torch's own fused ``native_layer_norm_backward`` (RMSNorm: ``xhat = n / gamma``,
``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = gamma * dn``). Features whose rebuilt ``xhat`` could be more
than ``KEEP_BOUND`` times less accurate than torch's (``|beta| / |gamma|`` large, or gamma 0; NOTE [ when a norm keeps
its input ] in _kernels.py) keep their ``xhat`` column explicitly. Parameters are the torch module's own. There is no
second derivative (a backward through the gradient raises :class:`ConvertError` naming the module); under
torch.compile, torch.func and autocast the modules run as torch's own.

NOTE [ activation + Linear keeping the pre-activation ]
In ``Linear -> GELU -> Linear`` torch keeps the GELU input ``h`` (for GELU's backward) and the GELU output ``a``
(for the second Linear's weight gradient). :class:`ActLinear` computes ``Linear(act(h))`` keeping only ``h``; its
backward recomputes ``a = act(h)`` (one cheap pointwise op) for the weight gradient. The recomputed ``a`` is
bitwise the forward's, and the backward uses torch's own kernels, so gradients are bitwise those of the pair. The
backward is written in differentiable torch ops on the kept inputs, so double backward works too. Under autocast it
runs as torch's Linear(act(h)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InvalidInputError
from ._kernels import (
    autocasting,
    keep_input_features,
    no_double_backward,
    plain_only,
    saved_tensors,
    zeros_and_ones,
)
from .functional import differentiable_grad
from .modules import owner

__all__ = ["ActLinear", "LayerNorm", "RMSNorm"]


class _NormKeepOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                normalized_shape: tuple[int, ...], eps: float, rms: bool, gamma_threshold: float,
                owner: str) -> torch.Tensor:
        nd = len(normalized_shape)
        dims = tuple(range(x.dim() - nd, x.dim()))
        if rms:
            rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
            out = x * rstd
            if weight is not None:
                out = out * weight
            mean = None
        else:
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized_shape), weight, bias, eps)
        kept = xhat_kept = None
        if weight is not None:  # NOTE [ when a norm keeps its input ] (in _kernels.py)
            kept = keep_input_features(weight, bias, None, gamma_threshold)
            if kept.numel() == 0:
                kept = None
            else:
                columns = x.reshape(*x.shape[: x.dim() - nd], -1).index_select(-1, kept)
                r = rstd.reshape(*rstd.shape[: x.dim() - nd], 1)
                xhat_kept = columns * r if mean is None else (columns - mean.reshape(r.shape)) * r
        ctx.dims, ctx.rms, ctx.owner = dims, rms, owner
        ctx.save_for_backward(out, mean, rstd, weight, bias, kept, xhat_kept)
        return out

    @staticmethod
    @no_double_backward
    def backward(ctx: Any, dn: torch.Tensor) -> tuple:
        out, mean, rstd, weight, bias, kept, xhat_kept = saved_tensors(ctx)
        dims = ctx.dims
        if weight is not None:  # xhat = (out - beta) / gamma in one pass
            inv_gamma = torch.where(weight == 0, torch.ones_like(weight), weight).reciprocal()
            offset = -bias * inv_gamma if bias is not None else torch.zeros_like(inv_gamma)
            xhat = torch.addcmul(offset, out, inv_gamma)
            if kept is not None:  # the kept features' own xhat
                xhat.view(*xhat.shape[: xhat.dim() - len(dims)], -1).index_copy_(-1, kept, xhat_kept)
        else:
            xhat = out - bias if bias is not None else out
        if not ctx.rms:
            # torch's own fused LayerNorm backward, fed xhat as the input with mean 0 and rstd 1: its weight and bias
            # gradients are then exact, and its input gradient is the true one divided by rstd (per row)
            normalized = list(dn.shape[dn.dim() - len(dims):])
            zeros, ones = zeros_and_ones(mean)
            dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward(
                dn, xhat, normalized, zeros, ones, weight, bias,
                [ctx.needs_input_grad[0], weight is not None, bias is not None],
            )
            if dx is not None:
                dx.mul_(rstd)
            return dx, dweight, dbias, None, None, None, None, None
        g = dn * weight if weight is not None else dn  # RMSNorm
        dx = rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))
        batch_dims = tuple(range(dn.dim() - len(dims)))
        dweight = (dn * xhat).sum(batch_dims) if weight is not None else None
        dbias = dn.sum(batch_dims) if bias is not None else None
        return dx, dweight, dbias, None, None, None, None, None


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that keeps its output (which the next Linear keeps anyway) instead of its input.

    Same parameters and state_dict as ``nn.LayerNorm``. See NOTE [ norms that keep their output ].
    """

    def __init__(self, *args: Any, gamma_threshold: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gamma_threshold = gamma_threshold

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.LayerNorm``'s forward, keeping the output for backward (torch's own forward where nothing needs
        a gradient, under autocast, ``torch.compile`` or ``torch.func``)."""
        if (not torch.is_grad_enabled() or plain_only() or autocasting(input)
                or not (input.requires_grad or any(p.requires_grad for p in self.parameters()))):
            return super().forward(input)
        return _NormKeepOutput.apply(input, self.weight, self.bias, tuple(self.normalized_shape), self.eps, False,
                                     self.gamma_threshold, owner(self))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that keeps its output instead of its input. See NOTE [ norms that keep their output ]."""

    def __init__(self, *args: Any, gamma_threshold: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gamma_threshold = gamma_threshold

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.RMSNorm``'s forward, keeping the output for backward (torch's own forward where nothing needs
        a gradient, under autocast, ``torch.compile`` or ``torch.func``)."""
        eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps
        if (not torch.is_grad_enabled() or plain_only() or autocasting(input)
                or not (input.requires_grad or any(p.requires_grad for p in self.parameters()))):
            return super().forward(input)
        return _NormKeepOutput.apply(input, self.weight, None, tuple(self.normalized_shape), eps, True,
                                     self.gamma_threshold, owner(self))


# activation name: (forward, backward(grad, pre-activation))
_ACT: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "gelu": (lambda h: F.gelu(h), lambda g, h: torch.ops.aten.gelu_backward(g, h)),
    "gelu_tanh": (lambda h: F.gelu(h, approximate="tanh"),
                  lambda g, h: torch.ops.aten.gelu_backward(g, h, approximate="tanh")),
    "silu": (F.silu, torch.ops.aten.silu_backward),
    "relu": (torch.relu, lambda g, h: torch.ops.aten.threshold_backward(g, h, 0)),
    "mish": (F.mish, torch.ops.aten.mish_backward),
    "hardswish": (F.hardswish, torch.ops.aten.hardswish_backward),
}


class _ActLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                activation: str, owner: str) -> torch.Tensor:
        ctx.activation, ctx.owner = activation, owner
        ctx.save_for_backward(h, weight, bias)
        return F.linear(_ACT[activation][0](h), weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        h, weight, bias = saved_tensors(ctx)
        forward, backward = _ACT[ctx.activation]
        grad_2d = grad.reshape(-1, grad.shape[-1])
        dh = dweight = dbias = None
        if ctx.needs_input_grad[0]:
            da = grad.matmul(weight)
            dh = differentiable_grad(forward, da, h) if torch.is_grad_enabled() else backward(da, h)
        if ctx.needs_input_grad[1]:
            a = forward(h)  # recomputed instead of kept
            dweight = grad_2d.t().mm(a.reshape(-1, a.shape[-1]))
        if bias is not None and ctx.needs_input_grad[2]:
            dbias = grad_2d.sum(0)
        return dh, dweight, dbias, None, None


class ActLinear(nn.Linear):
    """``Linear(act(h))`` keeping only ``h`` for backward (``act`` recomputed for the weight gradient).

    A drop-in for the second Linear of an MLP whose activation module is replaced by ``nn.Identity``: the
    parameters and state_dict keys are the Linear's. See NOTE [ activation + Linear keeping the pre-activation ].
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None, dtype: Any = None,
                 *, activation: str = "gelu") -> None:
        if activation not in _ACT:
            raise InvalidInputError(
                f"memtrim.nn.ActLinear: activation must be one of {sorted(_ACT)}, got {activation!r}."
            )
        super().__init__(in_features, out_features, bias, device, dtype)
        self.activation = activation

    @classmethod
    def from_linear(cls, linear: nn.Linear, activation: str) -> ActLinear:
        """An ActLinear sharing ``linear``'s parameters."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        if activation not in _ACT:
            raise InvalidInputError(
                f"memtrim.nn.ActLinear: activation must be one of {sorted(_ACT)}, got {activation!r}."
            )
        new.activation = activation
        return new

    def extra_repr(self) -> str:
        """The Linear's repr plus the activation it applies to its input."""
        return f"{super().extra_repr()}, activation={self.activation} (applied to the input, recomputed in backward)"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``linear(activation(input))``, keeping only ``input`` for backward (the activation is recomputed)."""
        if not torch.is_grad_enabled() or plain_only() or autocasting(input):
            return F.linear(_ACT[self.activation][0](input), self.weight, self.bias)
        return _ActLinearFunction.apply(input, self.weight, self.bias, self.activation, owner(self))

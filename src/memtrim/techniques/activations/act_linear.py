"""``Linear(act(h))`` keeping only the pre-activation ``h``: the activation is recomputed in backward.

NOTE [ activation + Linear keeping the pre-activation ]
In ``Linear -> GELU -> Linear`` torch keeps the GELU input ``h`` (for GELU's backward) and the GELU output ``a``
(for the second Linear's weight gradient). :class:`ActLinear` computes ``Linear(act(h))`` keeping only ``h``; its
backward recomputes ``a = act(h)`` (one cheap pointwise op) for the weight gradient. The recomputed ``a`` is
bitwise the forward's, and the backward uses torch's own kernels, so gradients are bitwise those of the pair. The
backward is written in differentiable torch ops on the kept inputs, so double backward works too; its second-order
gradients differentiate those ops rather than torch's own double backward of the pair, so they agree to rounding,
not bitwise. Under autocast it runs as torch's Linear(act(h)).

A module to use by hand, where the model's code applies the activation inside the Linear's call. ``memtrim.convert``
no longer fuses an activation module into the next Linear this way (the activation module then an identity): a path
its example inputs did not take, a hook added later, or the Linear replaced or wrapped after it, read the
activation's input. It leaves the activation torch's and rebuilds its output for the Linear from its node instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import InvalidInputError
from ..guards import autocasting, owner, plain_apply, plain_only, saved_tensors, saves_checked
from .functional import differentiable_grad

__all__ = ["ActLinear"]


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


_apply_act_linear = plain_apply(_ActLinearFunction)  # (ActLinear.forward has found plain_only false)


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
        # an input that needs no gradient: torch's activation keeps nothing there and its Linear the output, as here;
        # under saved-tensor hooks that check nothing (save_on_cpu) or a checkpoint's, torch's own ops (saves_checked)
        if (not torch.is_grad_enabled() or not input.requires_grad or plain_only() or autocasting(input)
                or not saves_checked()):
            return F.linear(_ACT[self.activation][0](input), self.weight, self.bias)
        return _apply_act_linear(input, self.weight, self.bias, self.activation, owner(self))

"""LayerNorm and RMSNorm that keep their output (which the next Linear keeps anyway) instead of their input.

NOTE [ norms that keep their output ]
``nn.LayerNorm`` keeps its input (plus mean and rstd); the Linear after it keeps the norm's output. Keeping the
output instead (one tensor for both) drops the input: backward recovers ``xhat = (n - beta) / gamma``, rebuilds
``x = mean + xhat / rstd`` and calls torch's own fused ``native_layer_norm_backward`` (RMSNorm: ``xhat = n / gamma``,
``dx = rstd * (g - xhat * mean(g * xhat))`` with ``g = gamma * dn``). Features whose rebuilt ``xhat`` could be more
than ``KEEP_BOUND`` times less accurate than torch's (``|beta| / |gamma|`` large, or gamma 0; NOTE [ when a norm keeps
its input ] in _kernels.py) keep their ``xhat`` column explicitly. Parameters are the torch module's own. There is no
second derivative (a backward through the gradient raises :class:`ConvertError` naming the module); under
torch.compile, torch.func and autocast, and in float16 and bfloat16 (NOTE [ norms in half precision ] in
_kernels.py), the modules run as torch's own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..guards import (
    autocasting,
    capturing,
    kept_params,
    no_double_backward,
    owner,
    plain_apply,
    plain_only,
    saved_tensors,
    saves_checked,
)
from ._kernels import HALF_PRECISION, check_taken, keep_input_features, zeros_and_ones

__all__ = ["LayerNorm", "NormKeepOutput", "RMSNorm"]


class NormKeepOutput(torch.autograd.Function):
    """A norm over the last ``len(normalized_shape)`` dimensions, keeping its output instead of its input; shared by
    :class:`LayerNorm`, :class:`RMSNorm` and convert's norms by behaviour. ``form``: ``"layer"`` (torch's
    ``native_layer_norm``), ``"rms_norm"`` (torch's ``F.rms_norm``, as ``nn.RMSNorm`` computes it) or ``"rms"`` (the
    ops ``x * rsqrt(mean(x^2) + eps) * weight`` in this order, as HF's RMSNorms compute in their dtype; with
    ``offset``, ``* (weight + offset)``: Gemma's ``1 + w``, whose sum is kept for backward as torch keeps it). The
    settings come as one tuple, ``spec``: (``normalized_shape``, ``eps``, ``form``, ``gamma_threshold``, ``owner``[,
    ``offset``]) (torch's ``apply`` walks its arguments one by one, at every call). See NOTE [ norms that keep their
    output ]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                spec: tuple[Any, ...]) -> torch.Tensor:
        """The norm's output, keeping it (and the features of ``x`` whose ``xhat`` it cannot rebuild) for backward."""
        normalized_shape, eps, form, gamma_threshold, owner, *shift = spec
        offset: float = shift[0] if shift else 0.0
        nd = len(normalized_shape)
        dims = tuple(range(x.dim() - nd, x.dim()))
        rms = form != "layer"
        # (Gemma's ``1 + w``: what the norm multiplies by, kept for the rebuild; the parameter's gradient is its own)
        gamma = weight + offset if offset and weight is not None else weight
        if form == "rms_norm":  # torch's own forward, bitwise (float32 and float64: NOTE [ norms in half precision ])
            out = torch.nn.functional.rms_norm(x, list(normalized_shape), weight, eps)
            rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
            mean = None
        elif rms:
            rstd = torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
            out = x * rstd
            if gamma is not None:
                out = out * gamma
            mean = None
        else:
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, list(normalized_shape), weight, bias, eps)
        kept = xhat_kept = read_gamma = None
        # the weights as this forward computed with them, which the rebuild reads (NOTE [ the weights a rebuild
        # reads ]): copies (Gemma's sum is one already); torch's backward reads the weight itself for dx, as below
        read_beta = None if bias is None else bias.detach().clone()
        if weight is not None and gamma is not None:  # NOTE [ when a norm keeps its input ] (in _kernels.py)
            read_gamma = gamma if offset else weight.detach().clone()
            kept = keep_input_features(weight, bias, None, gamma_threshold, offset, ctx, (read_gamma, read_beta))
            if kept.numel() == 0:
                kept = None
            else:
                columns = x.reshape(*x.shape[: x.dim() - nd], -1).index_select(-1, kept)
                r = rstd.reshape(*rstd.shape[: x.dim() - nd], 1)
                xhat_kept = (columns * r if mean is None else (columns - mean.reshape(r.shape)) * r).to(x.dtype)
        ctx.dims, ctx.rms, ctx.owner, ctx.kept_params = dims, rms, owner, kept_params(weight, bias)
        ctx.save_for_backward(out, mean, rstd, gamma, bias, read_gamma, read_beta, kept, xhat_kept)
        return out

    @staticmethod
    @no_double_backward
    def backward(ctx: Any, dn: torch.Tensor) -> tuple:
        """The gradients of input, weight and bias, from the kept output (LayerNorm: by torch's fused backward)."""
        out, mean, rstd, weight, bias, read_gamma, read_beta, kept, xhat_kept = saved_tensors(ctx)
        check_taken(ctx)  # (NOTE [ keep decisions made together ] in _kernels.py)
        dims = ctx.dims
        shifted = out - read_beta if read_beta is not None else out
        if read_gamma is not None:  # xhat = (out - beta) / gamma (a gamma of 0 makes inf or NaN: its feature is
            xhat = shifted / read_gamma  # kept, its column replaced below)
            if kept is not None:  # the kept features' own xhat
                xhat.view(*xhat.shape[: xhat.dim() - len(dims)], -1).index_copy_(-1, kept, xhat_kept)
        else:
            xhat = shifted
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
            return dx, dweight, dbias, None
        g = dn * weight if weight is not None else dn  # RMSNorm
        dx = rstd * (g - xhat * (g * xhat).mean(dims, keepdim=True))
        batch_dims = tuple(range(dn.dim() - len(dims)))
        dweight = (dn * xhat).sum(batch_dims) if weight is not None else None
        dbias = dn.sum(batch_dims) if bias is not None else None
        return dx, dweight, dbias, None


apply_norm_keep_output = plain_apply(NormKeepOutput)  # (for callers that have found plain_only false)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that keeps its output (which the next Linear keeps anyway) instead of its input.

    Same parameters and state_dict as ``nn.LayerNorm``. See NOTE [ norms that keep their output ].
    """

    memtrim_keep_decisions = True  # (NOTE [ keep decisions made together ] in _kernels.py)

    def __init__(self, *args: Any, gamma_threshold: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gamma_threshold = gamma_threshold

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.LayerNorm``'s forward, keeping the output for backward (torch's own forward where nothing needs
        a gradient, under autocast, ``torch.compile``, ``torch.func``, inside a checkpointed region or while a CUDA
        graph is captured)."""
        if (not torch.is_grad_enabled() or plain_only(in_backward=False) or not saves_checked() or autocasting(input)
                or capturing(input)  # (NOTE [ keep decisions while a CUDA graph is captured ])
                or not (input.requires_grad or any(p.requires_grad for p in self.parameters()))
                or _torchs_case(input, self.weight, self.normalized_shape)):
            return super().forward(input)
        return apply_norm_keep_output(input, self.weight, self.bias, (tuple(self.normalized_shape), self.eps,
                                                                      "layer", self.gamma_threshold, owner(self)))


def _torchs_case(input: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any) -> bool:
    """Inputs the output-keeping norms leave to torch's own module: an empty one, an unbatched one (only the
    normalized dimensions), one of another dtype than the weight (a float32 norm fed bfloat16 activations
    without autocast, which torch's kernels take and return in the input's dtype), and a float16 or bfloat16 one
    (NOTE [ norms in half precision ] in _kernels.py)."""
    return (input.numel() == 0 or input.dim() <= len(normalized_shape) or input.dtype in HALF_PRECISION
            or (weight is not None and weight.dtype != input.dtype))


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` that keeps its output instead of its input. See NOTE [ norms that keep their output ]."""

    memtrim_keep_decisions = True  # (NOTE [ keep decisions made together ] in _kernels.py)

    def __init__(self, *args: Any, gamma_threshold: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gamma_threshold = gamma_threshold

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``nn.RMSNorm``'s forward, keeping the output for backward (torch's own forward where nothing needs
        a gradient, under autocast, ``torch.compile``, ``torch.func``, inside a checkpointed region or while a CUDA
        graph is captured)."""
        if (not torch.is_grad_enabled() or plain_only(in_backward=False) or not saves_checked() or autocasting(input)
                or capturing(input)  # (NOTE [ keep decisions while a CUDA graph is captured ])
                or not (input.requires_grad or any(p.requires_grad for p in self.parameters()))
                or _torchs_case(input, self.weight, self.normalized_shape)):
            return super().forward(input)
        eps = self.eps if self.eps is not None else torch.finfo(input.dtype).eps  # (torch's, float32 and float64)
        return apply_norm_keep_output(input, self.weight, None, (tuple(self.normalized_shape), eps, "rms_norm",
                                                                 self.gamma_threshold, owner(self)))

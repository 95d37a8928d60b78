"""BatchNorm + ReLU that keeps only the BatchNorm's input: its output is recomputed wherever it is needed.

NOTE [ BatchNorm + ReLU, recomputed ]
ReLU's zeros lose the normalised value, so BatchNorm + ReLU cannot be inverted from its output (see
NOTE [ inverting BatchNorm + activation ]). The other way round works: keep the BatchNorm's input ``x`` (which
BatchNorm's backward needs anyway) and recompute the cheap pointwise ``z = relu(x * scale + shift)`` (per-channel
``scale = gamma * invstd``, ``shift = beta - mean * scale``) wherever ``z`` is needed: in ReLU's backward (its
mask) and in the next layers, which would otherwise keep ``z`` for their weight gradients.

The forward is torch's own BatchNorm (its native backward node keeps ``x`` and the statistics) and an in-place
ReLU whose output is marked as a recipe (:mod:`memtrim.techniques.recompute`, NOTE [ recipes at consumer call
sites ]): the ReLU runs in a producer scope, so its backward node keeps the recipe instead of its output, and
:func:`memtrim.convert` runs the modules in which autograd saved the output during its traced forward as consumer
scopes (:func:`memtrim.techniques.recompute.keep_recipes_in`): when an op there saves a tensor that is a
BatchNormReLU output (same storage, same version), autograd keeps the recipe instead. Unpacking rebuilds ``z`` once
per backward (BatchNorm's inference kernel, then ReLU), shared by every holder and released after the last. Every
other saved tensor passes through unchanged (and through any saved-tensor hooks active outside, so memtrim's tracker
still sees them), with autograd's in-place check repeated. The rebuilt ``z`` may differ from the forward's by
rounding, so the next layer's weight gradients are not bitwise. Measured (``benchmarks/convert_cuda_check.py``): in
float64 they agree to 1e-13 relative; in float32 on the CPU they came out equal, and on CUDA (cuDNN's BatchNorm in
the forward, convolutions in TF32 by default) they differed from the plain model's by about as much as either
differs from float64, the float32 step's own error. The rebuilt ``z`` has
no graph: a backward with create_graph=True that needs it (a later layer's saved input) raises :class:`ConvertError`
naming the module rather than return a gradient with second-order terms missing. Under torch.compile and torch.func
the module runs as torch's BatchNorm and ReLU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..guards import owner, plain_only
from ..recompute import mark_recomputable, producing
from ._kernels import native_batch_norm, per_channel
from .norm_act import batchnorm_arguments

__all__ = ["BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d"]


def _rebuild(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The ReLU output from the BatchNorm's input and the per-channel terms of its forward."""
    return torch.relu_(per_channel(x, scale, shift))


def _batchnorm_relu(bn: _BatchNormReLU, x: torch.Tensor) -> torch.Tensor:
    """torch's own BatchNorm (its backward node keeps ``x`` and the statistics, as always), then an in-place ReLU
    whose output is kept as a recipe. Autograd's nodes are the native ones: no Python in backward but the
    unpacking."""
    factor, bn_training, running_mean, running_var = batchnorm_arguments(bn, x)
    out, mean, invstd = native_batch_norm(x, bn.weight, bn.bias, running_mean, running_var, bn_training, factor,
                                           bn.eps)
    if not bn_training:
        assert running_mean is not None and running_var is not None
        mean, invstd = running_mean, torch.rsqrt(running_var + bn.eps)
    # per-channel terms computed now: a later in-place change of bias or running statistics must not reach them
    scale = invstd if bn.weight is None else invstd * bn.weight.detach()
    shift = -mean * scale if bn.bias is None else torch.addcmul(bn.bias.detach(), mean, scale, value=-1)
    with producing():  # ReLU's own saved output becomes the recipe too
        z = torch.relu_(out)
        # the recipe holds x, scale and shift, never z: z's storage dies once nobody but recipes needs it
        mark_recomputable(z, functools.partial(_rebuild, scale=scale.detach(), shift=shift.detach()), x,
                          owner=owner(bn), double_backward=False, holds=(scale, shift), tag="relu")
    return z


class _BatchNormReLU(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm`` + ReLU keeping only the BatchNorm's input. See NOTE [ BatchNorm + ReLU, recomputed ]."""

    def extra_repr(self) -> str:
        """The BatchNorm's repr plus the ReLU it applies."""
        return f"{super().extra_repr()}, activation=relu (recomputed from the input)"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``relu(batch_norm(input))``, keeping only ``input`` (torch's own ops where nothing is kept)."""
        self._check_input_dim(input)
        if not torch.is_grad_enabled() or plain_only():  # nothing kept, or compile/torch.func: torch's own ops
            factor, bn_training, running_mean, running_var = batchnorm_arguments(self, input)
            out = nn.functional.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training,
                                           factor, self.eps)
            # fused at one call of a shared ReLU (convert's batchnorm_relu_call_site): that PassThroughReLU relus
            # it there, as in the unconverted model (relu'd twice in place, autograd's check would refuse it)
            return out if getattr(self, "memtrim_relu_follows", False) else torch.relu_(out)
        return _batchnorm_relu(self, input)


class BatchNormReLU1d(_BatchNormReLU, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU2d(_BatchNormReLU, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU3d(_BatchNormReLU, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` + ReLU keeping only the BatchNorm's input."""

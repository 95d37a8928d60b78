"""BatchNorm + ReLU that keeps only the BatchNorm's input: its output is recomputed wherever it is needed.

NOTE [ BatchNorm + ReLU, recomputed ]
ReLU's zeros lose the normalised value, so BatchNorm + ReLU cannot be inverted from its output (see
NOTE [ inverting BatchNorm + activation ]). The other way round works: keep the BatchNorm's input ``x`` (which
BatchNorm's backward needs anyway) and recompute the cheap pointwise ``z = relu(x * scale + shift)`` (per-channel
``scale = gamma * invstd``, ``shift = beta - mean * scale``) wherever ``z`` is needed: in this module's backward
(ReLU's mask) and in the next layers, which would otherwise keep ``z`` for their weight gradients.

For the next layers, :func:`memtrim.convert` installs saved-tensor hooks around the forward of each module that
reads the output (found by its traced forward, :class:`_RecomputeHooks`): when an op there saves a tensor that is
a BatchNormReLU output (same storage, same version), autograd keeps a recipe instead; unpacking recomputes ``z``
once per backward, and the BatchNormReLU's own backward takes ReLU's mask from that same rebuilt tensor. Every
other saved tensor passes through unchanged (and through any saved-tensor hooks active outside, so memtrim's
tracker still sees them),
with autograd's in-place check repeated. The forward output is torch's own BatchNorm kernel followed by ReLU; the
recomputed ``z`` may differ from it by rounding, so weight gradients of the next layer agree to ~1e-6 relative
(float32), not bitwise.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ...measure._hooks import check_saved_version
from .norm_act import batchnorm_arguments

__all__ = ["BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d"]


class _Recipe:
    """How to rebuild one BatchNormReLU output: ``relu(x * scale + shift)``."""

    __slots__ = ("x", "scale", "shift", "version", "cache", "__weakref__")

    def rebuild(self) -> torch.Tensor:
        """The ReLU output, rebuilt once per backward: later layers' backward runs first and rebuilds it; the
        BatchNormReLU's own backward then takes ReLU's mask from the same tensor and lets it go."""
        if self.cache is None:
            with torch.no_grad():
                self.cache = torch.relu_(torch.addcmul(self.shift, self.x, self.scale))
        return self.cache


# storages of live BatchNormReLU outputs -> recipe (no strong reference to the outputs themselves)
_RECIPES: dict[int, tuple[weakref.ref, _Recipe]] = {}


def _register(z: torch.Tensor, recipe: _Recipe) -> None:
    storage = z.untyped_storage()
    key = id(storage)
    _RECIPES[key] = (weakref.ref(storage, lambda _, key=key: _RECIPES.pop(key, None)), recipe)


class _BatchNormReLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                momentum: float, eps: float) -> torch.Tensor:  # type: ignore[override]
        out, mean, invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        if not training:
            assert running_mean is not None and running_var is not None
            mean, invstd = running_mean.clone(), torch.rsqrt(running_var + eps)
        z = torch.relu_(out)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        scale = invstd if weight is None else invstd * weight
        shift = -mean * scale if bias is None else bias - mean * scale
        recipe = _Recipe()
        recipe.x, recipe.scale, recipe.shift = x.detach(), scale.view(shape), shift.view(shape)
        recipe.version = z._version
        recipe.cache = None
        _register(z, recipe)
        ctx.recipe = recipe
        ctx.training, ctx.eps, ctx.shape = training, eps, shape
        ctx.save_for_backward(x, weight, mean, invstd, recipe.scale, recipe.shift)
        return z

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dz: torch.Tensor) -> tuple:  # type: ignore[override]
        x, weight, mean, invstd, scale, shift = ctx.saved_tensors
        recipe = ctx.recipe
        # ReLU's mask (z > 0 exactly where y > 0): from the output the next layers' backward rebuilt, if it did
        z = recipe.cache if recipe.cache is not None else torch.addcmul(shift, x, scale)
        recipe.cache = None  # released: nothing after this needs it
        dy = torch.ops.aten.threshold_backward(dz, z, 0)
        if ctx.training:
            dx, dweight, dbias = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, mean, invstd, True, ctx.eps,
                [ctx.needs_input_grad[0], weight is not None, ctx.needs_input_grad[2]],
            )
        else:
            dims = [0] + list(range(2, x.dim()))
            xhat = (x - mean.view(ctx.shape)) * invstd.view(ctx.shape)
            dweight = (dy * xhat).sum(dims) if weight is not None else None
            dbias = dy.sum(dims) if ctx.needs_input_grad[2] else None
            dx = scale * dy
        return dx, dweight, dbias, None, None, None, None, None


class _BatchNormReLU(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm`` + ReLU keeping only the BatchNorm's input. See NOTE [ BatchNorm + ReLU, recomputed ]."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation=relu (recomputed from the input)"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        factor, bn_training, running_mean, running_var = batchnorm_arguments(self)
        if not torch.is_grad_enabled():
            return torch.relu_(nn.functional.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                                        bn_training, factor, self.eps))
        return _BatchNormReLUFunction.apply(input, self.weight, self.bias, running_mean, running_var, bn_training,
                                            factor, self.eps)


class BatchNormReLU1d(_BatchNormReLU, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU2d(_BatchNormReLU, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU3d(_BatchNormReLU, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` + ReLU keeping only the BatchNorm's input."""


class _Kept:
    """A saved tensor passed through unchanged (or through the hooks active outside the model)."""

    __slots__ = ("tensor", "version", "packed", "outer")


class _RecomputeHooks:
    """Saved-tensor hooks active during the model's forward: BatchNormReLU outputs are kept as recipes."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: Any) -> None:
        if self.depth == 0:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            torch._C._autograd._push_saved_tensors_default_hooks(*_make_hooks(outer))
        self.depth += 1

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def _make_hooks(outer: Any) -> tuple[Any, Any]:
    def pack(tensor: torch.Tensor) -> Any:
        found = _RECIPES.get(id(tensor.untyped_storage()))
        if (found is not None and found[0]() is not None and found[1].version == tensor._version
                and tensor.storage_offset() == 0 and tensor.shape == found[1].x.shape
                and tensor.stride() == found[1].x.stride()):
            return found[1]  # the whole BatchNormReLU output, unchanged: keep the recipe instead
        kept = _Kept()
        kept.version = tensor._version
        kept.outer = outer
        if outer is not None:
            kept.packed, kept.tensor = outer[0](tensor), None
        else:
            kept.packed, kept.tensor = None, tensor.detach()  # detached: no cycle through the output's grad_fn
        return kept

    def unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Recipe):
            return packed.rebuild()
        if packed.outer is not None:
            return packed.outer[1](packed.packed)
        check_saved_version(packed.tensor, packed.version, "memtrim's BatchNorm+ReLU recompute hooks")
        return packed.tensor

    return pack, unpack


def install_recompute_hooks(model: nn.Module) -> None:
    """Run ``model``'s forward under the recompute hooks (once per model)."""
    if getattr(model, "_memtrim_recompute_hooks", None) is not None:
        return
    hooks = _RecomputeHooks()
    model._memtrim_recompute_hooks = (  # type: ignore[assignment]
        model.register_forward_pre_hook(hooks.enter),
        model.register_forward_hook(hooks.exit, always_call=True),
    )

"""BatchNorm + ReLU that keeps only the BatchNorm's input: its output is recomputed wherever it is needed.

NOTE [ BatchNorm + ReLU, recomputed ]
ReLU's zeros lose the normalised value, so BatchNorm + ReLU cannot be inverted from its output (see
NOTE [ inverting BatchNorm + activation ]). The other way round works: keep the BatchNorm's input ``x`` (which
BatchNorm's backward needs anyway) and recompute the cheap pointwise ``z = relu(x * scale + shift)`` (per-channel
``scale = gamma * invstd``, ``shift = beta - mean * scale``) wherever ``z`` is needed: in ReLU's backward (its
mask) and in the next layers, which would otherwise keep ``z`` for their weight gradients.

The forward is torch's own BatchNorm (its native backward node keeps ``x`` and the statistics) and an in-place
ReLU, run under a saved-tensor hook that gives ReLU's backward node a recipe instead of its output. For the next
layers, :func:`memtrim.convert` installs saved-tensor hooks around the forward of each module in which autograd
saved the output during its traced forward (:class:`_RecomputeHooks`): when an op there saves a tensor that is a
BatchNormReLU output (same storage, same version), autograd keeps the recipe instead. Unpacking rebuilds ``z``
once per backward (BatchNorm's inference kernel, then ReLU); ReLU's backward, the last to need it, takes its mask
from that tensor and lets it go. Every other saved tensor passes through unchanged (and through any saved-tensor
hooks active outside, so memtrim's tracker still sees them), with autograd's in-place check repeated. The rebuilt
``z`` may differ from the forward's by rounding, so the next layer's weight gradients agree to ~1e-6 relative
(float32), not bitwise. The rebuilt ``z`` has no graph: a backward with create_graph=True that needs it (a later
layer's saved input) raises :class:`ConvertError` naming the module rather than return a gradient with second-order
terms missing. Under torch.compile and torch.func the module runs as torch's BatchNorm and ReLU.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ...measure._hooks import check_saved_version, hold_for_backward
from ._kernels import ConvertError, native_batch_norm, per_channel, plain_only
from .modules import owner
from .norm_act import batchnorm_arguments

__all__ = ["BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d"]


class _Recipe:
    """How to rebuild one BatchNormReLU output: ``relu(x * scale + shift)``."""

    __slots__ = ("x", "x_version", "scale", "shift", "version", "cache", "owner", "__weakref__")

    def rebuild(self) -> torch.Tensor:
        """The ReLU output, rebuilt once per backward: later layers' backward runs first and rebuilds it; ReLU's
        own backward then takes its mask from the same tensor and lets it go (:class:`_MaskUse`)."""
        if self.cache is None:
            check_saved_version(self.x, self.x_version, f"{self.owner} (the input it recomputes from)")
            # x, scale and shift are detached: nothing here is recorded, even under create_graph
            self.cache = torch.relu_(per_channel(self.x, self.scale, self.shift))
        return self.cache


class _MaskUse:
    """What ReLU's backward keeps instead of its output: the recipe (it needs only the output's sign)."""

    __slots__ = ("recipe",)


# storages of live BatchNormReLU outputs -> recipe (no strong reference to the outputs themselves)
_RECIPES: dict[int, tuple[weakref.ref, _Recipe]] = {}


def _register(z: torch.Tensor, recipe: _Recipe) -> None:
    storage = z.untyped_storage()
    key = id(storage)
    _RECIPES[key] = (weakref.ref(storage, lambda _, key=key: _RECIPES.pop(key, None)), recipe)


def _batchnorm_relu(bn: _BatchNormReLU, x: torch.Tensor) -> torch.Tensor:
    """torch's own BatchNorm (its backward node keeps ``x`` and the statistics, as always), then an in-place ReLU
    whose saved output is replaced by a recipe. Autograd's nodes are the native ones: no Python in backward but the
    unpacking."""
    factor, bn_training, running_mean, running_var = batchnorm_arguments(bn, x)
    out, mean, invstd = native_batch_norm(x, bn.weight, bn.bias, running_mean, running_var, bn_training, factor,
                                           bn.eps)
    if not bn_training:
        assert running_mean is not None and running_var is not None
        mean, invstd = running_mean, torch.rsqrt(running_var + bn.eps)
    recipe = _Recipe()
    recipe.x, recipe.x_version, recipe.owner = x.detach(), x._version, owner(bn)
    # per-channel terms computed now: a later in-place change of bias or running statistics must not reach them
    recipe.scale = invstd if bn.weight is None else invstd * bn.weight.detach()
    recipe.shift = (-mean * recipe.scale if bn.bias is None
                    else torch.addcmul(bn.bias.detach(), mean, recipe.scale, value=-1))
    recipe.cache = None
    hold_for_backward(recipe.scale, recipe)  # trackers count the per-channel terms as kept for backward
    hold_for_backward(recipe.shift, recipe)
    # the hook must not hold the output itself: autograd keeps hooks with the saved variable, which the output's
    # grad_fn holds, a cycle through C++ that the garbage collector cannot see
    where, shape = out.untyped_storage().data_ptr(), out.shape
    pack_other = _pack_for(torch._C._autograd._top_saved_tensors_default_hooks(False))  # the hooks outside

    def pack(tensor: torch.Tensor) -> Any:
        if tensor.untyped_storage().data_ptr() == where and tensor.shape == shape:
            use = _MaskUse()
            use.recipe = recipe
            return use
        return pack_other(tensor)

    torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)  # saved_tensors_hooks, without its Python
    try:
        z = torch.relu_(out)
    finally:
        torch._C._autograd._pop_saved_tensors_default_hooks()
    recipe.version = z._version
    _register(z, recipe)
    return z


class _BatchNormReLU(nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm`` + ReLU keeping only the BatchNorm's input. See NOTE [ BatchNorm + ReLU, recomputed ]."""

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation=relu (recomputed from the input)"

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not torch.is_grad_enabled() or plain_only():  # nothing kept, or compile/torch.func: torch's own ops
            factor, bn_training, running_mean, running_var = batchnorm_arguments(self, input)
            return torch.relu_(nn.functional.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                                        bn_training, factor, self.eps))
        return _batchnorm_relu(self, input)


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
        if plain_only():
            return
        if self.depth == 0:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            torch._C._autograd._push_saved_tensors_default_hooks(_pack_for(outer), _unpack)
        self.depth += 1

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if plain_only():
            return
        self.depth -= 1
        if self.depth == 0:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def _pack_for(outer: Any) -> Any:
    """The pack hook of the recompute hooks (``outer``: the saved-tensor hooks active outside, or None)."""
    global _PACK_ALONE
    if outer is None and _PACK_ALONE is not None:
        return _PACK_ALONE

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

    if outer is None:
        _PACK_ALONE = pack
    return pack


_PACK_ALONE: Any = None  # _pack_for(None), made once


def _unpack(packed: Any) -> torch.Tensor:
    """The unpack hook for everything the pack hooks here return."""
    if isinstance(packed, _MaskUse):
        z = packed.recipe.rebuild()
        packed.recipe.cache = None  # ReLU's own backward is the last use: release the rebuilt output
        return z
    if isinstance(packed, _Recipe):
        if torch.is_grad_enabled():  # backward with create_graph=True: this layer's gradient needs z's graph
            raise ConvertError(
                f"memtrim: {packed.owner} does not keep its output; a later layer gets it rebuilt, without a graph, so "
                "there is no second derivative through it. Expected a backward without create_graph=True; found "
                "create_graph=True (a gradient penalty or another double backward). To fix: leave this module out "
                "of memtrim.convert (module_filter), or use torch's BatchNorm + ReLU here."
            )
        return packed.rebuild()
    if packed.outer is not None:
        return packed.outer[1](packed.packed)
    check_saved_version(packed.tensor, packed.version, "memtrim's BatchNorm+ReLU recompute hooks")
    return packed.tensor


def install_recompute_hooks(model: nn.Module) -> None:
    """Run ``model``'s forward under the recompute hooks (once per model)."""
    if getattr(model, "_memtrim_recompute_hooks", None) is not None:
        return
    hooks = _RecomputeHooks()
    model._memtrim_recompute_hooks = (  # type: ignore[assignment]
        model.register_forward_pre_hook(hooks.enter),
        model.register_forward_hook(hooks.exit, always_call=True),
    )

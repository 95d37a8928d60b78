"""Helpers shared by the norm + activation modules: the fastest torch kernels for a per-channel affine map, a small
cache of constant tensors for torch's fused normalization kernels, the rule that decides which features keep their
normalised input (NOTE [ when a norm keeps its input ]), and the guards that make converted modules step aside or
raise a clear error where their own autograd cannot follow (torch.compile, torch.func, double backward)."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ...errors import ConvertError

__all__ = [
    "autocasting", "CACHE_SIZE", "ConvertError", "KEEP_BOUND", "inplace_error", "keep_input_features",
    "native_batch_norm",
    "no_double_backward", "per_channel", "plain_only", "saved_tensors", "zeros_and_ones",
]

native_batch_norm = torch.ops.aten.native_batch_norm.default


# ---------------------------------------------------------------------- bounded constant cache
CACHE_SIZE = 8  # shapes kept; a model sees a handful (one per sequence length in flight), not thousands
# (shape, dtype, device) -> (zeros, ones), least recently used first; never written to (the kernels only read them)
_CONSTANTS: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def zeros_and_ones(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros and ones shaped like ``like``, kept for the :data:`CACHE_SIZE` most recently used shapes."""
    key = (tuple(like.shape), like.dtype, like.device)
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = (torch.zeros_like(like), torch.ones_like(like))
        while len(_CONSTANTS) > CACHE_SIZE:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(key)
    return found


def per_channel(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``x * scale + shift`` per channel (dimension 1), by BatchNorm's inference kernel with mean 0, variance 1 and
    eps 0, whose per-channel terms are then exactly ``scale`` and ``shift``: on CPU two to three times as fast as a
    broadcast ``addcmul``, and in the input's dtype."""
    zeros, ones = zeros_and_ones(scale)
    return native_batch_norm(x, scale, shift, zeros, ones, False, 0.0, 0.0)[0]


# ---------------------------------------------------------------------- NOTE [ when a norm keeps its input ]
# A norm that keeps its output ``y = gamma * xhat + beta`` (per feature or channel) rebuilds ``xhat = (y - beta) /
# gamma`` in backward. With u the unit roundoff of the dtype (float32: 6e-8):
#
# * the forward rounds y once or twice: |dy| <= ~2u (|beta| + |gamma xhat|) (+ u |mean * invstd * gamma| for
#   BatchNorm's fused ``x * scale + shift``, which the plain path pays too);
# * inverting the activation adds a relative error of 2u for LeakyReLU; for ELU, ``y = log1p(z / alpha)`` has
#   condition number 1 / (1 + z / alpha) = e^-y, so |dy| grows by u (e^-y - 1) for y < 0;
# * dividing by gamma: |d xhat| <= |dy| / |gamma| + u |xhat|.
#
# So the rebuilt xhat carries an absolute error of about u (|xhat| + (|beta| + s) / |gamma|), with s the ELU term
# (0 for other activations), where torch's own backward computes xhat from the input with about u |xhat|. The
# gradients of a norm are linear in xhat's error (dgamma = sum(dy * xhat); dx has xhat * sum(dy * xhat) / N), and
# xhat has unit RMS in training, so the converted gradients' relative error exceeds torch's by a factor of about
# 1 + (|beta| + s) / |gamma|, per feature. A feature keeps its xhat (the input's information, only for those
# features) when that factor could pass KEEP_BOUND:
#
#     keep  <=>  not (|gamma| * KEEP_BOUND > |beta| + s)   or   |gamma| < tiny ** 0.25
#
# The second clause keeps gamma^2 (fed to torch's BatchNorm backward) and 1 / gamma normal; it and gamma == 0 are
# covered by the same comparison (``not (0 > ...)``). For ELU, s is the RMS over the channel of e^-y - 1 (y < 0):
# the gradient error aggregates in norm, and a max would keep nearly every ELU channel for one tail value. The
# decision is a per-feature boolean tensor; gathering the kept features needs their count (one small host sync on
# an accelerator, none on CPU). Under torch.compile and torch.func the modules run as torch's own ops instead
# (:func:`plain_only`), so the compiler sees no data-dependent shape.
KEEP_BOUND = 8.0  # the converted error stays within ~9x torch's at the bound; tests hold it to 10x against float64


def keep_input_features(gamma: torch.Tensor, beta: torch.Tensor | None, extra: torch.Tensor | None = None,
                        floor: float = 0.0) -> torch.Tensor:
    """Indices (flattened) of the features whose ``xhat`` cannot be rebuilt from the output to within KEEP_BOUND
    times torch's own error (NOTE [ when a norm keeps its input ] in this file). ``extra``: the ELU term s, per
    feature; ``floor``: a user's ``gamma_threshold``, below which features keep their ``xhat`` anyway."""
    g = gamma.detach().abs()
    limit = beta.detach().abs() if beta is not None else torch.zeros_like(g)
    if extra is not None:
        limit = limit + extra.to(limit.dtype)
    keep = ~(g * KEEP_BOUND > limit) | (g < max(torch.finfo(g.dtype).tiny ** 0.25, floor))
    return keep.flatten().nonzero().flatten()


# ---------------------------------------------------------------------- where the modules step aside
def _functorch_active() -> bool:
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return bool(active()) if active is not None else False


def plain_only() -> bool:
    """True under ``torch.compile`` (saved-tensor hooks and data-dependent shapes do not trace; the compiler plans its
    own memory) and under ``torch.func`` transforms (a custom autograd.Function needs rules they do not have): the
    modules then run as torch's own ops, exactly the unconverted model."""
    return torch.compiler.is_compiling() or _functorch_active()


def autocasting(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type. The rebuilt norms and ActLinear then run as torch's own ops:
    autocast picks each op's dtype (LayerNorm in float32, Linear in the low precision), and an output kept in bfloat16
    would rebuild xhat with bfloat16's rounding where torch's backward reads the input in float32."""
    return torch.is_autocast_enabled(x.device.type)


# ---------------------------------------------------------------------- clear errors instead of torch's
def inplace_error(owner: str, error: RuntimeError) -> BaseException:
    """The error for an in-place change of a tensor ``owner`` keeps (torch's message otherwise names only a node)."""
    if "modified by an inplace operation" not in str(error):
        return error
    return ConvertError(
        f"memtrim: {owner} keeps its output for backward (that is how it saves memory), and that output was changed "
        f"in place after the forward. Expected it unchanged until backward; found: {error} To fix: clone the output "
        "before changing it in place, or leave this module out of memtrim.convert (module_filter, or pass "
        "example_inputs so convert sees the change and skips it)."
    )


def saved_tensors(ctx: Any) -> tuple[Any, ...]:
    """``ctx.saved_tensors``, with autograd's in-place error turned into one that names ``ctx.owner``."""
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        raise inplace_error(ctx.owner, e) from e


class _Refuse(torch.autograd.Function):
    """Identity in forward; its backward (a second derivative through a rebuilt norm) raises a ConvertError."""

    @staticmethod
    def forward(ctx: Any, message: str, n_anchors: int, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[n_anchors:])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ConvertError(ctx.message)


def no_double_backward(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """Like ``torch.autograd.function.once_differentiable``, but differentiating the result raises a ConvertError
    naming the module (``ctx.owner``), and does so whenever create_graph is on and anything the gradients depend on
    (incoming gradients or the inputs and parameters kept in ctx) requires grad."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> tuple:
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outputs
        anchors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors:
            return outputs
        message = (f"memtrim: {ctx.owner} rebuilds its input from its output in backward, so it has no second "
                   "derivative (double backward: create_graph=True followed by a backward through the gradient, "
                   "as in a gradient penalty). Expected a single backward; found a backward through its gradient. "
                   "To fix: leave this module out of memtrim.convert (module_filter), or use torch's module here.")
        present = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor)]
        wrapped = _Refuse.apply(message, len(anchors), *anchors, *[outputs[i] for i in present])
        result = list(outputs)
        for i, t in zip(present, wrapped if isinstance(wrapped, tuple) else (wrapped,)):
            result[i] = t
        return tuple(result)

    return wrapper

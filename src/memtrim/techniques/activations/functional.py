"""Activations whose backward keeps the least: the output, a 1-bit mask, or (only where unavoidable) the input.

NOTE [ what each activation keeps ]
* Output (``save="output"``, the default where the derivative is a function of the output): relu, leaky_relu
  (slope >= 0), hardtanh, relu6, elu / celu (alpha > 0), selu, sigmoid, tanh, hardsigmoid, and softplus where its
  threshold makes the output determine the gradient (:func:`softplus_keeps_output`; else its input). These can
  run truly in place (``inplace=True``): the caller's tensor becomes the output and is the only thing kept.
  When the next layer keeps that output anyway (a Linear does), this costs nothing extra.
* Mask (``save="mask"``): relu, leaky_relu, hardtanh, relu6, hardsigmoid need only where the input was in their
  linear region: one bit per element, packed 8 to a byte (1/32 of a float32 output). Worth it when nothing else
  keeps the output (e.g. the next op is an addition or a dropout; not a pooling: torch's max and average pools,
  and memtrim's max pool, keep their input, so the mask came on top, as an adversarial pass measured).
* Input: silu, gelu, mish, hardswish need the input; they keep it and recompute the rest in backward, as torch's
  out-of-place versions do. ``inplace=True`` keeps a copy of the input (as torch's ``silu_`` does): in place
  saves only the output buffer, never activation memory, for these.

Backward formulas call the same aten kernels torch uses (``threshold_backward``, ``elu_backward(is_result=
True)``, ...), so gradients are bitwise those of torch's in-place variants; where torch's out-of-place variant
differentiates from the input instead (elu, softplus), results agree to rounding. Hardsigmoid's gradient from its
output is torch's, bitwise, except at one input (the largest float below 3: its output rounds to 1).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ...errors import InvalidInputError
from ..guards import batched, fx_tracing, plain_only, saved_tensors

__all__ = [
    "celu", "elu", "gelu", "hardsigmoid", "hardswish", "hardtanh", "leaky_relu", "mish", "relu", "relu6", "selu",
    "sigmoid", "silu", "softplus", "tanh", "pack_mask", "unpack_mask", "softplus_keeps_output",
]

_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_ONE_SIXTH = float(torch.tensor(1 / 6, dtype=torch.float32))  # torch's hardsigmoid backward: 1.0f / 6.0f in every dtype


# ---------------------------------------------------------------------- bit-packed masks
def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a bool tensor into uint8, 8 elements per byte (little-endian bit order).

    Transient memory: the bool mask itself (1 byte per element) plus two eighths of it.
    """
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    bits = flat.view(torch.uint8).view(-1, 8)
    packed = bits[:, 0].clone()
    for i in range(1, 8):
        packed |= bits[:, i] << i
    return packed


def unpack_mask(packed: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Inverse of :func:`pack_mask`."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[: math.prod(shape)].view(shape).bool()


# ---------------------------------------------------------------------- the rules, one per activation
class _Rule:
    """How one activation computes, and what its backward needs."""

    keeps = "output"  # or "input"
    mask_ok = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(self.forward(x))

    def grad(self, grad: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def mask(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def input_mask(self, x: torch.Tensor) -> torch.Tensor | None:
        """The mask from the input, where the output cannot always give it (None: :meth:`mask` of the output)."""
        return None

    def grad_from_mask(self, grad: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    backward_follows_input = False  # whether torch's backward lays the input gradient out as the input (relu's)
    second_derivative_in_output = False  # whether torch's out-of-place backward is differentiated in the output
    grad_is_torchs_op = True  # grad() is torch's own backward op (its layout is torch's); False: memtrim's formula


class _ReLU(_Rule):
    mask_ok = True
    backward_follows_input = True
    second_derivative_in_output = True

    def forward(self, x):
        return torch.relu(x)

    def forward_(self, x):
        return torch.relu_(x)

    def grad(self, grad, y):
        return torch.ops.aten.threshold_backward(grad, y, 0)

    def mask(self, y):
        return ~(y <= 0)  # torch's threshold_backward zeroes where y <= 0: a NaN passes its gradient

    def grad_from_mask(self, grad, mask):
        return torch.where(mask, grad, grad.new_zeros(()))


class _LeakyReLU(_Rule):
    mask_ok = True
    backward_follows_input = True

    def __init__(self, slope: float) -> None:
        self.slope = slope

    def forward(self, x):
        return torch.nn.functional.leaky_relu(x, self.slope)

    def forward_(self, x):
        return torch.nn.functional.leaky_relu_(x, self.slope)

    def grad(self, grad, y):
        return torch.ops.aten.leaky_relu_backward(grad, y, self.slope, True)

    def mask(self, y):
        return y > 0

    def grad_from_mask(self, grad, mask):
        return torch.where(mask, grad, grad * self.slope)


class _Hardtanh(_Rule):
    mask_ok = True

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high

    def forward(self, x):
        return torch.nn.functional.hardtanh(x, self.low, self.high)

    def forward_(self, x):
        return torch.nn.functional.hardtanh_(x, self.low, self.high)

    def grad(self, grad, y):
        # low < y < high exactly where low < x < high: the same mask torch computes from the input
        return torch.ops.aten.hardtanh_backward(grad, y, self.low, self.high)

    def mask(self, y):
        # a NaN gives 0, as torch's vectorized CPU hardtanh_backward (its scalar tail, under 16 float32 elements,
        # passes the gradient: torch disagrees with itself there)
        return (y > self.low) & (y < self.high)

    def grad_from_mask(self, grad, mask):
        return torch.where(mask, grad, grad.new_zeros(()))


# NOTE [ ELU in half ]
# Rebuilding ELU's derivative from its output, alpha * exp(x) = y + alpha, cancels as y nears -alpha: its relative
# error grows as exp(-x) times the rounding unit. In bfloat16 and float16 y rounds to -alpha from x of about -5.5 on
# (SELU's to a constant above it), and the gradient there was lost (0) or inflated (79,000x at x = -20); so in half
# precision (bfloat16 parameters, autocast) elu, celu and selu run as torch's ops, keeping their input. In float32
# the error is larger than torch's too where inputs are far below 0 (54x torch's relative error in an adversarial
# pass's net: README), not fixed.
class _ELU(_Rule):
    """elu, celu and selu: y = scale * (x if x > 0 else alpha * (exp(x * input_scale) - 1))."""

    def __init__(self, alpha: float, scale: float = 1.0, input_scale: float = 1.0) -> None:
        self.alpha, self.scale, self.input_scale = alpha, scale, input_scale

    def forward(self, x):
        return torch.ops.aten.elu(x, self.alpha, self.scale, self.input_scale)

    def forward_(self, x):
        return torch.ops.aten.elu_(x, self.alpha, self.scale, self.input_scale)

    def grad(self, grad, y):
        return torch.ops.aten.elu_backward(grad, self.alpha, self.scale, self.input_scale, True, y)


class _OutputKernels(_Rule):
    """An activation whose torch kernels already differentiate from the output (sigmoid, tanh)."""

    def __init__(self, forward: Any, forward_: Any, backward: Any) -> None:
        self._forward, self._forward_, self._backward = forward, forward_, backward

    def forward(self, x):
        return self._forward(x)

    def forward_(self, x):
        return self._forward_(x)

    def grad(self, grad, y):
        return self._backward(grad, y)


def _Sigmoid() -> _Rule:  # noqa: N802 - reads like the other rule classes at the call site
    return _OutputKernels(torch.sigmoid, torch.sigmoid_, torch.ops.aten.sigmoid_backward)


def _Tanh() -> _Rule:  # noqa: N802
    return _OutputKernels(torch.tanh, torch.tanh_, torch.ops.aten.tanh_backward)


class _Hardsigmoid(_Rule):
    mask_ok = True
    grad_is_torchs_op = False

    def forward(self, x):
        return torch.nn.functional.hardsigmoid(x)

    def forward_(self, x):
        return torch.nn.functional.hardsigmoid(x, inplace=True)

    def mask(self, y):
        # -3 < x < 3 but for one input: y = min(max(x + 3, 0), 6) / 6, and x + 3 rounds to 6 for the largest float
        # below 3 (a tie, to even; float32 and float64), where torch's gradient is grad/6 and this one 0
        return (y > 0) & (y < 1)

    def input_mask(self, x):
        return (x > -3) & (x < 3)  # torch's own test

    def grad(self, grad, y):
        return self.grad_from_mask(grad, self.mask(y))

    def grad_from_mask(self, grad, mask):
        return torch.where(mask, grad * _ONE_SIXTH, grad.new_zeros(()))


class _Softplus(_Rule):
    """softplus from its output, used only where that is exact to rounding (:func:`softplus_keeps_output`)."""

    def __init__(self, beta: float, threshold: float) -> None:
        self.beta, self.threshold = beta, threshold

    def forward(self, x):
        return torch.nn.functional.softplus(x, self.beta, self.threshold)

    def grad(self, grad, y):
        # d/dx log(1 + exp(beta x)) / beta = sigmoid(beta x) = 1 - exp(-beta y); 1 above the threshold (y == x)
        linear = y * self.beta > self.threshold
        return torch.where(linear, grad, grad * -torch.expm1(-self.beta * y))


def softplus_keeps_output(threshold: float, dtype: torch.dtype) -> bool:
    """Whether softplus's output determines its gradient in ``dtype``.

    torch switches to the identity where ``beta * x > threshold``; just below, ``softplus(x) = x + log1p(exp(-beta
    x)) / beta`` lies above ``threshold / beta`` too, so an output there could come from either side: the two
    gradients, 1 and ``sigmoid(beta x)``, differ by up to ``exp(-threshold)``. That difference vanishes in rounding
    (1 - d rounds to 1 for d < eps / 4) only for a large threshold: float32 from 17.3 (torch's default 20 is fine),
    float64 from 37.4. Otherwise the input is kept, as torch does. So it is in float16, whose output is subnormal
    from ``beta x`` below about -9.7 (its smallest normal is 6.1e-5): the few bits left gave ``sigmoid(beta x)`` up to
    33 % off torch's gradient there (found by an adversarial pass; bfloat16 and float32 reach subnormals only below
    -87, where the gradient is below 1e-38).
    """
    return dtype != torch.float16 and math.exp(-threshold) < torch.finfo(dtype).eps / 4


class _InputRule(_Rule):
    keeps = "input"

    def __init__(self, forward: Any, backward: Any) -> None:
        self._forward, self._backward = forward, backward

    def forward(self, x):
        return self._forward(x)

    def forward_(self, x):
        # torch's own ops (under torch.compile, torch.func, fx, or with nothing kept): out of place on a copy, then
        # written back, so that what the op saves for backward is not the tensor the write changes
        return x.copy_(self._forward(x.clone() if torch.is_grad_enabled() else x))

    def grad(self, grad, x):
        if torch.is_grad_enabled():  # create_graph=True: some torch *_backward ops have no derivative of their own
            return differentiable_grad(self._forward, grad, x)
        return self._backward(grad, x)


def differentiable_grad(forward: Any, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad * forward'(x)`` as a differentiable graph (for a backward with create_graph=True): torch's autograd of
    ``forward`` itself, which is what the unconverted module's double backward uses.

    The gradient is taken with respect to an alias of ``x``, not ``x`` itself: ``torch.autograd.grad`` with respect
    to ``x`` would run the hooks the user registered on ``x`` (``x.register_hook``) on this inner gradient, and again
    on ``x``'s whole gradient in the outer backward: a hook that scales the gradient would scale it twice."""
    with torch.enable_grad():
        leaf = x.view_as(x) if x.requires_grad else x.detach().requires_grad_()
        (dx,) = torch.autograd.grad(forward(leaf), leaf, grad, create_graph=True)
    return dx


# ---------------------------------------------------------------------- the autograd Functions
def _run(ctx: Any, x: torch.Tensor, rule: _Rule, inplace: bool) -> torch.Tensor:
    """The activation's forward, in place (the caller's tensor becomes the output) or not."""
    ctx.rule = rule
    if not inplace:
        return rule.forward(x)
    ctx.mark_dirty(x)
    return rule.forward_(x)


# The backward formulas are torch ops with derivatives of their own (threshold_backward, elu_backward, ...), applied
# to the kept tensor: under create_graph=True autograd differentiates them, through the kept output's own graph, as it
# does for torch's in-place activations. So double backward works (a mask's second derivative is 0, as ReLU's).
class _KeepOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rule: _Rule, inplace: bool, owner: str) -> torch.Tensor:
        ctx.owner = owner
        y = _run(ctx, x, rule, inplace)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (y,) = saved_tensors(ctx)
        result = ctx.rule.grad(grad, y)
        if not ctx.rule.grad_is_torchs_op:  # (memtrim's formula: laid out as torch's backward would)
            result = _in_torchs_layout(result, ctx.rule, grad, y.stride())
        return result, None, None, None


def _in_torchs_layout(result: torch.Tensor, rule: _Rule, grad: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``result`` (the input gradient) laid out as torch's own CPU backward of the activation lays it out, where the
    forward's input (laid out as ``stride``) is dense: relu's and leaky_relu's follow the input, hardtanh's and
    hardsigmoid's a dense incoming gradient (checked against torch's kernels; their meta kernels say otherwise for
    the last two), and all of them the input where the gradient is expanded (the backward of a sum). A layout other
    than torch's makes the convolution before sum its weight gradient in another order. An input in another layout
    (a strided view) is left as computed."""
    if not _dense_strides(grad.shape, stride):
        return result
    # an expanded gradient (the backward of a sum) has no layout of its own: torch's kernels follow the input then
    target = stride if rule.backward_follows_input or not _dense(grad) else grad.stride()
    if result.stride() == target:
        return result
    return torch.empty_strided(result.shape, target, dtype=result.dtype, device=result.device).copy_(result)


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _dense_strides(shape: torch.Size, stride: tuple[int, ...]) -> bool:
    """Whether ``stride`` is the contiguous or (4-D) channels_last layout of ``shape``, as ``is_contiguous`` says
    (from the numbers: a probe tensor would count in a meta-device run's tracker)."""
    if math.prod(shape) == 0:
        return True
    orders = [range(len(shape) - 1, -1, -1)] + ([(1, 3, 2, 0)] if len(shape) == 4 else [])
    return any(_dense_in(shape, stride, order) for order in orders)


def _dense_in(shape: torch.Size, stride: tuple[int, ...], order: Any) -> bool:
    """Whether ``stride`` lays ``shape`` out densely, dimension ``order[0]`` fastest (size-1 dimensions any)."""
    expected = 1
    for dim in order:
        if shape[dim] != 1 and stride[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def _laid_out_as(mask: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``mask`` (contiguous, unpacked) in ``grad``'s memory layout: ``torch.where(mask, grad, ...)`` then lays its
    result out as torch's own backward of a channels_last activation does (an output laid out otherwise makes the
    convolution before it round its weight gradient differently)."""
    if grad.is_contiguous():
        return mask
    return torch.empty_like(grad, dtype=torch.bool).copy_(mask)


# NOTE [ a mask's second derivative reaches the input ]
# torch's backward of relu (threshold_backward(grad, y)) is differentiable in y too, with derivative 0: under
# create_graph=True the outer backward sends zeros back through the activation, so the parameters before it get a
# zero gradient where they get no other (a step that trains on a gradient penalty alone, StyleGAN2's lazy R1). A
# zero gradient is not no gradient: AdamW still decays the parameter and momentum still moves it. A mask has no
# graph, so the backward ties its result (:func:`_tie`) to an *anchor*: an empty tensor standing where torch sends
# its zeros. That is the activation's output where torch's formula differentiates in the output (relu, and every
# in-place activation): an empty second output of the Function (saved as an output: one kept on ctx would make a
# reference cycle through the node, never freed without a backward). Else it is the input, through
# :class:`_Anchor`, made after the Function's node (the engine runs the node made last first). So the zeros
# arrive where torch's arrive, in torch's order, laid out as torch's (zeros_like of the gradient reaching the
# backward's result), and the gradients add as torch's do. The tie is tied again at each higher order (a loss on
# a double-vjp JVP). Where torch's layout cannot be followed the zeros are contiguous: an in-place write into a
# view (autograd allows such a Function one output, so the anchor is the input, made before the write) and
# batched gradients (``is_grads_batched=True``, vmap: plain differentiable ops tie there).
def _zeros_like_stride(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides of ``torch.zeros_like(t)``: ``t``'s where it is non-overlapping and dense, else None
    (contiguous), computed without making a tensor (a meta-device run's tracker would count it)."""
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return None
        expected *= size
    return t.stride()


def _zeros(shape: torch.Size, stride: tuple[int, ...] | None, dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    if stride is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).zero_()


class _Anchor(torch.autograd.Function):
    """An empty tensor whose backward is zeros shaped as ``t``, laid out as the gradient :class:`_Tie` saw."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor) -> torch.Tensor:
        # (t's shape, not t: this node lives as long as the activation's, and must not keep t's memory)
        ctx.shape, ctx.dtype, ctx.zeros_stride = t.shape, t.dtype, None
        return t.new_empty(0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return _zeros(ctx.shape, ctx.zeros_stride, ctx.dtype, grad.device)


class _Tie(torch.autograd.Function):
    """``result`` itself, differentiable in ``anchor`` with derivative 0: its backward passes the gradient on and
    sends the anchor zeros laid out as that gradient (torch's zeros_like(grad) in a backward-of-backward)."""

    @staticmethod
    def forward(ctx: Any, result: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(anchor)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (anchor,) = ctx.saved_tensors
        anchor.grad_fn.zeros_stride = _zeros_like_stride(grad)  # (an _Anchor's, or the activation's own node)
        if torch.is_grad_enabled():  # a higher order: the zeros reach the anchor at that order too
            grad = _tie(grad, anchor)
        return grad, torch.zeros(0, dtype=anchor.dtype, device=anchor.device)


def _tie(result: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
    """``result``, differentiable (with derivative 0) in the anchor: NOTE [ a mask's second derivative reaches the
    input ]. Batched (vmap), with plain ops (+0 subtracted: a -0 stays -0), the zeros contiguous."""
    if batched(result):
        return result - anchor.sum()
    return _Tie.apply(result, anchor)


class _KeepMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rule: _Rule, inplace: bool, owner: str,
                anchor: list[torch.Tensor]) -> Any:
        # the output, and an empty second output where the output is the anchor; ``anchor`` (a list: autograd does
        # not take it for an input) holds the input's anchor otherwise, made before this node (an in-place write into
        # a view: one output only) or appended after it: NOTE [ a mask's second derivative reaches the input ]
        ctx.owner, ctx.anchor, ctx.zeros_stride = owner, anchor, None
        ctx.set_materialize_grads(False)  # (the tie's gradient tells a backward-of-backward pass apart)
        mask = rule.input_mask(x)  # before an in-place forward overwrites x
        y = _run(ctx, x, rule, inplace)
        ctx.shape, ctx.stride, ctx.dtype = y.shape, y.stride(), y.dtype  # (y is laid out as x)
        packed = pack_mask(rule.mask(y) if mask is None else mask)
        if anchor:
            ctx.save_for_backward(packed)
            return y
        tie = x.new_empty(0)
        ctx.save_for_backward(packed, tie)
        return y, tie

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None,
                 tie_grad: torch.Tensor | None = None) -> tuple[torch.Tensor | None, None, None, None, None]:
        packed, *tie = saved_tensors(ctx)
        if tie_grad is not None:  # a backward of a create_graph=True backward: torch's zeros, then the gradient
            zeros = _zeros(ctx.shape, ctx.zeros_stride, ctx.dtype, tie_grad.device)
            grad = zeros if grad is None else torch.add(zeros, grad)
        if grad is None:  # (no gradient reached the output: none to pass on)
            return None, None, None, None, None
        if batched(grad):  # (layouts are not torch's to follow under vmap)
            result = ctx.rule.grad_from_mask(grad, unpack_mask(packed, ctx.shape))
        elif torch.is_grad_enabled():  # create_graph=True: laid out as torch's at every order
            result = _MaskedGrad.apply(grad, packed, ctx.rule, ctx.shape, ctx.stride)
        else:
            result = _masked_grad(grad, packed, ctx.rule, ctx.shape, ctx.stride)
        if torch.is_grad_enabled():  # create_graph=True
            result = _tie(result, ctx.anchor[0] if ctx.anchor else tie[0])
        return result, None, None, None, None


def _masked_grad(grad: torch.Tensor, packed: torch.Tensor, rule: _Rule, shape: torch.Size,
                 stride: tuple[int, ...]) -> torch.Tensor:
    """The input gradient from the mask, laid out as torch's backward of the activation lays it out."""
    result = rule.grad_from_mask(grad, _laid_out_as(unpack_mask(packed, shape), grad))
    return _in_torchs_layout(result, rule, grad, stride)


class _MaskedGrad(torch.autograd.Function):
    """:func:`_masked_grad` under create_graph=True: linear in ``grad`` and its own adjoint, so its backward is itself
    (torch's backward-of-backward of relu is threshold_backward(gg, y), laid out by the same rule)."""

    @staticmethod
    def forward(ctx: Any, grad: torch.Tensor, packed: torch.Tensor, rule: _Rule, shape: torch.Size,
                stride: tuple[int, ...]) -> torch.Tensor:
        ctx.rule, ctx.shape, ctx.stride = rule, shape, stride
        ctx.save_for_backward(packed)
        return _masked_grad(grad, packed, rule, shape, stride)

    @staticmethod
    def backward(ctx: Any, gg: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (packed,) = ctx.saved_tensors
        if batched(gg):  # (as _KeepMask's: no layout under vmap)
            result = ctx.rule.grad_from_mask(gg, unpack_mask(packed, ctx.shape))
        elif torch.is_grad_enabled():  # a higher order
            result = _MaskedGrad.apply(gg, packed, ctx.rule, ctx.shape, ctx.stride)
        else:
            result = _masked_grad(gg, packed, ctx.rule, ctx.shape, ctx.stride)
        return result, None, None, None, None


class _KeepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, copy: torch.Tensor | None, rule: _Rule, inplace: bool,
                owner: str) -> torch.Tensor:
        ctx.rule, ctx.owner = rule, owner
        if inplace:
            # the input is about to be overwritten and the backward needs it: ``copy``, cloned by the caller with
            # grad on (as torch's own in-place ops clone it), so that a second derivative reaches x through it
            assert copy is not None
            ctx.save_for_backward(copy)
            ctx.mark_dirty(x)
            return x.copy_(rule.forward(x))
        ctx.save_for_backward(x)
        return rule.forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (x,) = saved_tensors(ctx)
        return ctx.rule.grad(grad, x), None, None, None, None


def _apply(name: str, x: torch.Tensor, rule: _Rule, inplace: bool, save: str, owner: str | None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) and not fx_tracing():  # (torch.fx traces with proxies)
        raise InvalidInputError(f"memtrim.functional.{name}: input must be a tensor, got {type(x).__name__}.")
    if save not in ("output", "mask"):
        raise InvalidInputError(f"memtrim.functional.{name}: save must be 'output' or 'mask', got {save!r}.")
    if save == "mask" and not rule.mask_ok:
        raise InvalidInputError(
            f"memtrim.functional.{name}: save='mask' needs an activation whose gradient is a 0/1 (or 0/slope) "
            "function of a sign: relu, leaky_relu, hardtanh, relu6 or hardsigmoid."
        )
    if (plain_only() or not (torch.is_grad_enabled() and x.requires_grad)  # torch's own op (and its autograd)
            or (isinstance(rule, _ELU) and x.dtype in (torch.float16, torch.bfloat16))):  # NOTE [ ELU in half ]
        return rule.forward_(x) if inplace else rule.forward(x)
    owner = owner or f"memtrim.functional.{name}"
    if rule.keeps == "input":
        return _KeepInput.apply(x, x.clone() if inplace else None, rule, inplace, owner)
    if save == "mask":
        if inplace and x._is_view():  # (autograd allows a Function that writes a view in place one output)
            return _KeepMask.apply(x, rule, inplace, owner, [_Anchor.apply(x)])
        anchor: list[torch.Tensor] = []
        y, _ = _KeepMask.apply(x, rule, inplace, owner, anchor)
        if not (inplace or rule.second_derivative_in_output):
            anchor.append(_Anchor.apply(x))
        return y
    return _KeepOutput.apply(x, rule, inplace, owner)


# ---------------------------------------------------------------------- public functions (torch's signatures)
def relu(input: torch.Tensor, inplace: bool = False, *, save: str = "output",
         _owner: str | None = None) -> torch.Tensor:
    """ReLU keeping only its output (or a 1-bit mask with ``save="mask"``) for backward."""
    return _apply("relu", input, _ReLU(), inplace, save, _owner)


def leaky_relu(input: torch.Tensor, negative_slope: float = 0.01, inplace: bool = False, *,
               save: str = "output", _owner: str | None = None) -> torch.Tensor:
    """LeakyReLU keeping its output (or a 1-bit mask); a negative slope keeps the input instead."""
    if negative_slope < 0:
        rule: _Rule = _InputRule(lambda x: torch.nn.functional.leaky_relu(x, negative_slope),
                                 lambda g, x: torch.ops.aten.leaky_relu_backward(g, x, negative_slope, False))
        if save == "mask":
            raise InvalidInputError("memtrim.functional.leaky_relu: save='mask' needs negative_slope >= 0.")
        return _apply("leaky_relu", input, rule, inplace, "output", _owner)
    return _apply("leaky_relu", input, _LeakyReLU(negative_slope), inplace, save, _owner)


def hardtanh(input: torch.Tensor, min_val: float = -1.0, max_val: float = 1.0, inplace: bool = False, *,
             save: str = "output", _owner: str | None = None) -> torch.Tensor:
    """Hardtanh keeping its output (or a 1-bit mask)."""
    if min_val >= max_val:
        raise InvalidInputError(f"memtrim.functional.hardtanh: min_val ({min_val}) must be < max_val ({max_val}).")
    if isinstance(input, torch.Tensor) and not _bounds_exact(input.dtype, min_val, max_val):
        # a bound the dtype rounds (0.1 in float16) saturates the output at the rounded bound, which torch's backward,
        # comparing in float32, takes for an inside value: the output cannot tell them apart. torch's own op then
        return (torch.nn.functional.hardtanh_(input, min_val, max_val) if inplace
                else torch.nn.functional.hardtanh(input, min_val, max_val))
    return _apply("hardtanh", input, _Hardtanh(min_val, max_val), inplace, save, _owner)


_EXACT_BOUNDS: dict[tuple[torch.dtype, float, float], bool] = {}


def _bounds_exact(dtype: torch.dtype, low: float, high: float) -> bool:
    """Whether hardtanh's gradient can be told from its output in ``dtype``: float32 and float64 compare in their own
    precision (the saturated output equals the bound as the backward rounds it); a lower precision (float16,
    bfloat16) compares in float32, so each bound must be exact in ``dtype``."""
    if dtype in (torch.float32, torch.float64) or not dtype.is_floating_point:
        return True
    key = (dtype, low, high)
    found = _EXACT_BOUNDS.get(key)
    if found is None:
        found = _EXACT_BOUNDS[key] = all(float(torch.tensor(b, dtype=dtype)) == b for b in (low, high))
    return found


def relu6(input: torch.Tensor, inplace: bool = False, *, save: str = "output",
          _owner: str | None = None) -> torch.Tensor:
    """ReLU6 keeping its output (or a 1-bit mask)."""
    return _apply("relu6", input, _Hardtanh(0.0, 6.0), inplace, save, _owner)


def elu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """ELU keeping its output (alpha > 0; otherwise its input)."""
    if alpha <= 0:
        rule: _Rule = _InputRule(lambda x: torch.nn.functional.elu(x, alpha),
                                 lambda g, x: torch.ops.aten.elu_backward(g, alpha, 1.0, 1.0, False, x))
        return _apply("elu", input, rule, inplace, "output", _owner)
    return _apply("elu", input, _ELU(alpha), inplace, "output", _owner)


def celu(input: torch.Tensor, alpha: float = 1.0, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """CELU keeping its output."""
    if alpha <= 0:
        raise InvalidInputError(f"memtrim.functional.celu: alpha must be > 0, got {alpha}.")
    return _apply("celu", input, _ELU(alpha, 1.0, 1.0 / alpha), inplace, "output", _owner)


def selu(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """SELU keeping its output."""
    return _apply("selu", input, _ELU(_SELU_ALPHA, _SELU_SCALE), inplace, "output", _owner)


def sigmoid(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """Sigmoid keeping its output."""
    return _apply("sigmoid", input, _Sigmoid(), inplace, "output", _owner)


def tanh(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """Tanh keeping its output."""
    return _apply("tanh", input, _Tanh(), inplace, "output", _owner)


def hardsigmoid(input: torch.Tensor, inplace: bool = False, *, save: str = "output",
                _owner: str | None = None) -> torch.Tensor:
    """Hardsigmoid keeping its output (or a 1-bit mask)."""
    return _apply("hardsigmoid", input, _Hardsigmoid(), inplace, save, _owner)


def softplus(input: torch.Tensor, beta: float = 1.0, threshold: float = 20.0, *,
             _owner: str | None = None) -> torch.Tensor:
    """Softplus keeping its output (its derivative is 1 - exp(-beta * output)) where that determines the gradient
    (:func:`softplus_keeps_output`: torch's default threshold in float32 and narrower types); its input otherwise."""
    if beta <= 0:
        raise InvalidInputError(f"memtrim.functional.softplus: beta must be > 0, got {beta}.")
    # not a tensor: _apply raises the usual InvalidInputError (a float has no dtype to ask about)
    if not softplus_keeps_output(threshold, input.dtype if isinstance(input, torch.Tensor) else torch.float32):
        rule = _InputRule(lambda x: torch.nn.functional.softplus(x, beta, threshold),
                          lambda g, x: torch.ops.aten.softplus_backward(g, x, beta, threshold))
        return _apply("softplus", input, rule, False, "output", _owner)
    return _apply("softplus", input, _Softplus(beta, threshold), False, "output", _owner)


def silu(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """SiLU keeping its input (the derivative needs it); nothing else."""
    return _apply("silu", input, _InputRule(torch.nn.functional.silu, torch.ops.aten.silu_backward), inplace,
                  "output", _owner)


def gelu(input: torch.Tensor, approximate: str = "none", *, _owner: str | None = None) -> torch.Tensor:
    """GELU (exact or ``approximate="tanh"``) keeping its input; nothing else."""
    if approximate not in ("none", "tanh"):
        raise InvalidInputError(f"memtrim.functional.gelu: approximate must be 'none' or 'tanh', got {approximate!r}.")
    rule = _InputRule(lambda x: torch.nn.functional.gelu(x, approximate=approximate),
                      lambda g, x: torch.ops.aten.gelu_backward(g, x, approximate=approximate))
    return _apply("gelu", input, rule, False, "output", _owner)


def mish(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """Mish keeping its input; nothing else."""
    return _apply("mish", input, _InputRule(torch.nn.functional.mish, torch.ops.aten.mish_backward), inplace,
                  "output", _owner)


def hardswish(input: torch.Tensor, inplace: bool = False, *, _owner: str | None = None) -> torch.Tensor:
    """Hardswish keeping its input; nothing else."""
    return _apply("hardswish", input,
                  _InputRule(torch.nn.functional.hardswish, torch.ops.aten.hardswish_backward), inplace, "output",
                  _owner)

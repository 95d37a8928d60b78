"""BatchNorm followed by identity, LeakyReLU or ELU, keeping only the activation's output (the InPlace-ABN idea,
arXiv 1712.02616, in pure PyTorch, with standard BatchNorm parameters).

NOTE [ inverting BatchNorm + activation ]
Forward: ``y = gamma * xhat + beta`` with ``xhat = (x - mean) * invstd``, then ``z = act(y)``. Only ``z`` (and the
per-channel ``mean``, ``invstd``) is kept. Backward recovers ``y = act^-1(z)`` (LeakyReLU with slope s > 0 is
inverted by a LeakyReLU with slope 1/s; ELU: ``z`` or ``log1p(z / alpha)``), then ``xhat = (y - beta) / gamma``,
rebuilds ``x = mean + xhat / invstd`` and calls torch's own fused ``native_batch_norm_backward`` (in eval,
``dx = gamma * invstd * dy``). The activation's gradient uses torch's own in-place backward kernels.

Where inversion would lose precision it is not used: the channels whose ``(|beta| + s) / |gamma|`` could make the
rebuilt ``xhat`` more than ``KEEP_BOUND`` times less accurate than torch's (s: the ELU term, large where ELU
saturates and ``log1p`` loses ``y``) keep their ``xhat`` explicitly, a tensor of those channels only (NOTE [ when a
norm keeps its input ] in _kernels.py derives the rule). Parameters and buffers are exactly ``nn.BatchNorm``'s, so
state_dicts load both ways. Gradients differ from torch's by the rounding of the reconstruction (float32: within
10x torch's own error against float64; see tests), not bitwise. There is no second derivative: a backward through
the gradient raises :class:`ConvertError` naming the module. Under torch.compile, torch.func and autocast, and in
float16 and bfloat16 (NOTE [ norms in half precision ] in _kernels.py), the module runs as torch's BatchNorm and
activation.

BatchNorm + ReLU cannot be inverted (ReLU's zeros lose ``y``); keep such pairs as they are.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from ...errors import ConvertError, InvalidInputError
from ..guards import (
    FUSION,
    OUTPUT_HOOKS,
    WatchedFusion,
    autocasting,
    capturing,
    fx_tracing,
    kept_params,
    mark_activated,
    no_double_backward,
    owner,
    plain_apply,
    plain_only,
    refuse_later_hooks,
    saved_tensors,
    saves_checked,
)
from ._kernels import HALF_PRECISION, check_taken, keep_input_features

__all__ = ["BatchNormAct1d", "BatchNormAct2d", "BatchNormAct3d"]

_ACTIVATIONS = ("identity", "leaky_relu", "elu")


def elu_term(y: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """The ELU term s of NOTE [ when a norm keeps its input ], per channel: the RMS of ``e^-y - 1`` over ``y < 0``,
    infinite where some ``y`` saturates (``e^-y > 1 / eps``: ``log1p`` cannot rebuild it)."""
    e = torch.expm1((-y).clamp(0.0, 40.0))
    rms = e.square().mean(dims).sqrt()
    return torch.where(e.amax(dims) > 1.0 / torch.finfo(y.dtype).eps, torch.full_like(rms, float("inf")), rms)


class _BatchNormActFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool,
                momentum: float, eps: float, activation: str, param: float, gamma_threshold: float,
                owner: str, elu_from_output: bool = False) -> torch.Tensor:
        out, save_mean, save_invstd = torch.ops.aten.native_batch_norm(
            x, weight, bias, running_mean, running_var, training, momentum, eps
        )
        if not training:  # eval: normalised with the running statistics
            assert running_mean is not None and running_var is not None
            save_mean, save_invstd = running_mean.clone(), torch.rsqrt(running_var + eps)
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        dims = [0] + list(range(2, x.dim()))
        kept = xhat_kept = read_gamma = None
        # the weights as this forward computed with them, which the rebuild reads (NOTE [ the weights a rebuild
        # reads ] in _kernels.py); torch's backward reads the weight itself for dx, as below
        read_beta = None if bias is None else bias.detach().clone()
        if weight is not None:  # NOTE [ when a norm keeps its input ] (in _kernels.py)
            read_gamma = weight.detach().clone()
            extra = elu_term(out, dims) if activation == "elu" else None
            kept = keep_input_features(weight, bias, extra, gamma_threshold, node=ctx, read=(read_gamma, read_beta))
            if kept.numel() == 0:
                kept = None
            else:
                view = [1, -1] + shape[2:]
                xhat_kept = ((x.index_select(1, kept) - save_mean.index_select(0, kept).view(view))
                             * save_invstd.index_select(0, kept).view(view))
        if activation == "leaky_relu":
            torch.nn.functional.leaky_relu_(out, param)
        elif activation == "elu":
            torch.ops.aten.elu_(out, param)
        ctx.activation, ctx.param, ctx.training, ctx.shape, ctx.owner = activation, param, training, shape, owner
        ctx.elu_from_output = elu_from_output
        ctx.kept_params = kept_params(weight, bias)
        ctx.save_for_backward(out, save_mean, save_invstd, weight, bias, read_gamma, read_beta, kept, xhat_kept)
        return out

    @staticmethod
    @no_double_backward
    def backward(ctx: Any, dz: torch.Tensor) -> tuple:
        z, mean, invstd, weight, bias, read_gamma, read_beta, kept, xhat_kept = saved_tensors(ctx)
        check_taken(ctx)  # (NOTE [ keep decisions made together ] in _kernels.py)
        shape, activation, param = ctx.shape, ctx.activation, ctx.param
        if activation == "leaky_relu":
            y = torch.nn.functional.leaky_relu(z, 1.0 / param)  # the inverse of a leaky ReLU is a leaky ReLU
            dy = torch.ops.aten.leaky_relu_backward(dz, z, param, True)
        elif activation == "elu":
            # saturated channels (z == -alpha, log1p(-1) = -inf) are kept ones: their xhat is replaced below
            y = torch.where(z > 0, z, torch.log1p(z / param))
            dy = torch.ops.aten.elu_backward(dz, param, 1.0, 1.0, True, z)
        else:
            y, dy = z, dz
        # xhat = (y - beta) / gamma in one pass; the kept channels use their kept xhat
        if ctx.training and kept is None and weight is not None:
            xhat = None  # not needed: the kernel below is fed y directly
        elif weight is not None:
            inv_gamma = torch.where(read_gamma == 0, torch.ones_like(read_gamma), read_gamma).reciprocal()
            offset = -read_beta * inv_gamma if read_beta is not None else torch.zeros_like(inv_gamma)
            xhat = torch.addcmul(offset.view(shape), y, inv_gamma.view(shape))
            if kept is not None:
                xhat.index_copy_(1, kept, xhat_kept)
                if activation == "elu" and not ctx.elu_from_output:  # a kept channel's ELU derivative from its
                    # input too (not z + alpha, which cancels where the channel sits far below 0: 343x torch's error
                    # at beta -10 in float32); but where convert fused an in-place ELU, whose torch op differentiates
                    # from its output (0 where z rounds to -alpha), from the output as torch's
                    view = [1, -1] + shape[2:]
                    pre = xhat_kept * read_gamma.index_select(0, kept).view(view)
                    if read_beta is not None:
                        pre = pre + read_beta.index_select(0, kept).view(view)
                    dy.index_copy_(1, kept, torch.ops.aten.elu_backward(dz.index_select(1, kept), param, 1.0, 1.0,
                                                                        False, pre))
        else:
            xhat = y - read_beta.view(shape) if read_beta is not None else y
        if ctx.training:
            # torch's own fused BatchNorm backward
            mask = [ctx.needs_input_grad[0], weight is not None, bias is not None]
            if xhat is None:
                # No pass to rebuild x: hand the kernel y as its "input" with mean beta and invstd 1/gamma (as the
                # forward computed with them), so the xhat it computes is (y - beta) / gamma, and weight gamma *
                # gamma' * invstd (gamma': the weight torch's backward reads), so its dx scale (weight * its invstd)
                # is gamma' * invstd. dgamma = sum(dy * xhat) and dbeta = sum(dy) are unchanged.
                beta = read_beta if read_beta is not None else torch.zeros_like(read_gamma)
                dx, dgamma, dbeta = torch.ops.aten.native_batch_norm_backward(
                    dy, y, weight * read_gamma * invstd, None, None, beta, read_gamma.reciprocal(), True, 0.0, mask,
                )
            else:  # fed the input rebuilt from xhat (x = mean + xhat / invstd)
                x = torch.addcmul(mean.view(shape), xhat, invstd.reciprocal().view(shape))
                dx, dgamma, dbeta = torch.ops.aten.native_batch_norm_backward(
                    dy, x, weight, None, None, mean, invstd, True, 0.0, mask,
                )
        else:
            dims = [0] + list(range(2, z.dim()))
            dbeta = dy.sum(dims) if bias is not None else None
            dgamma = (dy * xhat).sum(dims) if weight is not None else None
            scale = invstd.view(shape) * (weight.view(shape) if weight is not None else 1.0)
            dx = scale * dy
        return (dx, dgamma if weight is not None else None, dbeta if bias is not None else None,
                None, None, None, None, None, None, None, None, None, None)


_apply_batchnorm_act = plain_apply(_BatchNormActFunction)  # (forward has found plain_only false)


def refuse_fx_trace(bn: nn.Module) -> NoReturn:
    """Raise for torch.fx symbolic tracing (:func:`~memtrim.techniques.guards.fx_tracing`) of a fused BatchNorm: fx
    keeps torch's own BatchNorm as one call, which follows ``.train()``/``.eval()``, but traces into this class, which
    would fix its training mode in the graph and update ``num_batches_tracked`` while tracing."""
    raise ConvertError(
        f"memtrim: {owner(bn)} is a BatchNorm fused with its activation, which torch.fx cannot keep as one call: "
        "traced into, its training mode and running-statistics update would be fixed in the graph (fx keeps torch's "
        "own BatchNorm as a call that follows .train() and .eval()). Expected a model without fused BatchNorms; found "
        f"{type(bn).__name__}. To fix: trace the model (symbolic_trace, create_feature_extractor) before "
        "memtrim.convert and convert the traced module, or leave the BatchNorm out of convert (module_filter)."
    )


def other_dtype(bn: Any, input: torch.Tensor) -> bool:
    """Whether ``input`` has another dtype than ``bn``'s weight or, without one (``affine=False``), its running
    statistics: bfloat16 convolutions before a float32 BatchNorm. torch's kernels take the mix; a rebuild does not
    (a dtype error in backward, or another gradient)."""
    # (read from the dicts where they are: ``bn.weight`` is nn.Module.__getattr__'s slow path, at every call)
    params, buffers = bn._parameters, bn._buffers
    weight = params["weight"] if "weight" in params else bn.weight
    reference = weight if weight is not None else (
        buffers["running_mean"] if "running_mean" in buffers else getattr(bn, "running_mean", None))
    return reference is not None and input.dtype != reference.dtype


def batchnorm_arguments(bn: Any, input: torch.Tensor) -> tuple[float, bool, torch.Tensor | None,
                                                                  torch.Tensor | None]:
    """The (momentum factor, training, running_mean, running_var) ``nn.BatchNorm.forward`` passes to
    ``batch_norm``, with its ``num_batches_tracked`` bookkeeping, unchanged; and ``batch_norm``'s own check that a
    training batch has more than one value per channel (torch raises ValueError, after counting the batch: so does
    this, as an InvalidInputError, which is a ValueError)."""
    # buffers read from their dict once: each ``bn.running_mean`` is nn.Module.__getattr__'s slow path (about 1 us
    # on this project's CPU machine), and this runs at every call of every converted BatchNorm
    buffers, training, momentum = bn._buffers, bn.training, bn.momentum
    tracked = buffers["num_batches_tracked"] if "num_batches_tracked" in buffers else getattr(
        bn, "num_batches_tracked", None)
    mean = buffers["running_mean"] if "running_mean" in buffers else getattr(bn, "running_mean", None)
    var = buffers["running_var"] if "running_var" in buffers else getattr(bn, "running_var", None)
    factor = 0.0 if momentum is None else momentum
    if training and bn.track_running_stats and tracked is not None:
        tracked.add_(1)
        factor = 1.0 / float(tracked) if momentum is None else momentum
    bn_training = training or (mean is None and var is None)
    running_mean = mean if not training or bn.track_running_stats else None
    running_var = var if not training or bn.track_running_stats else None
    if bn_training:
        size = input.size()
        values = size[0]
        for n in size[2:]:
            values *= n
        if values == 1:
            raise InvalidInputError(
                f"{owner(bn)}: Expected more than 1 value per channel when training, got input size {size} "
                "(torch's nn.BatchNorm raises the same). Train on batches with more than one value per channel, or "
                "call .eval() on the module."
            )
    if not bn.eps > 0.0:  # (the usual case: one comparison)
        _eps_as_torch(bn, bn_training)
    return factor, bn_training, running_mean, running_var


def _eps_as_torch(bn: Any, training: bool) -> None:
    """Raise where torch's ``F.batch_norm`` raises for ``bn``'s eps (from torch 2.13: not positive in training,
    negative in eval; found by an adversarial pass, the fused module trained on), asking the installed torch."""
    try:
        nn.functional.batch_norm(torch.zeros(2, 1), torch.zeros(1), torch.ones(1), training=training, eps=bn.eps)
    except ValueError as e:
        raise InvalidInputError(f"{owner(bn)}: {e} (torch's nn.BatchNorm raises the same). Set a positive eps.") from e


class _BatchNormAct(WatchedFusion, nn.modules.batchnorm._BatchNorm):
    """Shared by BatchNormAct1d/2d/3d: ``nn.BatchNorm`` parameters and buffers, followed by an activation."""

    memtrim_keep_decisions = True  # (NOTE [ keep decisions made together ] in _kernels.py)


    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, device: Any = None, dtype: Any = None, *,
                 activation: str = "leaky_relu", negative_slope: float = 0.01, alpha: float = 1.0,
                 gamma_threshold: float = 0.0) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        if activation not in _ACTIVATIONS:
            raise InvalidInputError(
                f"memtrim.nn.{type(self).__name__}: activation must be one of {_ACTIVATIONS}, got {activation!r}. "
                "ReLU is not invertible: keep nn.BatchNorm + nn.ReLU for it."
            )
        if activation == "leaky_relu" and negative_slope <= 0:
            raise InvalidInputError(
                f"memtrim.nn.{type(self).__name__}: negative_slope must be > 0 to invert the activation, got "
                f"{negative_slope}."
            )
        if activation == "elu" and alpha <= 0:
            raise InvalidInputError(f"memtrim.nn.{type(self).__name__}: alpha must be > 0, got {alpha}.")
        self.activation = activation
        self.negative_slope = negative_slope
        self.alpha = alpha
        self.gamma_threshold = gamma_threshold

    def extra_repr(self) -> str:
        """The BatchNorm's repr plus the activation it applies."""
        act = {"identity": "identity", "leaky_relu": f"leaky_relu({self.negative_slope})",
               "elu": f"elu({self.alpha})"}[self.activation]
        return f"{super().extra_repr()}, activation={act}"


    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``activation(batch_norm(input))``, keeping only the output (torch's own ops where nothing is kept)."""
        refuse_later_hooks(self, "it returns its activation's output; that activation is now an identity", OUTPUT_HOOKS)
        if fx_tracing():
            refuse_fx_trace(self)
        self._check_input_dim(input)
        factor, bn_training, running_mean, running_var = batchnorm_arguments(self, input)
        param = self.negative_slope if self.activation == "leaky_relu" else self.alpha
        needs_grad = torch.is_grad_enabled() and (
            input.requires_grad or (self.weight is not None and self.weight.requires_grad)
        )
        # torch's own BatchNorm and activation (an empty batch too: the native kernel this calls refuses one)
        # (and under saved-tensor hooks not memtrim's: a user's may pack the kept output lossily, to bfloat16)
        # (and in float16 and bfloat16: NOTE [ norms in half precision ] in _kernels.py; and for an input of another
        # dtype than the weight, bfloat16 convolutions before a float32 BatchNorm; and while a CUDA graph is captured:
        # NOTE [ keep decisions while a CUDA graph is captured ] in _kernels.py)
        if (not needs_grad or plain_only(in_backward=False) or autocasting(input) or input.numel() == 0
                or not saves_checked() or input.dtype in HALF_PRECISION or other_dtype(self, input)
                or capturing(input)):
            out = nn.functional.batch_norm(input, running_mean, running_var, self.weight, self.bias,
                                           bn_training, factor, self.eps)
            # in place or not as the activation convert fused was (what its backward keeps, an input or an output,
            # is what saved-tensor hooks outside see); one built by hand: in place, but ELU in half precision (torch's
            # in-place ELU differentiates from its output too: NOTE [ ELU in half ])
            half_elu = self.activation == "elu" and input.dtype in HALF_PRECISION
            inplace = self.__dict__.get("memtrim_activation_inplace", not half_elu)
            if self.activation == "leaky_relu":
                out = nn.functional.leaky_relu(out, param, inplace=inplace)
            elif self.activation == "elu":
                out = nn.functional.elu(out, param, inplace=inplace)
            return out if plain_only(in_backward=False) else mark_activated(out, self.__dict__.get(FUSION))
        if not bn_training and (running_mean is None or running_var is None):
            raise InvalidInputError(f"memtrim.nn.{type(self).__name__}: eval mode needs running statistics.")
        channels = input.shape[1] if input.dim() > 1 else 0
        for name, t in (("weight", self.weight), ("bias", self.bias), ("running_mean", running_mean),
                        ("running_var", running_var)):
            # torch's batch_norm checks this; the native kernel this calls does not (it read past the tensors)
            if t is not None and t.numel() != channels:
                raise InvalidInputError(
                    f"{owner(self)}: {name} should contain {channels} elements not {t.numel()} (torch's BatchNorm "
                    f"raises the same): expected an input with {t.numel()} channels in dimension 1, got shape "
                    f"{tuple(input.shape)}."
                )
        return mark_activated(_apply_batchnorm_act(
            input, self.weight, self.bias, running_mean, running_var, bn_training, factor, self.eps, self.activation,
            param, self.gamma_threshold, owner(self), self.__dict__.get("memtrim_activation_inplace", False)),
            self.__dict__.get(FUSION))


class BatchNormAct1d(_BatchNormAct, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` + identity / LeakyReLU / ELU, keeping only the activation's output for backward."""


class BatchNormAct2d(_BatchNormAct, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` + identity / LeakyReLU / ELU, keeping only the activation's output for backward.

    Example::

        block = nn.Sequential(nn.Conv2d(3, 16, 3), memtrim.nn.BatchNormAct2d(16, activation="leaky_relu"),
                              nn.Conv2d(16, 16, 3))
    """


class BatchNormAct3d(_BatchNormAct, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` + identity / LeakyReLU / ELU, keeping only the activation's output for backward."""

"""What the norms share: a small cache of constant tensors for torch's fused normalization kernels, and the rule that
decides which features keep their normalised input (NOTE [ when a norm keeps its input ]). Where the norms step aside
and the errors they raise are in :mod:`memtrim.techniques.guards`."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

__all__ = ["CACHE_SIZE", "HALF_PRECISION", "KEEP_BOUND", "keep_input_features", "zeros_and_ones"]


# ---------------------------------------------------------------------- bounded constant cache
CACHE_SIZE = 8
"""Shapes :func:`zeros_and_ones` keeps: a model sees a handful (one per sequence length in flight), not thousands."""
# (shape, dtype, device) -> (zeros, ones), least recently used first; never written to (the kernels only read them)
_CONSTANTS: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def zeros_and_ones(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros and ones shaped like ``like``, kept for the :data:`CACHE_SIZE` most recently used shapes. A fake
    ``like`` (a planner's trace) gets its fake mode's own: a fake tensor must never reach a real run, nor another
    trace's mode (an entry holds its mode, so the mode's ``id`` is not reused while the entry lives)."""
    mode = getattr(like, "fake_mode", None)
    key = (tuple(like.shape), like.dtype, like.device, None if mode is None else id(mode))
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = (torch.zeros_like(like), torch.ones_like(like))
        while len(_CONSTANTS) > CACHE_SIZE:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(key)
    return found


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
# (:func:`memtrim.techniques.guards.plain_only`), so the compiler sees no data-dependent shape.
KEEP_BOUND = 8.0
"""How many times torch's own error a rebuilt ``xhat`` may carry (NOTE above): the converted gradients' error stays
within ~9x torch's at the bound; tests hold it to 10x against float64."""
HALF_PRECISION = (torch.float16, torch.bfloat16)
"""NOTE [ norms in half precision ]: the norms that rebuild their input from their output (``BatchNormAct``,
``LayerNorm``, ``RMSNorm``, and convert's norms by behaviour) run as torch's own ops for inputs of these dtypes,
keeping what torch keeps. torch's half-precision backward computes in float32 from the exact input and rounds the
result once; a rebuilt ``xhat`` carries the rounding of the half-precision output into every element of the
weight-gradient sums. No bound on |beta / gamma| holds the error to 10x torch's: with a bound of 2, where a sum
nearly cancels (a uniform incoming gradient over a batch of one, a gradient nearly orthogonal to a feature's
xhat), BatchNormAct's dgamma reached 17.5x torch's error against float64 and RMSNorm's 6,607x (float16); keeping
every feature's xhat in half precision still gave 56-68x (measured on 2026-11-29). So half precision saves nothing
with these modules rather than train differently; ``convert`` leaves such norms torch's and says so."""


def keep_input_features(gamma: torch.Tensor, beta: torch.Tensor | None, extra: torch.Tensor | None = None,
                        floor: float = 0.0) -> torch.Tensor:
    """Indices (flattened) of the features whose ``xhat`` cannot be rebuilt from the output to within KEEP_BOUND
    times torch's own error (NOTE [ when a norm keeps its input ] in this file). ``extra``: the ELU term s, per
    feature; ``floor``: a user's ``gamma_threshold``, below which features keep their ``xhat`` anyway."""
    g = gamma.detach().abs()
    # without beta the limit is 0, a scalar (a zeros tensor was one more op, on a GPU a kernel, at every call)
    limit: torch.Tensor | float = beta.detach().abs() if beta is not None else 0.0
    if extra is not None:
        limit = limit + extra.to(limit.dtype if isinstance(limit, torch.Tensor) else g.dtype)
    keep = ~(g * KEEP_BOUND > limit) | (g < max(torch.finfo(g.dtype).tiny ** 0.25, floor))
    return keep.flatten().nonzero().flatten()

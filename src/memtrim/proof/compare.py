"""One tolerance comparison of two tensors, shared by :func:`memtrim.verify` and :func:`memtrim.check_inplace`.

Why one: both answer "is the transformed tensor the reference's, within (rtol, atol)?", and two hand-written
comparers drift apart on the edge cases (NaN, infinities, a zero reference). Here: bitwise equality first (the
common case of an exact technique), then, element by element in float64, ``|a - b| <= atol + rtol * |b|`` over
the finite differences, with every non-finite value (NaN, +-inf) required at the same place with the same value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Closeness", "bitwise_equal", "compare_tensors"]

_TINY = torch.finfo(torch.float64).tiny  # the relative error's denominator where the reference is 0


@dataclass(frozen=True)
class Closeness:
    """How far ``actual`` is from ``expected`` (see :func:`compare_tensors`).

    ``bitwise``: the same bits. ``within``: inside the tolerance. ``max_abs_error`` / ``max_rel_error``: over the
    finite differences; ``inf`` when shapes differ or the non-finite values do not sit at the same places.
    """

    bitwise: bool
    within: bool
    max_abs_error: float
    max_rel_error: float


_EQUAL = Closeness(bitwise=True, within=True, max_abs_error=0.0, max_rel_error=0.0)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (so ``-0.0 != 0.0`` and a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


def compare_tensors(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float) -> Closeness:
    """Compare ``actual`` with ``expected`` elementwise: ``|actual - expected| <= atol + rtol * |expected|``.

    Args:
        actual: the tensor under test (e.g. the transformed run's).
        expected: the reference; the relative error is taken against it.
        rtol, atol: the tolerance; ``0, 0`` asks for equal values.

    Returns:
        A :class:`Closeness`. Non-finite values must match exactly (NaN where NaN, the same infinity); tensors of
        different shapes are never within.

    Example::

        compare_tensors(torch.tensor([1.0]), torch.tensor([1.0 + 1e-7]), rtol=1e-6, atol=0.0).within   # True
    """
    a, b = actual.detach(), expected.detach()
    if a.shape != b.shape:
        return Closeness(bitwise=False, within=False, max_abs_error=math.inf, max_rel_error=math.inf)
    if bitwise_equal(a, b):
        return _EQUAL
    a64, b64 = a.double(), b.double()
    diff = (a64 - b64).abs()
    finite = torch.isfinite(diff)
    odd_a, odd_b = a64[~finite], b64[~finite]  # NaN or infinite on one side at least (or an overflowing diff)
    same_nonfinite = torch.equal(torch.isnan(odd_a), torch.isnan(odd_b)) and torch.equal(
        odd_a.nan_to_num(), odd_b.nan_to_num()
    )
    if not same_nonfinite:
        return Closeness(bitwise=False, within=False, max_abs_error=math.inf, max_rel_error=math.inf)
    diff, reference = diff[finite], b64.abs()[finite]
    if diff.numel() == 0:
        return Closeness(bitwise=False, within=True, max_abs_error=0.0, max_rel_error=0.0)
    max_abs = float(diff.max())
    max_rel = float((diff / reference.clamp_min(_TINY)).max())
    within = bool((diff <= atol + rtol * reference).all())
    return Closeness(bitwise=False, within=within, max_abs_error=max_abs, max_rel_error=max_rel)

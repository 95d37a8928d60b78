"""One tolerance comparison of two tensors, shared by :func:`memtrim.verify` and :func:`memtrim.check_inplace`.

Why one: both answer "is the transformed tensor the reference's, within (rtol, atol)?", and two hand-written
comparers drift apart on the edge cases (NaN, infinities, a zero reference). Here: bitwise equality first (the
common case of an exact technique), then, element by element in float64, ``|a - b| <= atol + rtol * |b|`` over
the finite differences, with every non-finite value (NaN, +-inf) required at the same place with the same value.

Complex tensors are compared on both parts (``|a - b|`` is the modulus, as in ``torch.isclose``; a cast to float64
would keep the real part only). A conjugate or negative view (torch's lazy conj and neg bits) is compared by the
values it stands for. Sparse tensors (COO, as ``nn.Embedding(sparse=True)`` gradients are, and the compressed
layouts): bitwise means the same layout and, once coalesced, the same indices and values; the tolerance compares
their values in dense form. Nested tensors have no elementwise comparison here and are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError

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


_COMPRESSED = {  # layout: (its compressed indices, its plain indices)
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (so ``-0.0 != 0.0`` and a NaN equals the same NaN).

    A conjugate or negative view holds the bits of the values it stands for; sparse tensors are equal when their
    layouts are and, coalesced, their indices and values are.

    Raises:
        InvalidInputError: a nested tensor (its elements have no one shape to compare).
    """
    _check_layout(a, "memtrim.proof.bitwise_equal")
    _check_layout(b, "memtrim.proof.bitwise_equal")
    a, b = a.detach(), b.detach()
    if a.layout != b.layout or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.layout is torch.sparse_coo:
        a, b = a.coalesce(), b.coalesce()
        return bitwise_equal(a.indices(), b.indices()) and bitwise_equal(a.values(), b.values())
    if a.layout in _COMPRESSED:
        return all(bitwise_equal(getattr(a, name)(), getattr(b, name)()) for name in (*_COMPRESSED[a.layout], "values"))
    if a.layout is not torch.strided:  # mkldnn: dense data in another memory format
        a, b = a.to_dense(), b.to_dense()
    # view_as_real and view(dtype) refuse a conjugate view, and would read a negative one's stored bits
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(int_dtype), b.contiguous().view(int_dtype))


def _check_layout(t: torch.Tensor, api: str) -> None:
    """Refuse what has no elementwise comparison: a nested tensor (jagged or strided), whose components differ in
    shape."""
    if t.is_nested or not (t.layout in (torch.strided, torch.sparse_coo, *_COMPRESSED) or t.is_mkldnn):
        raise InvalidInputError(
            f"{api}: expected a dense or sparse tensor, got a {'nested' if t.is_nested else str(t.layout)} tensor "
            f"(layout {t.layout}), whose elements it cannot pair. Compare its components one by one (t.unbind()), or "
            "a padded copy (torch.nested.to_padded_tensor(t, 0.0))."
        )


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a strided tensor of the values it stands for (sparse filled in; conj and neg views resolved)."""
    if t.layout is not torch.strided:
        t = t.to_dense()
    return t.resolve_conj().resolve_neg()


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
    _check_layout(actual, "memtrim.proof.compare_tensors")
    _check_layout(expected, "memtrim.proof.compare_tensors")
    a, b = actual.detach(), expected.detach()
    if a.shape != b.shape:
        return Closeness(bitwise=False, within=False, max_abs_error=math.inf, max_rel_error=math.inf)
    if bitwise_equal(a, b):
        return _EQUAL
    a, b = _dense(a), _dense(b)
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64  # both parts of a complex
    a64, b64 = a.to(wide), b.to(wide)
    diff = (a64 - b64).abs()  # the modulus for complex values (float64)
    finite = torch.isfinite(diff)
    odd_a, odd_b = a64[~finite], b64[~finite]  # NaN or infinite on one side at least (or an overflowing diff)
    if wide is torch.complex128:  # each part at the same place with the same value
        odd_a, odd_b = torch.view_as_real(odd_a), torch.view_as_real(odd_b)
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

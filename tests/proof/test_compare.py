"""The one tolerance comparison behind verify and check_inplace: exact at its edges (NaN, infinities, zeros)."""

import math

import pytest
import torch

import memtrim
from memtrim.proof import bitwise_equal, compare_tensors

inf, nan = math.inf, math.nan


def test_bitwise_equal_is_about_bits():
    assert bitwise_equal(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bitwise_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert bitwise_equal(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))
    assert bitwise_equal(torch.tensor([1, 2]), torch.tensor([1, 2]))


def test_equal_tensors_are_bitwise_and_within():
    c = compare_tensors(torch.tensor([1.0, inf]), torch.tensor([1.0, inf]), rtol=0.0, atol=0.0)
    assert c.bitwise and c.within and c.max_abs_error == c.max_rel_error == 0.0


def test_tolerance_is_atol_plus_rtol_times_the_reference():
    actual, expected = torch.tensor([1.5, 4.0], dtype=torch.float64), torch.tensor([1.0, 4.0], dtype=torch.float64)
    assert compare_tensors(actual, expected, rtol=0.0, atol=0.5).within
    assert compare_tensors(actual, expected, rtol=0.5, atol=0.0).within
    assert not compare_tensors(actual, expected, rtol=0.25, atol=0.25 - 1e-12).within
    c = compare_tensors(actual, expected, rtol=0.0, atol=0.0)
    assert not c.bitwise and (c.max_abs_error, c.max_rel_error) == (0.5, 0.5)


@pytest.mark.parametrize("actual, expected, within", [
    ([nan, 1.0], [nan, 1.0], True),  # NaN where NaN
    ([inf, -inf], [inf, -inf], True),  # the same infinities
    ([nan], [0.0], False),  # a NaN is never a number, not even 0
    ([0.0], [nan], False),
    ([inf], [-inf], False),
    ([inf], [1.0], False),
    ([1e308], [-1e308], False),  # the difference overflows float64
])
def test_non_finite_values_must_match(actual, expected, within):
    a = torch.tensor(actual, dtype=torch.float64)
    b = torch.tensor(expected, dtype=torch.float64)
    c = compare_tensors(a, b, rtol=1.0, atol=1.0)
    assert c.within is within
    if not within:
        assert c.max_abs_error == c.max_rel_error == inf


def test_shapes_must_match():
    c = compare_tensors(torch.zeros(2), torch.zeros(3), rtol=1.0, atol=1.0)
    assert not c.within and c.max_abs_error == inf


def test_a_zero_reference_gives_a_huge_but_finite_relative_error():
    c = compare_tensors(torch.tensor([1e-300], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64),
                        rtol=0.0, atol=1e-300)
    assert c.within and c.max_abs_error == 1e-300 and math.isfinite(c.max_rel_error) and c.max_rel_error > 1e7


# ---------------------------------------------------------------- complex, conjugate and sparse tensors


def test_complex_tensors_are_compared_on_both_parts():
    # compared through .double(), which keeps the real part only: 1+2j against 1+5j was equal (max error 0)
    actual, expected = torch.tensor([1 + 2j, 3 - 1j]), torch.tensor([1 + 5j, 3 - 1j])
    c = compare_tensors(actual, expected, rtol=0.0, atol=0.0)
    assert not c.bitwise and not c.within
    assert c.max_abs_error == 3.0  # |(1+2j) - (1+5j)|, the modulus torch.isclose uses
    assert c.max_rel_error == pytest.approx(3.0 / abs(1 + 5j), rel=1e-15)
    assert compare_tensors(actual, expected, rtol=0.0, atol=3.0).within
    assert not compare_tensors(actual, expected, rtol=0.0, atol=2.9).within
    for atol in (2.9, 3.0):  # the same verdict as plain torch
        assert compare_tensors(actual, expected, rtol=0.0, atol=atol).within is bool(
            torch.isclose(actual.to(torch.complex128), expected.to(torch.complex128), rtol=0.0, atol=atol).all())


@pytest.mark.parametrize("actual, expected, within", [
    (complex(inf, 1.0), complex(inf, 1.0), True),
    (complex(inf, 1.0), complex(inf, 2.0), False),  # the same real infinity, another imaginary part
    (complex(1.0, nan), complex(2.0, nan), False),
    (complex(1.0, inf), complex(1.0, -inf), False),
])
def test_complex_non_finite_parts_must_match(actual, expected, within):
    c = compare_tensors(torch.tensor([actual, 1j]), torch.tensor([expected, 1j]), rtol=1.0, atol=1.0)
    assert c.within is within


def test_a_conjugate_view_is_compared_by_its_values():
    # bitwise_equal raised torch's "view_as_real doesn't work on unresolved conjugated tensors"
    x = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex128)
    assert bitwise_equal(x.conj(), x.conj().clone())
    assert bitwise_equal(x.conj(), x.conj().resolve_conj())
    assert bitwise_equal(x.conj().resolve_conj(), x.conj())
    assert not bitwise_equal(x.conj(), x)
    assert bitwise_equal(x.conj().imag, -x.imag)  # a negative view (torch's neg bit)
    assert compare_tensors(x.conj(), torch.conj_physical(x), rtol=0.0, atol=0.0).bitwise
    c = compare_tensors(x.conj(), x, rtol=0.0, atol=0.0)
    assert not c.within and c.max_abs_error == 4.0  # |(1-2j) - (1+2j)|


def _sparse_grad(scale=1.0):
    torch.manual_seed(0)
    embedding = torch.nn.Embedding(6, 3, sparse=True)
    (embedding(torch.tensor([1, 4, 1])).sum() * scale).backward()
    return embedding.weight.grad


def test_sparse_gradients_are_compared_bitwise_by_indices_and_values():
    # an nn.Embedding(sparse=True) gradient raised torch's "unsupported memory format option Contiguous"
    grad = _sparse_grad()
    assert grad.layout is torch.sparse_coo and not grad.is_coalesced()
    assert bitwise_equal(grad, grad.clone())
    assert bitwise_equal(grad, grad.coalesce())  # the same values, summed into one entry per row
    assert not bitwise_equal(grad, _sparse_grad(2.0))
    assert not bitwise_equal(grad, grad.to_dense())  # another layout is other bits
    assert compare_tensors(grad, grad.coalesce(), rtol=0.0, atol=0.0).bitwise


def test_sparse_tensors_are_compared_by_value_within_tolerance():
    grad, doubled = _sparse_grad(), _sparse_grad(2.0)
    c = compare_tensors(doubled, grad, rtol=0.0, atol=0.0)
    assert not c.within and c.max_abs_error == float((doubled.to_dense() - grad.to_dense()).abs().max())
    assert compare_tensors(doubled, grad, rtol=1.0, atol=0.0).within
    mixed = compare_tensors(grad, grad.to_dense(), rtol=0.0, atol=0.0)  # equal values in another layout
    assert mixed.within and not mixed.bitwise


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state:UserWarning")
@pytest.mark.parametrize("to_layout", [
    lambda d: d.to_sparse_csr(), lambda d: d.to_sparse_csc(), lambda d: d.to_sparse_bsr((2, 2)),
    lambda d: d.to_sparse_bsc((2, 2)),
], ids=["csr", "csc", "bsr", "bsc"])
def test_compressed_sparse_layouts_are_compared(to_layout):
    dense = torch.tensor([[0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 3.0]])
    other = dense.clone()
    other[1, 3] = 4.0
    assert bitwise_equal(to_layout(dense), to_layout(dense.clone()))
    assert not bitwise_equal(to_layout(dense), to_layout(other))
    c = compare_tensors(to_layout(other), to_layout(dense), rtol=0.0, atol=0.0)
    assert not c.within and c.max_abs_error == 1.0


def test_a_nested_tensor_is_refused_by_name():
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.raises(memtrim.InvalidInputError, match=r"memtrim\.proof\.bitwise_equal: .*nested.*to_padded_tensor"):
        bitwise_equal(nested, nested)
    with pytest.raises(memtrim.InvalidInputError, match=r"memtrim\.proof\.compare_tensors: .*nested"):
        compare_tensors(nested, nested, rtol=0.0, atol=0.0)

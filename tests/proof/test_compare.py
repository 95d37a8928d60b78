"""The one tolerance comparison behind verify and check_inplace: exact at its edges (NaN, infinities, zeros)."""

import math

import pytest
import torch

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

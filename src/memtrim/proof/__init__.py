"""Proof that a change keeps the function: :func:`verify` (training, step by step), :func:`check_inplace` (one
hand-written op against a reference), and the tolerance comparison both use (:func:`compare_tensors`)."""

from ..errors import InplaceCheckError, VerifyError
from .check_inplace import InplaceCheck, check_inplace
from .compare import Closeness, bitwise_equal, compare_tensors
from .verify import Divergence, VerifyReport, verify

__all__ = [
    "Closeness",
    "Divergence",
    "InplaceCheck",
    "InplaceCheckError",
    "VerifyError",
    "VerifyReport",
    "bitwise_equal",
    "check_inplace",
    "compare_tensors",
    "verify",
]

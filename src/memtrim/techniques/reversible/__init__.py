"""Invertible blocks whose activation memory stays constant in depth."""

from .coupling import AdditiveCoupling, AffineCoupling
from .sequential import ReversibleError, ReversibleSequential

__all__ = ["AdditiveCoupling", "AffineCoupling", "ReversibleError", "ReversibleSequential"]

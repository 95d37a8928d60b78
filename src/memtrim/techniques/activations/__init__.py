"""Activation memory done right: a checker for in-place code, and activations that keep the least."""

from .check import InplaceCheck, InplaceCheckError, check_inplace

__all__ = ["InplaceCheck", "InplaceCheckError", "check_inplace"]

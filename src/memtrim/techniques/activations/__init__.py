"""Activation memory done right: a checker for in-place code, and activations that keep the least."""

from .check import InplaceCheck, InplaceCheckError, check_inplace
from .convert import Absorbed, Change, ConversionReport, ConvertError, Skipped, convert

__all__ = [
    "Absorbed", "Change", "ConversionReport", "ConvertError", "InplaceCheck", "InplaceCheckError", "Skipped",
    "check_inplace", "convert",
]

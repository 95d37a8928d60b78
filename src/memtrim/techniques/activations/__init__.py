"""Activation memory done right: a checker for in-place code, and activations that keep the least."""

from .check import InplaceCheck, InplaceCheckError, check_inplace
from .convert import Change, ConversionReport, Skipped, convert

__all__ = ["Change", "ConversionReport", "InplaceCheck", "InplaceCheckError", "Skipped", "check_inplace", "convert"]

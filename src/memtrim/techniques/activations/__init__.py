"""Activation memory done right: a checker for in-place code, activations that keep the least, and fused norms.

``memtrim.convert`` lives in ``memtrim.techniques.convert``."""

from ...proof import InplaceCheck, InplaceCheckError, check_inplace  # moved to memtrim.proof; kept importable here

__all__ = ["InplaceCheck", "InplaceCheckError", "check_inplace"]

"""Activations whose backward keeps the least (see NOTE [ what each activation keeps ]), and a max pool keeping
one-byte window offsets for its indices (NOTE [ compact max-pool indices ])."""

from .techniques.activations.functional import *  # noqa: F403
from .techniques.activations.functional import __all__ as _activations
from .techniques.pooling import max_pool2d

__all__ = [*_activations, "max_pool2d"]

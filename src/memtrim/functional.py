"""Activations whose backward keeps the least (see NOTE [ what each activation keeps ])."""

from .techniques.activations.functional import *  # noqa: F403
from .techniques.activations.functional import __all__  # noqa: F401

"""Module forms of :mod:`memtrim.functional`, drop-in for ``torch.nn``'s activations."""

from .techniques.activations.modules import *  # noqa: F403
from .techniques.activations.modules import __all__  # noqa: F401

"""memtrim's exception types.

Every error memtrim raises on purpose derives from :class:`MemtrimError`. Messages start with the API name,
say what was expected and what was found, and end with what to do.
"""

from __future__ import annotations

__all__ = [
    "MemtrimError",
    "InvalidInputError",
    "DeviceMismatchError",
    "DataError",
    "MissingDependencyError",
    "VerifyError",
    "ConvertError",
]


class MemtrimError(Exception):
    """Base class of every error memtrim raises on purpose."""


class InvalidInputError(MemtrimError, TypeError, ValueError):
    """An argument has the wrong type or value (also a ``TypeError`` and a ``ValueError``)."""


class DeviceMismatchError(InvalidInputError):
    """Tensors that must live on one device live on several."""


class DataError(MemtrimError, ValueError):
    """A data file is missing or does not hold what its format promises."""


class MissingDependencyError(MemtrimError, ImportError):
    """An optional package that this call needs is not installed."""


class VerifyError(MemtrimError):
    """A baseline and a transformed run could not be compared, or did not match (``assert_ok``)."""


class ConvertError(MemtrimError, RuntimeError):
    """A module converted by :func:`memtrim.convert` (or a ``memtrim.nn`` module) met a use it cannot serve: an
    in-place change of a tensor it keeps, or a second derivative through a rebuilt norm."""

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
    "MemtrimStateError",
    "OptimizerInBackwardError",
    "ReversibleError",
    "InplaceCheckError",
    "PlanError",
    "CheckpointPolicyError",
]


class MemtrimError(Exception):
    """Base class of every error memtrim raises on purpose."""


class InvalidInputError(MemtrimError, TypeError, ValueError):
    """An argument has the wrong type or value (also a ``TypeError`` and a ``ValueError``)."""


class MemtrimStateError(MemtrimError, RuntimeError):
    """An object is used in a state that does not allow the call (a single-use object used twice, a wrapper
    used again); the arguments themselves are fine, so this is not an :class:`InvalidInputError`."""


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


class OptimizerInBackwardError(MemtrimError, RuntimeError):
    """The training loop does something :class:`memtrim.OptimizerInBackward`'s in-backward step cannot do
    exactly."""


class ReversibleError(MemtrimError, RuntimeError):
    """A :class:`memtrim.ReversibleSequential` cannot reconstruct what backward needs."""


class InplaceCheckError(MemtrimError, AssertionError):
    """``InplaceCheck.assert_ok`` found problems (:func:`memtrim.check_inplace`)."""


class CheckpointPolicyError(MemtrimError, RuntimeError):
    """:func:`memtrim.checkpoint_modules`' selective ``policy`` cannot serve a module's forward exactly (it writes in
    place into an output the policy keeps). A ``RuntimeError``, not a ``TypeError``: raised inside an in-place op,
    a ``TypeError`` would make Python's ``out += x`` fall back to ``out = out + x``, silently."""


class PlanError(MemtrimError, RuntimeError):
    """:func:`memtrim.plan` found no combination of techniques that fits the budget; ``plans`` holds every plan
    it traced (``plans.rejected``, lowest peak first)."""

    def __init__(self, message: str, *, plans: object = None) -> None:
        super().__init__(message)
        self.plans = plans

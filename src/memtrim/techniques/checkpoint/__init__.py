"""Eager activation checkpointing: chosen submodules keep only their inputs and recompute the rest in backward,
optionally keeping the outputs of chosen ops (selective checkpointing). See NOTE [ checkpointed forward ] in
_core.py."""

from ._core import POLICIES, CheckpointHandle, checkpoint_modules, selective_available

__all__ = ["POLICIES", "CheckpointHandle", "checkpoint_modules", "selective_available"]

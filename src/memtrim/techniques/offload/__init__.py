"""Activation offloading: what autograd keeps for backward waits in host memory instead of on the accelerator."""

from ._core import OffloadActivations, OffloadHandle, offload_module

__all__ = ["OffloadActivations", "OffloadHandle", "offload_module"]

"""Optimizer state that takes less device memory: in host memory (``CPUOffloadOptimizer``)."""

from ._offload import CPUOffloadOptimizer

__all__ = ["CPUOffloadOptimizer"]

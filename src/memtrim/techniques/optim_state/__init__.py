"""Optimizer state that takes less device memory: in host memory (``CPUOffloadOptimizer``), or in fewer bits
(``LowBitAdamW``)."""

from ._lowbit import LowBitAdamW
from ._offload import CPUOffloadOptimizer

__all__ = ["CPUOffloadOptimizer", "LowBitAdamW"]

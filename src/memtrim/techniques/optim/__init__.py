"""The optimizer step fused into backward."""

from .in_backward import OptimizerInBackward, OptimizerInBackwardError

__all__ = ["OptimizerInBackward", "OptimizerInBackwardError"]

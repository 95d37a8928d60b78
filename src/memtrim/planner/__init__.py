"""The planner: which of memtrim's techniques make a training step fit a memory budget, and at what cost.

``memtrim.plan`` traces the step once per combination of techniques on fake tensors (no weight or activation is
allocated) through memtrim's own tracker, and ranks the combinations that fit by a FLOP-and-bytes time model.
"""

from ._cost import DeviceCost, calibrate, device_cost
from ._techniques import (
    TECHNIQUES,
    BlockClasses,
    Blocks,
    Technique,
    block_candidates,
    blocks_name,
    class_names,
    qualified,
    repeated_block,
)
from ._trace import Loop, StepTrace, trace_step
from .api import Plan, Plans, combinations, parse_bytes, plan

__all__ = [
    "TECHNIQUES",
    "BlockClasses",
    "Blocks",
    "DeviceCost",
    "Loop",
    "Plan",
    "Plans",
    "StepTrace",
    "Technique",
    "block_candidates",
    "blocks_name",
    "class_names",
    "calibrate",
    "combinations",
    "device_cost",
    "parse_bytes",
    "plan",
    "qualified",
    "repeated_block",
    "trace_step",
]

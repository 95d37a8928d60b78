"""memtrim: train neural networks in less memory, with every saving measured and every change proven.

The whole public API is re-exported here. ``memtrim.nn`` and ``memtrim.functional`` (lean activations and fused
norms) are submodules, deliberately left out of ``__all__`` so that ``from memtrim import *`` never shadows
``torch.nn``.
"""

from . import data, models
from . import functional as functional  # submodules outside __all__ (see the docstring)
from . import nn as nn
from .errors import (
    CheckpointPolicyError,
    ConvertError,
    DataError,
    DeviceMismatchError,
    InplaceCheckError,
    InvalidInputError,
    MemtrimError,
    MemtrimStateError,
    MissingDependencyError,
    OptimizerInBackwardError,
    PlanError,
    ReversibleError,
    VerifyError,
)
from .measure import (
    CATEGORIES,
    PHASES,
    Category,
    MemoryReport,
    OpMemory,
    TimelineEvent,
    Tracker,
    autograd_graph_bytes,
    format_bytes,
    measure_step,
    op_memory,
    plot_curves,
    track,
)
from .planner import Plan, Plans, plan
from .proof import Divergence, InplaceCheck, VerifyReport, check_inplace, verify
from .techniques.checkpoint import CheckpointHandle, checkpoint_modules
from .techniques.convert import (
    Absorbed,
    Candidate,
    Change,
    ConversionReport,
    ModelTrace,
    RecomputeHandle,
    Skipped,
    convert,
    recompute_modules,
    register_rule,
    registered_rules,
    unregister_rule,
)
from .techniques.offload import OffloadActivations, OffloadHandle, offload_module
from .techniques.optim import OptimizerInBackward
from .techniques.optim_state import CPUOffloadOptimizer, LowBitAdamW
from .techniques.reversible import AdditiveCoupling, AffineCoupling, ReversibleSequential

__version__ = "0.1.0"

__all__ = [
    "Absorbed",
    "AdditiveCoupling",
    "AffineCoupling",
    "CATEGORIES",
    "CPUOffloadOptimizer",
    "Candidate",
    "Category",
    "Change",
    "CheckpointHandle",
    "CheckpointPolicyError",
    "ConversionReport",
    "ConvertError",
    "PHASES",
    "DataError",
    "Divergence",
    "DeviceMismatchError",
    "InplaceCheck",
    "InplaceCheckError",
    "InvalidInputError",
    "LowBitAdamW",
    "MemoryReport",
    "MemtrimError",
    "MemtrimStateError",
    "MissingDependencyError",
    "ModelTrace",
    "OffloadActivations",
    "OffloadHandle",
    "OpMemory",
    "OptimizerInBackward",
    "OptimizerInBackwardError",
    "Plan",
    "PlanError",
    "Plans",
    "ReversibleError",
    "RecomputeHandle",
    "ReversibleSequential",
    "Skipped",
    "TimelineEvent",
    "Tracker",
    "VerifyError",
    "VerifyReport",
    "format_bytes",
    "measure_step",
    "autograd_graph_bytes",
    "check_inplace",
    "checkpoint_modules",
    "convert",
    "recompute_modules",
    "data",
    "models",
    "offload_module",
    "op_memory",
    "plan",
    "plot_curves",
    "register_rule",
    "registered_rules",
    "unregister_rule",
    "track",
    "verify",
]

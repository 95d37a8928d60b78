"""Where training memory goes: the tracker, one-call measurements and reports."""

from .api import OpMemory, measure_step, op_memory
from .graph import autograd_graph_bytes
from .report import CATEGORIES, PHASES, MemoryReport, TimelineEvent, format_bytes
from .tracker import Tracker, track

__all__ = [
    "CATEGORIES",
    "PHASES",
    "MemoryReport",
    "OpMemory",
    "TimelineEvent",
    "autograd_graph_bytes",
    "Tracker",
    "format_bytes",
    "measure_step",
    "op_memory",
    "track",
]

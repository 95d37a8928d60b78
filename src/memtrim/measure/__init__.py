"""Where training memory goes: the tracker, one-call measurements and reports; :mod:`.hooks` is the seam
techniques report to."""

from . import hooks
from .api import OpMemory, measure_step, op_memory
from .graph import autograd_graph_bytes
from .plots import plot_curves, pyplot
from .report import CATEGORIES, PHASES, Category, MemoryReport, TimelineEvent, format_bytes
from .tracker import Tracker, track

__all__ = [
    "CATEGORIES",
    "PHASES",
    "Category",
    "MemoryReport",
    "OpMemory",
    "TimelineEvent",
    "autograd_graph_bytes",
    "Tracker",
    "format_bytes",
    "hooks",
    "measure_step",
    "op_memory",
    "plot_curves",
    "pyplot",
    "track",
]

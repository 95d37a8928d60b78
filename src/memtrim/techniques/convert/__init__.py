"""``memtrim.convert``: a rule registry that swaps in modules keeping less for backward, matched on traced evidence.

Public names are re-exported by ``memtrim``; see NOTE [ how convert decides ] in api.py.
"""

from ...errors import ConvertError
from .api import convert
from .builtin import Absorbed
from .evidence import CallSite, Holder, ModelTrace, Op, Storage
from .report import Change, ConversionReport, Skipped
from .rules import Candidate, Context, Rule, register_rule, registered_rules, unregister_rule
from .selective import RecomputeHandle, recompute_modules

__all__ = [
    "Absorbed", "CallSite", "Candidate", "Change", "Context", "ConversionReport", "ConvertError", "Holder",
    "ModelTrace", "Op", "RecomputeHandle", "Rule", "Skipped", "Storage", "convert", "recompute_modules",
    "register_rule", "registered_rules", "unregister_rule",
]

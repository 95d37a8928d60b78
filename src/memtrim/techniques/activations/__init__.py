"""Activations that keep the least for backward: the output, a 1-bit mask, or (only where unavoidable) the input
(``functional.py``: ``memtrim.functional``; ``modules.py``: their module forms in ``memtrim.nn``), and
:class:`ActLinear`, an activation fused into the Linear after it that keeps only the activation's input
(``act_linear.py``). See NOTE [ what each activation keeps ] in functional.py."""

from .act_linear import ActLinear
from .functional import softplus_keeps_output

__all__ = ["ActLinear", "softplus_keeps_output"]

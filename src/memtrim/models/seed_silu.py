"""The seed article's hand-written in-place SiLUs, quoted exactly, and the second one corrected.

Why they live in the library: they are the worked example of :func:`memtrim.check_inplace` (the demo checks them,
the tests check the checker on them), so they have one home. None is meant for training: the first computes
``sigmoid(x) ** 2`` and the second's backward fails; use ``torch.nn.functional.silu``.
"""

from __future__ import annotations

import torch

__all__ = ["silu_inplace_1", "silu_inplace_2", "silu_inplace_2_corrected"]


def silu_inplace_1(input: torch.Tensor) -> torch.Tensor:
    """The seed article's first in-place SiLU: returns ``sigmoid(x) ** 2`` (``sigmoid_`` overwrote ``input``
    before the product read it) and overwrites its caller's tensor; ``gradcheck`` alone passes it."""
    return input * torch.sigmoid_(input)


def silu_inplace_2(input: torch.Tensor) -> torch.Tensor:
    """The seed article's second in-place SiLU, quoted exactly: right values, but backward raises (sigmoid_ keeps
    its output for backward and ``*=`` overwrites it)."""
    result = input.clone()
    torch.sigmoid_(input)
    input *= result
    return input


def silu_inplace_2_corrected(input: torch.Tensor) -> torch.Tensor:
    """The seed's second SiLU corrected: ``sigmoid_`` on the copy, whose output nothing overwrites."""
    result = input.clone()
    torch.sigmoid_(result)
    input *= result
    return input

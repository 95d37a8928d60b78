"""What the argument checks of several public functions share (memtrim.verify, memtrim.plan)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch


def accepts(fn: Callable[..., Any], arity: int) -> bool:
    """Whether ``fn`` can be called with ``arity`` positional arguments (True where the signature is unknown)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        signature.bind(*([None] * arity))
    except TypeError:
        return False
    return True


def not_owned(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
              copies_allowed: bool = False) -> list[torch.Tensor]:
    """The parameters ``optimizer`` steps that are not ``model``'s (by identity): an optimizer built from a model
    captured from outside, instead of the one a factory is given. ``copies_allowed``: none for memtrim's own
    optimizers, which may step host copies of the parameters (``CPUOffloadOptimizer``)."""
    if copies_allowed and type(optimizer).__module__.startswith("memtrim."):
        return []
    owned = {id(p) for p in model.parameters()}
    return [p for group in optimizer.param_groups for p in group["params"] if id(p) not in owned]

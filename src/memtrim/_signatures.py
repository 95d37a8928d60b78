"""What the argument checks of several public functions share (memtrim.verify, memtrim.plan)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


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

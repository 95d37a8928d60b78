"""A forward set on one module instance (checkpointing, offloading): ``InstanceForward``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["InstanceForward"]


class InstanceForward:
    """``fn`` bound to ``module`` as its ``forward``, like ``types.MethodType(fn, module)`` (``__func__``,
    ``__self__``; ``copy.deepcopy`` of the model binds it to the copy), that also pickles: a bound method pickles as
    ``getattr(module, fn.__name__)``, which a module-level ``fn`` is not, so ``torch.load`` of a ``torch.save(model)``
    failed. This pickles as ``fn`` (by its qualified name) and the module."""

    __slots__ = ("__func__", "__self__")

    def __init__(self, fn: Callable[..., Any], module: nn.Module) -> None:
        self.__func__ = fn
        self.__self__ = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return InstanceForward, (self.__func__, self.__self__)

    def __repr__(self) -> str:
        return f"<memtrim forward {self.__func__.__name__} of {type(self.__self__).__name__}>"

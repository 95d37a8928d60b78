"""What the argument handling of several public functions shares (memtrim.verify, memtrim.plan,
memtrim.measure_step)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from .errors import InvalidInputError


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


def not_owned(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` trains that are not ``model``'s (by identity): an optimizer built from a model
    captured from outside, instead of the one a factory is given. An optimizer that steps host copies of the
    parameters (``CPUOffloadOptimizer``) names the parameters it trains with ``device_parameters()``."""
    owned = {id(p) for p in model.parameters()}
    device_parameters = getattr(optimizer, "device_parameters", None)
    trained = (device_parameters() if callable(device_parameters)
               else [p for group in optimizer.param_groups for p in group["params"]])
    return [p for p in trained if id(p) not in owned]


def call_model(model: torch.nn.Module, inputs: Any) -> Any:
    """``model(inputs)``, ``model(*inputs)`` for a tuple or list, ``model(**inputs)`` for a dict."""
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def scalar_loss(api: str, loss: Any) -> torch.Tensor:
    """``loss`` if it is a one-element tensor, else the error that says what ``loss_fn`` returned and what to do."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    found = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise InvalidInputError(
        f"{api}: loss_fn(output, targets) must return a scalar tensor, got {found}. Reduce it (mean or sum) and "
        "return the tensor itself (no .item(): backward needs it)."
    )

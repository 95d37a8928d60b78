"""One-call measurements built on the tracker: :func:`op_memory` and :func:`measure_step`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._signatures import scalar_loss
from ..errors import DeviceMismatchError, InvalidInputError
from .hooks import tensors_in
from .report import Category, MemoryReport
from .tracker import _allocator_module, track

__all__ = ["OpMemory", "op_memory", "measure_step"]


@dataclass(frozen=True)
class OpMemory:
    """Memory of one call, relative to the state just before it.

    ``allocated_bytes``: bytes of storages the call created that are still alive after it (its result).
    ``peak_bytes``: the highest extra live bytes at any moment during the call.
    On an accelerator (CUDA, XPU, ...), ``allocator_*`` repeat both from its caching allocator (its peak reset
    first).
    """

    allocated_bytes: int
    peak_bytes: int
    result: Any
    device: str
    allocator_allocated_bytes: int | None = None
    allocator_peak_bytes: int | None = None


def op_memory(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> OpMemory:
    """Measure the memory one call of ``fn(*args, **kwargs)`` allocates and peaks at, on any device.

    Why: the common recipe reads ``torch.cuda.max_memory_allocated`` around a call without resetting it and
    reports stale figures (or nothing at all on CPU). This counts the call's own storages exactly.

    Example::

        x = torch.randn(10000, 10000)
        memtrim.op_memory(torch.relu, x).allocated_bytes   # 400_000_000
        memtrim.op_memory(torch.relu_, x).allocated_bytes  # 0

    Raises:
        InvalidInputError: ``fn`` is not callable.
    """
    if not callable(fn):
        raise InvalidInputError(f"memtrim.op_memory: fn must be callable, got {type(fn).__name__}.")
    tensors = list(tensors_in((args, kwargs)))
    # the first argument on an accelerator whose caching allocator keeps peaks (CUDA, XPU, ...)
    accelerator = next((t.device for t in tensors if _allocator_module(t.device) is not None), None)
    allocator = _allocator_module(accelerator) if accelerator is not None else None
    base = 0
    if allocator is not None:
        allocator.synchronize(accelerator)
        allocator.reset_peak_memory_stats(accelerator)
        base = allocator.memory_allocated(accelerator)
    with track() as tracker:
        for tensor in tensors:
            tracker.label(tensor, Category.INPUTS)
        result = fn(*args, **kwargs)
    allocator_allocated = allocator_peak = None
    if allocator is not None:
        allocator.synchronize(accelerator)
        allocator_allocated = allocator.memory_allocated(accelerator) - base
        allocator_peak = allocator.max_memory_allocated(accelerator) - base
    device = str(tensors[0].device) if tensors else None
    report = tracker.report(device)
    start = report.timeline[0].total_bytes
    return OpMemory(
        allocated_bytes=report.final_bytes - start,
        peak_bytes=report.peak_bytes - start,
        result=result,
        device=report.device,
        allocator_allocated_bytes=allocator_allocated,
        allocator_peak_bytes=allocator_peak,
    )


def measure_step(
    model: torch.nn.Module,
    inputs: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor],
    targets: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
) -> MemoryReport:
    """The :class:`MemoryReport` of one training step: forward, loss, backward, ``optimizer.step()``,
    ``optimizer.zero_grad()``.

    Args:
        model: the module; called as ``model(inputs)`` (or ``model(*inputs)`` for a tuple or list).
        inputs, targets: the batch, on the model's device.
        loss_fn: ``loss_fn(model_output, targets)`` returns a scalar tensor.
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.

    Raises:
        InvalidInputError: a non-tensor input or target, a loss_fn that is not callable, or an optimizer that
            is not a ``torch.optim.Optimizer``.
        DeviceMismatchError: the batch and the model live on different devices.
    """
    check_training_args("memtrim.measure_step", model, inputs, targets, loss_fn, optimizer)
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    with track(model, optimizer) as tracker:
        tracker.label(targets, Category.INPUTS)
        for tensor in args:
            tracker.label(tensor, Category.INPUTS)
        loss = scalar_loss("memtrim.measure_step", loss_fn(model(*args), targets))
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker.report()


def check_training_args(
    api: str, model: Any, inputs: Any, targets: Any, loss_fn: Any, optimizer: Any
) -> None:
    """Raise a clear memtrim error for the usual mistakes in (model, batch, loss_fn, optimizer)."""
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"{api}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if isinstance(inputs, dict):  # (HF's model(**batch): track() and plan() take it; this step's signature does not)
        raise InvalidInputError(
            f"{api}: inputs must be a tensor or a tuple of tensors (model(inputs) or model(*inputs)), got a dict. "
            "For a model called with keywords (model(**batch)), measure your own step: with memtrim.track(model, "
            "optimizer) as tracker: ...; tracker.report().")
    args = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
    for i, value in enumerate((*args, targets)):
        if not isinstance(value, torch.Tensor):
            what = "targets" if i == len(args) else "inputs"
            raise InvalidInputError(
                f"{api}: {what} must be tensors, got {type(value).__name__}. Convert the batch with "
                "torch.as_tensor(...) (and put it on the model's device) first."
            )
    if not callable(loss_fn):
        raise InvalidInputError(f"{api}: loss_fn must be callable, got {type(loss_fn).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"{api}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}. Build it "
            "first, e.g. torch.optim.Adam(model.parameters())."
        )
    param = next(model.parameters(), None)
    if param is not None:
        for value in (*args, targets):
            if value.device != param.device:
                raise DeviceMismatchError(
                    f"{api}: the model is on {param.device} but a batch tensor is on {value.device}. Move "
                    f"the batch with .to('{param.device}') (or the model with model.to(...))."
                )

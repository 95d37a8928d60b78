"""Gradients that a wrapper keeps in another tensor's ``.grad`` (``CPUOffloadOptimizer``: its host copies).

NOTE [ gradients held elsewhere ]
A wrapper that moves each gradient off its parameter as soon as autograd accumulates it registers the parameter
here with the tensor now holding its gradient (:func:`hold_gradient_elsewhere`). The standard loop's own calls then
reach the gradient where it is, as they reach ``param.grad`` without the wrapper:

* ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` on the parameters clip the holders in their place (the
  clip guard of :mod:`memtrim.techniques.optim.in_backward` asks :func:`holder_of`): the same norm over the same
  values, scaling the gradients the step will use. Without it they found no gradient, returned 0.0 and clipped
  nothing.
* ``model.zero_grad()`` clears the holders of the model's parameters too (``nn.Module.zero_grad`` is wrapped while
  any parameter is registered). Without it the device gradients it would clear were already gone, the host ones
  stayed, and the next step used the sum of every step's gradients.

* Where a gradient is in two places (a wrapper that moves gradients only when asked, asked between two
  micro-batches: the first part waits in the holder, the later ones accumulated on the parameter), the clip first
  adds the parameter's part to the holder's (:func:`gather_gradient`), as the step would: it measures and clips the
  whole gradient, not the last micro-batches'.

Not seen: a hand-written ``param.grad = None`` (no hook exists for it): use ``opt.zero_grad()`` or
``model.zero_grad()`` with such a wrapper.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["add_to_holder", "gather_gradient", "hold_gradient_elsewhere", "holder_of", "held_gradients",
           "registered_holder", "used_by_a_step", "wait_for_copies"]

_HOLDERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> the tensor whose .grad is its gradient
_original_zero_grad: Any = None
_IN_FLIGHT: set[torch.device] = set()  # devices with an asynchronous copy to a holder not waited for yet


def hold_gradient_elsewhere(param: torch.Tensor, holder: torch.Tensor | None) -> None:
    """From now on ``param``'s gradient lands in ``holder.grad`` (``holder`` None: on ``param`` again). See
    NOTE [ gradients held elsewhere ]."""
    if holder is None:
        _HOLDERS.pop(param, None)
        return
    _HOLDERS[param] = holder
    _install_zero_grad_guard()
    from .in_backward import install_clip_guard  # in_backward's clip guard asks holder_of (it imports this module)

    install_clip_guard()


def registered_holder(param: torch.Tensor) -> torch.Tensor | None:
    """The tensor registered to hold ``param``'s gradient, whether or not it holds one now."""
    return _HOLDERS.get(param)


def holder_of(param: Any) -> torch.Tensor | None:
    """The tensor holding ``param``'s gradient in its place (None where ``param`` holds its own, or has one now)."""
    if not _HOLDERS or not isinstance(param, torch.Tensor) or param.grad is not None:
        return None
    holder = _HOLDERS.get(param)
    if holder is not None:
        wait_for_copies()  # the caller reads its gradient
    return holder


def add_to_holder(holder: torch.Tensor, grad: torch.Tensor) -> None:
    """Accumulate ``grad`` into ``holder.grad`` (moved to the holder's device), as autograd accumulates."""
    if holder.grad is None:  # an asynchronous copy from an accelerator: read only after wait_for_copies()
        asynchronous = grad.device.type == "cuda" and holder.device.type == "cpu"
        holder.grad = grad.to(holder.device, non_blocking=asynchronous)
        if asynchronous:
            _IN_FLIGHT.add(grad.device)
    else:  # added at once on the host: copied synchronously (an asynchronous copy could still be in flight)
        holder.grad.add_(grad.to(holder.device))


def wait_for_copies() -> None:
    """Block until every asynchronous copy :func:`add_to_holder` started has arrived: a host gradient read before
    would be read while the copy may still write it. Every reader of the holders calls this first."""
    while _IN_FLIGHT:
        torch.cuda.synchronize(_IN_FLIGHT.pop())


@torch.no_grad()
def gather_gradient(param: Any) -> None:
    """Where part of ``param``'s gradient waits in its holder and part on ``param`` itself, add the part on
    ``param`` to the holder's and free it (NOTE [ gradients held elsewhere ])."""
    if not _HOLDERS or not isinstance(param, torch.Tensor) or param.grad is None:
        return
    holder = _HOLDERS.get(param)
    if holder is None or holder.grad is None or holder.shape != param.shape or holder.dtype != param.dtype:
        return
    wait_for_copies()
    add_to_holder(holder, param.grad)
    param.grad = None


def held_gradients() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, holder) for each gradient that waits in its holder now, in place of its parameter's, and that no
    step has used yet (one used already is the standard loop's gradient after ``step()``, which ``zero_grad()``
    discards)."""
    return [(param, holder) for param, holder in list(_HOLDERS.items())
            if holder.grad is not None and param.grad is None and not _used(holder)]


_USED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # holder -> (its gradient, weakly; that gradient's version) a
                                                     # step used


def used_by_a_step(holders: Any) -> None:
    """Record that a step used the gradients these holders hold now (a later backward adds to one in place: its
    version moves, and it waits again)."""
    for holder in holders:
        if holder.grad is not None:
            _USED[holder] = (weakref.ref(holder.grad), holder.grad._version)


def _used(holder: torch.Tensor) -> bool:
    found = _USED.get(holder)
    return found is not None and found[0]() is holder.grad and found[1] == holder.grad._version


def _install_zero_grad_guard() -> None:
    global _original_zero_grad
    if _original_zero_grad is not None:
        return
    _original_zero_grad = original = torch.nn.Module.zero_grad

    @functools.wraps(original)
    def zero_grad(self: torch.nn.Module, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        if not _HOLDERS:
            return
        wait_for_copies()  # no copy may land in a gradient after it was cleared
        for param in self.parameters():
            holder = _HOLDERS.get(param)
            if holder is not None and holder.grad is not None:
                if set_to_none:
                    holder.grad = None
                else:
                    holder.grad.detach_().zero_()  # as nn.Module.zero_grad does to a gradient it keeps

    torch.nn.Module.zero_grad = zero_grad  # type: ignore[method-assign]

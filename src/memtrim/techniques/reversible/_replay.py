"""What a function's forward ran under, captured so that its recomputation in backward draws the same numbers.

The random-number and autocast state are captured with ``torch.utils.checkpoint``'s own device-generic helpers
(``get_device_states`` / ``set_device_states``, the autocast kwargs with ``cache_enabled``), for the CPU and the
accelerator the input lives on, whatever its type; draws from explicitly passed generators are recorded by a
torch-function mode (``techniques/_generators.py``). See NOTE [ reversible without backward inside backward ] in
``sequential.py``.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

from ...errors import ReversibleError
from .._generators import GeneratorDraws

# ``set_device_states(..., device_type=)`` is torch >= 2.5; torch 2.4's sets the default device type's (CUDA).
_SET_TAKES_DEVICE_TYPE = "device_type" in inspect.signature(set_device_states).parameters


def _draws(where: str, replay: list[torch.Tensor] | None = None, strict: bool = True,
           changes: list[int] | None = None) -> GeneratorDraws:
    return GeneratorDraws(f"memtrim.ReversibleSequential: {where}", "keep this module out of the reversible stack",
                          ReversibleError, replay, strict, changes)


def _autocast_kwargs(device_type: str) -> dict[str, Any]:
    """``torch.autocast`` arguments reproducing the current state for ``device_type`` (as checkpoint's)."""
    return {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
            "cache_enabled": torch.is_autocast_cache_enabled()}


def _autocast_available(device_type: str) -> bool:
    available = getattr(torch.amp, "is_autocast_available", None)  # torch >= 2.4.1; CPU and CUDA before
    return available(device_type) if available is not None else device_type in ("cpu", "cuda")


@dataclass
class Replay:
    """What the forward of one function (f, g, or a whole block) ran under (``device_rng`` None on the CPU)."""

    where: str  # names the function in errors ("block 3's f")
    requires_grad: bool  # whether its input required grad (so the recomputation saves the same tensors)
    cpu_rng: torch.Tensor | None
    device_type: str  # of the input: "cpu", "cuda", "xpu", ...
    device_ids: list[int]
    device_rng: list[torch.Tensor] | None
    autocast: dict[str, dict[str, Any]] = field(default_factory=dict)  # device type -> torch.autocast kwargs
    generator_states: list[torch.Tensor] | None = None
    layout: tuple[tuple[int, ...], int] = ((), 0)  # the input's strides and storage offset (see :func:`as_forward`)
    changes: list[int] | None = None  # the changes of the global generators in the forward (GeneratorDraws.changes)


def as_forward(x: torch.Tensor, replay: Replay) -> torch.Tensor:
    """``x`` (a rebuilt input, detached) laid out as the forward's input was: the same strides at the same storage
    offset, copied into a fresh storage where its own layout differs. An op may save other tensors, in another order,
    for another layout (torch's linear on a 3-D input that is not contiguous, as a chunk of the input is), and the
    recomputation's saved tensors are matched to the forward's by order."""
    stride, offset = replay.layout
    if x.stride() == stride and x.storage_offset() == offset:
        return x
    extent = offset + 1 + sum((size - 1) * step for size, step in zip(x.shape, stride) if size > 0)
    storage = x.new_empty(extent if x.numel() else offset)
    # an expanded input (stride 0: one row read for every index of that dimension) is written from its first row
    # along such dimensions: the rows were one in forward, and their rebuilds the same arithmetic on the same values
    first = x
    for dim, (size, step) in enumerate(zip(x.shape, stride)):
        if step == 0 and size > 1:
            first = first.narrow(dim, 0, 1)
    with torch.no_grad():
        storage.as_strided(first.shape, stride, offset).copy_(first)
    return storage.as_strided(x.shape, stride, offset)


@contextmanager
def captured(replays: dict[str, Replay], name: str, x: torch.Tensor, where: str) -> Iterator[GeneratorDraws]:
    """Around a function's forward (reading ``x``): record in ``replays[name]`` what its recomputation must replay.

    The generators' states are kept and replayed whether or not the function changed them: one that draws and puts
    the state back (under ``torch.random.fork_rng``, as Megatron's RNG tracker does) leaves it unchanged, and its
    recomputation, not replayed, drew from wherever backward found the state (gradients 119 off, silently; found by
    an adversarial pass on 2026-12-02). Yields the mode recording the draws from explicit generators. A CPU state
    equal to the one captured last is shared (5,056 bytes each: a stack that draws nothing keeps one).
    """
    device_type = x.device.type
    # get_device_states reads no state from a CPU or meta tensor; skipped there (it costs ~20 us per f or g)
    on_accelerator = device_type not in ("cpu", "meta")
    device_ids, device_rng = get_device_states(x) if on_accelerator else ([], [])
    autocast = {d: _autocast_kwargs(d) for d in dict.fromkeys(("cpu", device_type)) if _autocast_available(d)}
    cpu_rng = _shared(torch.get_rng_state())
    replay = replays[name] = Replay(where=where, requires_grad=x.requires_grad, cpu_rng=cpu_rng,
                                    device_type=device_type, device_ids=device_ids,
                                    device_rng=device_rng if on_accelerator else None,
                                    autocast=autocast, layout=(x.stride(), int(x.storage_offset())))
    with _draws(where) as draws:
        yield draws
    replay.generator_states = draws.states or None
    replay.changes = draws.changes or None  # (none: nothing to compare)


_LAST = threading.local()  # .state: (the bytes of the CPU state captured last, that tensor)


def _shared(state: torch.Tensor) -> torch.Tensor:
    """``state`` (the CPU generator's), or the equal one captured last: compared as bytes, not an op, so a planner's
    fake mode (memtrim.plan runs the step on fake tensors) does not see it (torch.equal there raised)."""
    with torch._C._DisableTorchDispatch():
        data = bytes(state.numpy())
    last = getattr(_LAST, "state", None)
    if last is not None and last[0] == data:
        return last[1]
    _LAST.state = (data, state)
    return state


def _set_device_rng(replay: Replay, states: list[torch.Tensor]) -> None:
    if _SET_TAKES_DEVICE_TYPE:
        set_device_states(replay.device_ids, states, device_type=replay.device_type)
        return
    module = torch.get_device_module(replay.device_type)  # torch 2.4
    for device, state in zip(replay.device_ids, states):
        with module.device(device):
            module.set_rng_state(state)


@contextmanager
def replayed(replay: Replay, strict: bool = True) -> Iterator[None]:
    """Run under the forward's random-number and autocast state; restore the caller's generators after, as
    ``torch.random.fork_rng`` does (inlined: this runs twice per block in backward). ``strict=False`` for a
    block's ``inverse``, which need not draw what the forward drew."""
    cpu_state = torch.get_rng_state() if replay.cpu_rng is not None else None
    device_state = get_device_states(*_on(replay))[1] if replay.device_rng is not None else None
    if replay.cpu_rng is not None:
        torch.set_rng_state(replay.cpu_rng)
    if replay.device_rng is not None:
        _set_device_rng(replay, replay.device_rng)
    try:
        with contextlib.ExitStack() as stack:
            for device_type, kwargs in replay.autocast.items():
                if _autocast_kwargs(device_type) != kwargs:  # else already in it
                    stack.enter_context(torch.autocast(device_type, **kwargs))
            # a block's inverse (not strict) runs other calls than the forward: its draws are not compared
            changes = replay.changes if strict else None
            if replay.generator_states is not None or changes is not None:
                stack.enter_context(_draws(replay.where, replay.generator_states or [], strict, changes))
            yield
    finally:
        if cpu_state is not None:
            torch.set_rng_state(cpu_state)
        if device_state is not None:
            _set_device_rng(replay, device_state)


def _on(replay: Replay) -> list[torch.Tensor]:
    """An empty tensor on each device whose state was captured (what ``get_device_states`` reads devices from)."""
    return [torch.empty(0, device=torch.device(replay.device_type, i)) for i in replay.device_ids]

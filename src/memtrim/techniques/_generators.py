"""Draws from explicitly passed ``torch.Generator`` objects, recorded in a forward and replayed in its recomputation.

``torch.utils.checkpoint`` (and so :func:`memtrim.checkpoint_modules`) and :class:`memtrim.ReversibleSequential`
restore the global CPU and accelerator generators around a recomputation. A generator passed to an op explicitly
(``torch.rand(..., generator=self.gen)``, a module's own generator) is not reachable from outside the function, so
a torch-function mode (:class:`GeneratorDraws`) sees every torch call of the forward and records, per call given a
generator, that generator's state before the call; the recomputation sets each such call's generator to its recorded
state, in order, and puts every generator back after, so the same numbers are drawn and backward draws nothing.
Calls are matched by position, so a generator shared by several functions is replayed right. A torch-function mode
rather than a dispatch mode: a Python generator reaches an op only through a Python call (``torch.*``, a Tensor
method, ``torch.ops``), which the mode sees, and it costs about a quarter of a dispatch mode per op (measured: +25 us
vs +100 us per call of a Linear-ReLU-Linear on width 64). Code the mode cannot see (TorchScript) is not replayed.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import MemtrimError
from ..measure.hooks import tensors_in

__all__ = ["GeneratorDraws", "GeneratorsKept", "cuda_devices", "held_generators_kept", "seeded"]


class GeneratorDraws(TorchFunctionMode):
    """Records (forward) or replays (recomputation) the draws of every torch call given an explicit generator.

    Recording keeps, per such call in order, the generator's state before it (``states``). Replaying sets the
    generator of the ``k``-th such call to the ``k``-th recorded state; on exit every generator it touched is put
    back, latest first, so each ends where the caller left it. ``strict``: the replayed computation must draw exactly
    as often as the recorded one (a forward's recomputation that runs to its end), else ``error`` is raised, naming
    ``where`` (the API and the function) and ending with ``advice`` (what to do instead).
    """

    def __init__(self, where: str, advice: str, error: type[MemtrimError], replay: list[torch.Tensor] | None = None,
                 strict: bool = True) -> None:
        super().__init__()
        self.where, self.advice, self.error, self.replay, self.strict = where, advice, error, replay, strict
        self.states: list[torch.Tensor] = []  # recorded states (forward)
        self.restore: list[tuple[torch.Generator, torch.Tensor]] = []  # the caller's states (replay)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.Generator):
                continue
            if self.replay is None:
                self.states.append(value.get_state())
                continue
            position = len(self.restore)
            if position >= len(self.replay):
                if self.strict:
                    raise self._mismatch(f"more (at {getattr(func, '__name__', func)})")
                continue
            self.restore.append((value, value.get_state()))
            value.set_state(self.replay[position])
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        for generator, state in reversed(self.restore):
            generator.set_state(state)
        super().__exit__(*exc)
        if exc[0] is None and self.replay is not None and self.strict and len(self.restore) != len(self.replay):
            raise self._mismatch(str(len(self.restore)))

    def replaying(self, strict: bool = True) -> GeneratorDraws:
        """A mode replaying what this one recorded."""
        return GeneratorDraws(self.where, self.advice, self.error, self.states, strict)

    def _mismatch(self, found: str) -> MemtrimError:
        return self.error(
            f"{self.where} drew from an explicitly passed torch.Generator {len(self.replay or ())} time(s) in forward "
            f"but {found} when recomputed in backward; it must compute the same function again. Draw the same numbers "
            f"in every call (no draws that depend on a call count), or {self.advice}."
        )


class GeneratorsKept(TorchFunctionMode):
    """Every ``torch.Generator`` passed to a torch call inside is put back on exit to its state before its first such
    call: :func:`memtrim.convert`'s traces and measurements run the model's forward, and must leave a model's own
    generator (``torch.rand(..., generator=self.gen)``) where it was, as they leave the global ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator) and id(value) not in self.first:
                self.first[id(value)] = (value, value.get_state())
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for generator, state in self.first.values():
                generator.set_state(state)


# ---------------------------------------------------------------------- the forwards memtrim.convert runs
def cuda_devices(model: nn.Module, inputs: Any) -> list[int]:
    """The CUDA devices the model and the example inputs live on: their RNG is saved and restored around tracing."""
    found = {t.device.index or 0 for t in (*model.parameters(), *model.buffers(), *tensors_in(inputs))
             if t.device.type == "cuda"}
    return sorted(found)


_HELD = threading.local()  # .put_back: what puts the model convert runs back to its generators' states at the call


@contextlib.contextmanager
def held_generators_kept(model: nn.Module) -> Iterator[None]:
    """Every random generator a module of ``model`` holds (:func:`_held_generators`) is put back on exit to its state
    now, and :func:`seeded` starts each forward inside from that state. convert's forwards drew from them and left
    them advanced, so the converted model trained on other draws than the plain one (1.1e-3 off after 4 steps; found
    by an adversarial pass)."""
    put_back, outer = _held_generators(model), getattr(_HELD, "put_back", ())
    _HELD.put_back = put_back
    try:
        yield
    finally:
        _HELD.put_back = outer
        for back in put_back:
            back()


@contextlib.contextmanager
def seeded(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Every forward convert runs (the trace, each measurement, each check) draws from the same seeds: torch's
    generators (the global one and those of the CUDA devices the model or inputs are on, restored after), Python's
    ``random`` and NumPy's (restored by convert's ``as_training``, around it all), and the model's own from where
    they were at convert's call (:func:`held_generators_kept`). A forward that draws its path (HF's LayerDrop skips
    layers by ``torch.rand``; MusicGen by ``random``, Wav2Vec2's adapter by NumPy) then takes one path in all of them:
    a trace under the caller's state took another than the measurements, which found the layers it skipped saving
    nothing and converted otherwise at each caller's seed (found by an adversarial pass)."""
    devices = cuda_devices(model, (args, kwargs))
    with torch.random.fork_rng(devices=devices):
        # not torch.manual_seed: it seeds every CUDA device, and only these are restored after
        torch.default_generator.manual_seed(0)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(0)
        random.seed(0)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(0)
        for back in getattr(_HELD, "put_back", ()):
            back()
        yield


def _held_generators(model: nn.Module) -> list[Callable[[], Any]]:
    """For each random generator a module of ``model`` holds (a ``torch.Generator``, a ``random.Random``, a NumPy
    ``Generator`` or ``RandomState``: a model's own random scale or drop path; :func:`_held`), what puts it back to
    its state now."""
    numpy = sys.modules.get("numpy")
    found: list[Callable[[], Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        for value in _held(module):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, random.SystemRandom):  # (no state: it draws from the system)
                continue
            if isinstance(value, torch.Generator):
                found.append(functools.partial(value.set_state, value.get_state()))
            elif isinstance(value, random.Random):
                found.append(functools.partial(value.setstate, value.getstate()))
            elif numpy is not None and isinstance(value, numpy.random.Generator):
                found.append(functools.partial(setattr, value.bit_generator, "state", value.bit_generator.state))
            elif numpy is not None and isinstance(value, numpy.random.RandomState):
                found.append(functools.partial(value.set_state, value.get_state()))
    return found


def _held(module: nn.Module) -> Iterator[Any]:
    """What ``module`` holds where a generator is kept: its attributes, its class's (up to ``nn.Module``), and one
    level inside those that are lists, tuples, dicts or plain objects (``self.rngs = {"scale": rng}``, a helper
    holding ``self.rng``); not what a property returns or a global."""
    found = list(vars(module).values())
    for klass in type(module).__mro__:
        if klass is nn.Module:
            break
        found += [v for v in vars(klass).values() if not callable(v)]
    for value in found:
        yield value
        if isinstance(value, dict):
            yield from value.values()
        elif isinstance(value, (list, tuple)):
            yield from value
        elif (not isinstance(value, (nn.Module, torch.Tensor, type)) and hasattr(value, "__dict__")
                and type(value).__module__ not in ("builtins", "functools")):
            yield from vars(value).values()

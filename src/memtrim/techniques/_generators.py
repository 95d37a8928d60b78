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

import torch
from torch.overrides import TorchFunctionMode

from ..errors import MemtrimError

__all__ = ["GeneratorDraws", "GeneratorsKept"]


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

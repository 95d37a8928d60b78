"""Modules' training flags and plain attributes, recorded and set again: a recomputation in backward
(checkpoint_modules, ReversibleSequential) runs with the flags and attributes its forward had (an evaluation pass
between a forward and its backward, ``model.eval()`` then ``no_grad``, turns the flags off; a loop anneals a
temperature), and convert's traces leave every module's flag as they found it (``model.train(mode)`` alone sets them
all: a frozen BatchNorm in a training model). Also: whether such a recomputation, which puts its modules' buffers back
itself, is running on this thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

from .guards import FUSION

__all__ = ["SCRIPTED", "CachedParametrizations", "Settings", "Swaps", "TrainingFlags", "buffers_put_back",
           "plain_settings", "put_settings", "putting_buffers_back", "scripted_inside", "set_training_flags",
           "training_flags", "undo_swaps", "written_in_place"]

_local = threading.local()  # .depth: recomputations that put their buffers back, running on this thread


@contextlib.contextmanager
def buffers_put_back() -> Iterator[None]:
    """Around a recomputation in backward that puts back its modules' buffers itself (ReversibleSequential rewinds
    them to what its forward read, then restores the forward's updates): OptimizerInBackward's measuring pass must not
    take what it sees there for the buffers to put back (:func:`putting_buffers_back`)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def putting_buffers_back() -> bool:
    """Whether a :func:`buffers_put_back` recomputation runs on this thread."""
    return getattr(_local, "depth", 0) > 0

TrainingFlags = list[tuple[nn.Module, bool]]


def training_flags(modules: Iterable[nn.Module]) -> TrainingFlags:
    """Each module with its ``training`` flag now."""
    return [(m, m.training) for m in modules]


def set_training_flags(flags: TrainingFlags) -> None:
    """Set each module's ``training`` flag as recorded (the flag itself: no module's ``train()`` runs)."""
    for module, training in flags:
        if module.training != training:  # (nn.Module.__setattr__ per module otherwise: this runs per call)
            module.training = training


Setting = tuple[nn.Module, dict[str, Any], dict[str, Any], list[tuple[str, int]]]
"""One module's record (:func:`plain_settings`): the module, its attributes, its children, and its tensor attributes'
versions (a tuple, not a class: this is built for every module of a checkpointed call)."""
Settings = list[Setting]
Swaps = list[tuple[dict[str, Any], Any, Any]]  # (table, name or _WHOLE, value then)

_TORCHS_OWN = frozenset(nn.Module().__dict__)  # the training flag (training_flags') and torch's tables: the
# parameters and buffers (their callers put back the forward's), the children (recorded apart), the hooks
_PLAIN = frozenset({int, float, bool, str, type(None)})
ABSENT = object()  # an attribute a module did not have
_WHOLE = object()  # a swap's name meaning: the whole table as it was then (its value: a copy)


# NOTE [ recorded attributes ]: plain_settings records every module attribute but torch's own tables and memtrim's
# marks (``_memtrim_...``, the fusion token), which a technique applied or removed between a forward and its backward
# keeps as it set them (a user's ``memtrim_temp`` is recorded: every name with "memtrim" in it was passed over until
# 2026-12-03, an adversarial pass). The test is written out where it runs, with slices, not ``startswith``: it runs for
# every attribute of every module of every checkpointed call, where a method call counts.


def plain_settings(modules: Iterable[nn.Module]) -> Settings:
    """Each module's attributes and children now, by object (a temperature, a scale, an activation function, a
    tensor that is neither parameter nor buffer, with its version; not torch's own tables, whose ``training`` flag
    is :func:`training_flags'`, nor memtrim's marks). A loop annealing one between
    a forward and its backward had the recomputation read the new value, silently (checkpoint_modules: 8.3e-4 off
    after 5 steps; ReversibleSequential: 0.023 off after 4), until 2026-12-03; and until 2026-12-03 too, only
    numbers, strings, dtypes, devices and tensors were recorded, so a tuple, a NumPy number, an enum, a function
    rebound, or a child module swapped between forward and backward was read anew (4.7e-3 to 3.5e-2 off after 4
    steps; adversarial passes). Not seen: what changes inside a mutable object (a list appended to, a config's
    field set, an unregistered peer module's attributes), class attributes, globals, and properties that read them;
    hooks registered between forward and backward run in the recomputation."""
    settings: Settings = []
    for module in modules:  # (one loop, no helper calls: this runs for every module of every checkpointed call)
        attrs = module.__dict__
        values: dict[str, Any] = {}
        versions: list[tuple[str, int]] = []
        for name, value in attrs.items():
            if name in _TORCHS_OWN or name[:8] == "_memtrim" or name == FUSION:  # NOTE [ recorded attributes ]
                continue
            values[name] = value
            # (an inference tensor keeps no version, and nothing outside inference_mode writes it in place: a cache
            # an inference_mode pass left, HF RecurrentGemma's states, raised torch's error until 2026-12-03)
            if type(value) not in _PLAIN and isinstance(value, torch.Tensor) and not value.is_inference():
                versions.append((name, value._version))
        settings.append((module, values, dict(module._modules), versions))
    return settings


def written_in_place(settings: Settings) -> str | None:
    """What to say of the tensor attributes (no parameter or buffer) written in place since ``settings`` were
    recorded, or None: the recomputation would read the written values, and putting the object back does not undo
    a write (a shift added to in place between forward and backward: 2.4e-2 off after 4 steps, silently, until
    2026-12-03; an adversarial pass). An attribute that is one of the modules' buffers under another name is the
    callers' to put back, as the buffer (a running statistic's alias: refused, falsely, on 2026-12-03)."""
    buffers = {id(b) for module, *_ in settings for b in module._buffers.values() if b is not None}
    written = [(module, name) for module, values, _, versions in settings for name, version in versions
               if values[name]._version != version and id(values[name]) not in buffers]
    if not written:
        return None
    module, name = written[0]
    return (f"{type(module).__name__}.{name}, a tensor attribute that is no parameter or buffer, was written in place "
            f"{'(and ' + str(len(written) - 1) + ' more) ' if len(written) > 1 else ''}after the forward began (by "
            f"the forward itself, or between forward and backward), so the recomputation in backward would read the "
            f"written values where the forward may have read earlier ones (a count or a running statistic it "
            f"advances; a workspace it fills before reading it is safe but cannot be told apart). Expected tensor "
            f"attributes changed by assignment; to fix: assign a new tensor (self.{name} = self.{name} + ...), make it "
            f"a buffer (self.register_buffer({name!r}, tensor, persistent=False): the recomputation reads the buffers "
            "the forward read), or for a workspace, allocate it in the forward")


def put_settings(settings: Settings) -> Swaps:
    """Set the modules' attributes and children back to ``settings`` (those set since, unset again). Returns what
    :func:`undo_swaps` undoes: every attribute and child as it is now, so that what the recomputation itself writes
    or adds is undone too (a hook registered after the forward set an attribute in the recomputation, which stayed
    after backward, until 2026-12-03: an adversarial pass). Whole tables are copied and set by dict operations, not
    name by name: this runs for every module of every recomputation."""
    swapped: Swaps = []
    for module, values, children, _ in settings:
        for table, recorded in ((module.__dict__, values), (module._modules, children)):
            now = dict(table)
            swapped.append((table, _WHOLE, now))
            table.update(recorded)  # (the same objects where unchanged)
            for name in now.keys() - recorded.keys() - _TORCHS_OWN:  # set since: absent again (not memtrim's marks)
                if name[:8] != "_memtrim" and name != FUSION:
                    del table[name]
    return swapped


SCRIPTED = (
    "TorchScript's executor saves other tensors in its first runs than in later ones, so a recomputation in backward "
    "does not save what the forward saved, and no exception crosses it (torch's checkpoint stops a recomputation "
    "early by raising one): torch's own checkpoint (use_reentrant=False) fails there with an empty RuntimeError from "
    "the TorchScript interpreter. To fix: use it unscripted (torch.compile compiles it, under checkpointing "
    "too)"
)
"""Why a TorchScript module cannot be recomputed (each technique adds its other way out). Refused since 2026-12-03;
before, checkpoint_modules and ReversibleSequential crashed in backward with an AttributeError (a TorchScript
module's ``_parameters`` has no ``get``)."""


def scripted_inside(module: nn.Module) -> str | None:
    """The name of the first TorchScript module (``torch.jit.script`` or ``trace``) in ``module`` ("" for ``module``
    itself), or None if there is none."""
    return next((name for name, sub in module.named_modules() if isinstance(sub, torch.jit.ScriptModule)), None)


# NOTE [ parametrize.cached() ]: under ``torch.nn.utils.parametrize.cached()`` a parametrized tensor (orthogonal,
# weight_norm, spectral_norm) is computed at its first read and cached. Read first inside a recomputed module, its
# forward computed it, and its recomputation read the cached tensor, saving other tensors than the forward; with the
# backward outside ``cached()``, the recomputation computed one its forward read cached. Either way torch's bare
# CheckpointError (torch's own checkpoint fails so), or the reversible stack's "saved 8 tensors ... 6", until
# 2026-12-03 (adversarial passes). Now the forward notes which cache entries it made and which were there before
# it, and the recomputation runs under ``cached()`` without the first (it computes them again, as its forward did,
# and the forward's are put back after) and with the second (it reads them, as its forward did). A first
# fix computed every parametrized tensor before the forward: a layer the forward did not use advanced its spectral
# norm's power iteration (2.9e-2 off), a mixture of 16 weight-normed experts kept all 16 weights, and a parametrization
# drawing random numbers drew them earlier (adversarial pass).


class CachedParametrizations:
    """One forward's cache entries under ``parametrize.cached()`` (NOTE [ parametrize.cached() ]): :meth:`start` at
    its beginning (None outside ``cached()``), :meth:`end` at its end, :meth:`recomputing` around a recomputation."""

    __slots__ = ("before", "made", "found")

    def __init__(self) -> None:
        self.before: set[Any] = set(parametrize._cache)  # the keys cached when the forward began
        self.made: list[Any] = []
        self.found: dict[Any, torch.Tensor] = {}

    @staticmethod
    def start() -> CachedParametrizations | None:
        return CachedParametrizations() if parametrize._cache_enabled else None

    def end(self) -> None:
        cache = parametrize._cache
        self.made = [key for key in cache if key not in self.before]  # (computed by the forward)
        # (cached before it, every one: torch keys a deep copy's by the original module's id, so whose each is cannot be
        # told; held until backward, as the graph holds those its ops read)
        self.found = {key: value for key, value in cache.items() if key in self.before and value is not None}
        self.before = set()

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """The recomputation's cache: what its forward found there, without what its forward made; on exit each entry
        it touched is as it was (a backward in another ``cached()``, a validation pass's or the next step's, kept the
        forward's entries, and later reads there got those stale tensors, until 2026-12-03: an adversarial pass)."""
        with parametrize.cached(), CachedParametrizations.holding(self.found, without=self.made):
            yield

    @staticmethod
    def keys() -> set[Any]:
        """The keys cached now (before a call whose entries :meth:`made_since` then tells)."""
        return set(parametrize._cache)

    @staticmethod
    def made_since(keys: set[Any]) -> dict[Any, torch.Tensor]:
        """The entries cached since ``keys`` were (:meth:`keys`)."""
        return {key: value for key, value in parametrize._cache.items() if key not in keys and value is not None}

    @staticmethod
    @contextlib.contextmanager
    def holding(entries: dict[Any, torch.Tensor], without: Iterable[Any] = ()) -> Iterator[None]:
        """The cache with ``entries`` in it and the keys ``without`` out of it (as a call of the forward found it);
        on exit, each entry touched as it was."""
        cache = parametrize._cache
        touched = [*entries, *without]
        before = {key: cache[key] for key in touched if key in cache}
        for key in without:
            cache.pop(key, None)
        cache.update(entries)
        try:
            yield
        finally:
            for key in touched:
                cache.pop(key, None)
            cache.update(before)


def undo_swaps(swapped: Swaps) -> None:
    """Put back what :func:`put_settings` (or a caller's own swaps of ``(table, name, value)``) changed, last first."""
    for table, name, original in reversed(swapped):
        if name is _WHOLE:  # the whole table as it was: what was added since removed, the rest set back
            for added in table.keys() - original.keys():
                del table[added]
            table.update(original)
        elif original is ABSENT:
            table.pop(name, None)
        else:
            table[name] = original

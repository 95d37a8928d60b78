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

__all__ = ["Settings", "Swaps", "TrainingFlags", "buffers_put_back", "plain_settings", "put_settings",
           "putting_buffers_back", "set_training_flags", "training_flags", "undo_swaps"]

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


Settings = list[tuple[nn.Module, dict[str, Any], int]]
Swaps = list[tuple[dict[str, Any], str, Any]]

_SETTINGS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.Tensor})
"""The types of a module attribute a recomputation reads as its forward read it (immutable values, and tensors that
are no parameter or buffer, by object); a mutable object (a list, a config) is read as it is then."""
ABSENT = object()  # an attribute a module did not have


def plain_settings(modules: Iterable[nn.Module]) -> Settings:
    """Each module's plain attributes now (a temperature, a scale, a tensor that is neither parameter nor buffer; its
    ``training`` flag is :func:`training_flags`'), with how many attributes it had. A loop annealing one between a
    forward and its backward had the recomputation read the new value, silently (checkpoint_modules: 8.3e-4 off after
    5 steps; ReversibleSequential: 0.023 off after 4), until 2026-12-03 (an adversarial pass)."""
    return [(m, {k: v for k, v in m.__dict__.items() if type(v) in _SETTINGS and k != "training"}, len(m.__dict__))
            for m in modules]


def put_settings(settings: Settings) -> Swaps:
    """Set the modules' plain attributes back to ``settings`` (those set since, unset again); what
    :func:`undo_swaps` undoes."""
    swapped: Swaps = []
    for module, values, count in settings:
        attrs = module.__dict__
        for name, value in values.items():
            if attrs.get(name, ABSENT) is not value:  # changed since: its value then
                swapped.append((attrs, name, attrs.get(name, ABSENT)))
                attrs[name] = value
        if len(attrs) > count:  # set since (a flag a forward reads with getattr): absent again
            for name in [k for k, v in attrs.items() if k not in values and type(v) in _SETTINGS and k != "training"]:
                swapped.append((attrs, name, attrs.pop(name)))
    return swapped


def undo_swaps(swapped: Swaps) -> None:
    """Put back what :func:`put_settings` (or a caller's own swaps of ``(table, name, value)``) changed, last first."""
    for table, name, original in reversed(swapped):
        if original is ABSENT:
            table.pop(name, None)
        else:
            table[name] = original

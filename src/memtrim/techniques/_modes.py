"""Modules' training flags, recorded and set again: a recomputation in backward (checkpoint_modules,
ReversibleSequential) runs with the flags its forward had (an evaluation pass between a forward and its backward,
``model.eval()`` then ``no_grad``, turns them off), and convert's traces leave every module's flag as they found it
(``model.train(mode)`` alone sets them all: a frozen BatchNorm in a training model). Also: whether such a
recomputation, which puts its modules' buffers back itself, is running on this thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator

from torch import nn

__all__ = ["TrainingFlags", "buffers_put_back", "putting_buffers_back", "set_training_flags", "training_flags"]

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

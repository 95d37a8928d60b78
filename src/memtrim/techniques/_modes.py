"""Modules' training flags, recorded and set again: a recomputation in backward (checkpoint_modules,
ReversibleSequential) runs with the flags its forward had (an evaluation pass between a forward and its backward,
``model.eval()`` then ``no_grad``, turns them off), and convert's traces leave every module's flag as they found it
(``model.train(mode)`` alone sets them all: a frozen BatchNorm in a training model)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["TrainingFlags", "set_training_flags", "training_flags"]

TrainingFlags = list[tuple[nn.Module, bool]]


def training_flags(modules: Iterable[nn.Module]) -> TrainingFlags:
    """Each module with its ``training`` flag now."""
    return [(m, m.training) for m in modules]


def set_training_flags(flags: TrainingFlags) -> None:
    """Set each module's ``training`` flag as recorded (the flag itself: no module's ``train()`` runs)."""
    for module, training in flags:
        module.training = training

"""``memtrim.recompute_modules``: chosen modules' outputs rebuilt in backward for the layers that keep them.

NOTE [ recomputing chosen outputs ]
Checkpointing a module reruns its forward in backward through ``torch.utils.checkpoint``; for one matmul whose
output only the next layer keeps (an MLP's first Linear, kept by its activation), the same saving needs less: the
consumers keep a recipe (``techniques/recompute``), and backward runs the module's own forward once on the input it
keeps anyway. The choice is the user's (each costs a forward of the module in backward); what is checked, on a
traced forward of the example inputs (NOTE [ convert's evidence ]), is that the rebuild is the same tensor: the
module calls no other module, draws no random numbers, writes no buffer or parameter, returns one tensor that is
not a view of its input and that nothing changes in place after, and has no hooks of the user's (the rebuild
runs ``forward`` alone). Anything else raises at the call, naming the module and what to use instead.

At each call: its parameters and buffers are version-checked like autograd's (one replaced is swapped back for the
rebuild), and everything else in its ``__dict__`` (``training``, plain and private attributes, tensors that are
not buffers) must be as the forward read it, else backward raises. A module with parametrizations, or with a
forward hook that runs before memtrim's (``prepend=True``, a global one), keeps its output as torch does, and so does
a call under autocast (autocast picks the module's dtype and keeps its own casts: a rebuild would need the forward's
autocast state, and the input it reads is not what autograd keeps there). Under
torch.compile, torch.func and no-grad forwards nothing is marked (the recipes step aside). What no check sees: a
change through ``.data`` (autograd's own escape hatch, which moves no version counter), or inside a mutable object
the module holds (a list it appends to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import InvalidInputError
from ..checkpoint._core import ModuleSelector, _select
from ..offload._core import _MARK as _OFFLOADED
from ..recompute import recompute_output
from .api import activation_bytes, as_training, refuse_lazy
from .evidence import collect, split_inputs
from .recompute_rules import _holder_modules, _install_consumers, _keeps_output, _random_ops
from .rules import Context, chain

__all__ = ["RecomputeHandle", "recompute_modules"]

_API = "memtrim.recompute_modules"
_MARK = "_memtrim_recomputed"  # instance attribute while a RecomputeHandle rebuilds the module's output


@dataclass
class RecomputeHandle:
    """What :func:`recompute_modules` did: the ``names`` of the modules whose outputs are rebuilt, the
    ``bytes_saved`` measured on the example inputs, and ``remove()`` to undo it."""

    names: list[str]
    bytes_saved: int
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Undo: the modules' outputs are kept again (a second call does nothing)."""
        while self._undo:
            self._undo.pop()()


def recompute_modules(model: nn.Module, modules: ModuleSelector, *,
                      example_inputs: torch.Tensor | tuple[Any, ...] | dict[str, Any],
                      example_kwargs: dict[str, Any] | None = None) -> RecomputeHandle:
    """Rebuild the chosen modules' outputs in backward, for the later layers that keep them, instead of keeping them.

    Each costs one more forward of the module in backward; training is bitwise the same (the module's own forward,
    on the input it keeps anyway). Composes with :func:`memtrim.convert` (call it after: an input convert rebuilds is
    rebuilt in turn) and with checkpointing. See NOTE [ recomputing chosen outputs ].

    Args:
        model: the model (changed in place: hooks only; classes, parameters and state_dict unchanged).
        modules: names from ``model.named_modules()``, a class, or a predicate ``(name, module) -> bool``; each a
            module that calls no other (a Linear, a convolution), e.g. ``["blocks.0.mlp.fc"]``.
        example_inputs: a tensor, a tuple of arguments or a dict of keyword arguments, as for
            :func:`memtrim.convert`: the evidence, and what the saving is measured on.
        example_kwargs: more keyword arguments for the example call.

    Returns:
        A :class:`RecomputeHandle` with the bytes saved (measured by the tracker).

    Raises:
        InvalidInputError: a chosen module is not a name, class or predicate match; is not called on the example
            inputs; calls other modules, draws random numbers, writes buffers, returns several tensors or a view of
            its input; has hooks; or its output is kept by its parent's own code, changed in place, or kept by
            nothing (nothing to save).

    Example::

        memtrim.convert(model, example_inputs=(x,))
        memtrim.recompute_modules(model, ["blocks.0.mlp.fc", "blocks.1.mlp.fc"], example_inputs=(x,))
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"{_API}: model must be an nn.Module, got {type(model).__name__}.")
    chosen = _select(model, modules, _API)
    refuse_lazy(model, _API)
    _refuse_inside_checkpoints(model, chosen)
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    if not args and not kwargs:
        raise InvalidInputError(f"{_API}: example_inputs are required (the traced evidence and the measured saving).")
    with as_training(model, args, kwargs):
        ctx = Context.of(model, collect(model, args, kwargs, _API), measured=True)
        plans = [(name, module, *_consumers(ctx, name, module)) for name, module in chosen]
        before = activation_bytes(model, args, kwargs)
        undo = chain(*(chain(recompute_output(module, owner=f"{name} (memtrim.recompute_modules)", parameters=True,
                                              keeps_output=keeps, strict=True, under_autocast=False).remove,
                             _install_consumers(consumers), _flag(module))
                       for name, module, consumers, keeps in plans))
        try:
            after = activation_bytes(model, args, kwargs)
        except Exception:
            undo()
            raise
    names = [name for name, *_ in plans]
    if after >= before:
        undo()
        raise InvalidInputError(
            f"{_API}: rebuilding {names} saves {before - after:,} B on the example inputs (measured): their outputs "
            "stay kept otherwise, or their inputs would be kept in their place (a frozen Linear keeps no input), or "
            "their calls pass an argument other than tensors and plain constants (an object such as a key/value "
            "cache, which the rebuild would pass again). Choose modules whose output only later layers keep and "
            "whose input a layer keeps anyway (a trainable Linear keeps its own input), called with tensors and "
            "plain constants.")
    return RecomputeHandle(names, before - after, [undo])


def _flag(module: nn.Module) -> Callable[[], None]:
    """Mark ``module`` as recomputed (a second call refuses it); returns the undo."""
    module.__dict__[_MARK] = True
    return lambda: module.__dict__.pop(_MARK, None)


def _refuse_inside_checkpoints(model: nn.Module, chosen: list[tuple[str, nn.Module]]) -> None:
    """A chosen module inside a module ``checkpoint_modules`` checkpoints: nothing in there is kept for backward,
    so nothing is left to rebuild (the error said no later layer keeps its output, and to choose the module chosen)."""
    checkpointed = [(n, m) for n, m in model.named_modules() if "_memtrim_checkpointed" in m.__dict__]
    for name, module in chosen:
        outer = next((n for n, m in checkpointed if any(sub is module for sub in m.modules())), None)
        if outer is not None:
            raise InvalidInputError(
                f"{_API}: {name!r} is inside {outer or 'the model'!r}, which memtrim.checkpoint_modules checkpoints: "
                "nothing in it is kept for backward, so there is nothing to rebuild. Expected a module outside "
                "checkpointed ones; found one inside. Choose a module outside it."
            )


def _kept_by_nothing_because(model: nn.Module, module: nn.Module) -> tuple[str, str] | None:
    """Why nothing keeps ``module``'s output, where another technique around it takes what its forward saves: HF's
    gradient checkpointing (a layer's, or a model's in older transformers, ``gradient_checkpointing`` flag) or
    ``memtrim.offload_module``; as ``(where, fix)``, or None. (The refusal said no later layer keeps the output, and
    to choose an MLP's first Linear: the module chosen; found by an adversarial pass.)"""
    found = None  # the innermost
    for name, outer in model.named_modules():
        if outer is module or not any(sub is module for sub in outer.modules()):
            continue
        where = repr(name) if name else "the model"
        if getattr(outer, "gradient_checkpointing", False) is True:
            found = (f"{where}, which HF's gradient checkpointing recomputes (gradient_checkpointing_enable)",
                     "Choose a module outside it, or turn HF's checkpointing off (gradient_checkpointing_disable()) "
                     "and recompute this module instead")
        elif _OFFLOADED in outer.__dict__:
            found = (f"{where}, which memtrim.offload_module offloads (its saved-tensor hooks take what the forward "
                     "saves)", "Call recompute_modules first, then offload_module (remove() the offload handle, "
                     "recompute, and offload again)")
    return found


def _consumers(ctx: Context, name: str, module: nn.Module) -> tuple[list[nn.Module], bool]:
    """The modules that keep ``module``'s output and whether its own backward keeps it too; raises where the
    rebuild could differ from the output (NOTE [ recomputing chosen outputs ])."""
    trace = ctx.trace
    assert trace is not None
    path = trace.names.get(id(module), name)
    sites = trace.sites_of(path)

    def refuse(why: str, fix: str = "Choose another module, or checkpoint it (memtrim.checkpoint_modules)") -> None:
        raise InvalidInputError(f"{_API}: {name!r} {why}. {fix}.")

    if module.__dict__.get(_MARK):
        refuse("is recomputed already (an earlier recompute_modules)", "remove() that handle first, or leave it out")
    if not sites:
        refuse("is not called by the model on the example inputs", "Choose a module the forward calls, or give "
               "example inputs that reach it (a mixture's expert that no token of the example batch was routed to: "
               "a larger or more varied batch)")
    hooks = ctx.user_hooks(module)
    if hooks:
        refuse(f"has {', '.join(hooks)}; the rebuild runs its forward alone", "Remove the hooks or choose another "
               "module")
    consumers: list[nn.Module] = []
    for site in sites:
        if not trace.leaf(site):
            refuse("calls other modules; recompute_modules takes modules that call none (a Linear, a convolution)",
                   "Checkpoint a block with memtrim.checkpoint_modules")
        random = _random_ops(trace, site)
        if random:
            refuse(f"draws random numbers ({', '.join(random)}); a rebuild would draw others",
                   "Checkpoint it (memtrim.checkpoint_modules replays the RNG)")
        written = {k for o in trace.ops_in(site, compute_only=False) for k in o.writes
                   if trace.storages[k].kind in ("buffer", "parameter", "input")}
        if written:
            refuse("writes a buffer, parameter or input in its forward (a running statistic); a rebuild would write "
                   "it again")
        if site.replaced:
            refuse(f"assigns its own tensor(s) {', '.join(site.replaced)} anew in its forward from what they held (a "
                   "counter or an average: self.count = self.count + 1); a rebuild would update them again",
                   "Choose another module, or update such state outside its forward")
        if len(site.outputs) != 1 or site.outputs[0] in site.inputs:
            refuse("does not return one tensor of its own (several outputs, or a view of its input)")
        if ctx.edited(path):
            refuse(ctx.edited(path) or "")
        found = _holder_modules(ctx, site.outputs[0], site)
        if found is None:
            refuse("has its output kept by its parent's own code, where no recipe can reach it")
        consumers += [m for m in found or [] if m not in consumers]
    if not consumers and not _keeps_output(trace, sites):
        dropped = _kept_by_nothing_because(ctx.model, module)
        if dropped is not None:
            refuse(f"is inside {dropped[0]}, so nothing in it is kept for backward and there is nothing to rebuild",
                   dropped[1])
        refuse("has an output that no later layer keeps for backward: there is nothing to save",
               "Choose a module whose output a later layer keeps (an MLP's first Linear); a class or predicate "
               "chooses every match, so pass names to leave this one out. Inside a region torch's own checkpoint "
               "recomputes, nothing is kept: choose a module outside it")
    return consumers, _keeps_output(trace, sites)

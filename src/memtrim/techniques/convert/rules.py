"""The rule registry of :func:`memtrim.convert`: each rewrite is a small registered rule.

NOTE [ convert's rules ]
A rule is a ``match(context) -> Iterable[Candidate]`` function registered under a name (torchao's
``register_quantize_module_handler`` style). A candidate names the call sites or modules it would change, why it
matched (the traced evidence), the bytes it expects to save where the evidence says, the limits of the converted
module, and ``apply`` (does the change, returns its undo) — or it is a *skip* with a reason, so that every
norm- and activation-like call site a rule recognises ends up in the report. ``convert`` is a loop: rules in
registration order, candidates in the order a rule yields them (lazily: a rule sees the claims of the candidates
already applied), module_filter and hooks checked, each change measured on the example inputs and undone when it
saves nothing (a built-in rule's changes that expect bytes are measured together: NOTE [ changes measured together ]
in api.py, where convert may start over and run every rule's ``match`` a second time; a registered rule's changes
are measured one at a time). Adding support for a new library's module is one rule and one test::

    @register_rule("my_norm")
    def my_norm(ctx: Context) -> Iterator[Candidate]:
        for site in ctx.sites():
            if ctx.op_names(site) == ["native_layer_norm"] and ...:
                yield Candidate((site.label,), "MyNorm", "memtrim keep-output LayerNorm", reason=..., apply=...)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...errors import InvalidInputError
from ..guards import memtrims
from .evidence import CallSite, ModelTrace, Op

__all__ = ["Candidate", "Context", "Rule", "op_name", "register_rule", "registered_rules", "unregister_rule"]


Undo = Callable[[], None]
"""What applying a candidate returns: a call that puts the model back as it was."""


@dataclass
class Candidate:
    """One change a rule proposes, or (``skip``) one it found and leaves alone, with the reason.

    Attributes:
        modules: names for the report (a call site of a shared module reads ``path#k``).
        before, after: what the call site is and what it becomes.
        reason: why it matched (or, for a skip, why not).
        targets: the modules the change touches: module_filter, hooks and claims are checked on them.
        expected_bytes: what the evidence says it saves (None: unknown); ``<= 0`` is skipped unapplied.
        limits: what the converted module does not support (copied to the report).
        bitwise: whether training with the change is bitwise torch's; False where gradients agree to rounding (a
            tensor rebuilt from another: the limits then say so).
        same_outputs: the evidence cannot show the change leaves the training step alone (an in-place
            activation made out of place); convert runs a step on the example inputs before and after it and undoes
            it unless the outputs, the buffers and every parameter's gradient are bitwise the same.
        apply: does the change and returns its undo.
        stacks_on: rules whose changed modules this change may change further (a checkpointed activation can
            still have its output recomputed for its consumers).
        touches: modules the change also alters without claiming them (the consumers that get recipe hooks, a
            shared ReLU made pass-through): module_filter is checked on them too.
    """

    modules: tuple[str, ...]
    before: str = ""
    after: str = ""
    reason: str = ""
    skip: bool = False
    targets: tuple[nn.Module, ...] = ()
    expected_bytes: int | None = None
    limits: tuple[str, ...] = ()
    bitwise: bool = True
    same_outputs: bool = False
    apply: Callable[[], Undo] | None = None
    stacks_on: tuple[str, ...] = ()
    touches: tuple[nn.Module, ...] = ()


def op_name(op: Op) -> str:
    """``op``'s name with an in-place ``op_`` written as ``op`` (``relu_`` -> ``relu``; ``_softmax`` stays)."""
    return op.name.rstrip("_") if not op.name.startswith("_") else op.name


@dataclass
class Context:
    """What a rule's ``match`` sees: the model, the evidence and the conversion so far."""

    model: nn.Module
    evidence: ModelTrace | None
    modules: dict[str, nn.Module]  # each module once, under its first name
    aliases: dict[int, list[str]]  # id(module) -> every name it is registered under
    claimed: dict[int, str] = field(default_factory=dict)  # id() of modules already changed -> the rule
    measured: bool = False  # savings are measured (example inputs given)

    @classmethod
    def of(cls, model: nn.Module, evidence: ModelTrace | None, measured: bool) -> Context:
        """The context of ``model`` before any change: its modules under their first names, every name of each."""
        aliases: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            aliases.setdefault(id(module), []).append(name)
        return cls(model, evidence, dict(model.named_modules()), aliases, measured=measured)

    @property
    def traced(self) -> bool:
        """Whether the evidence is a traced forward (with what autograd saved), not an fx graph or nothing."""
        return self.evidence is not None and self.evidence.saves_known

    @property
    def trace(self) -> ModelTrace | None:
        """The evidence if it is a traced forward (it says what autograd keeps: the rules that need holders), else
        None."""
        return self.evidence if self.traced else None

    def places(self, module: nn.Module) -> list[tuple[nn.Module, str]]:
        """(parent, name) for every name ``module`` is registered under."""
        found = []
        for path in self.aliases.get(id(module), []):
            parent_path, _, name = path.rpartition(".")
            found.append((self.model.get_submodule(parent_path), name))
        return found

    def sites(self) -> list[CallSite]:
        """Every call site of the evidence, in call order (none without evidence)."""
        return [] if self.evidence is None else self.evidence.sites

    def undecided_sites(self, decided: set[int], *,
                        stacks_on: tuple[str, ...] = ()) -> Iterator[tuple[ModelTrace, CallSite]]:
        """``(trace, site)`` for the call sites of a traced forward (none without one), in call order, less those of
        the modules in ``decided`` (the ``id()`` a rule adds once it has decided on a module) and of modules an
        earlier candidate changed (except by the rules in ``stacks_on``)."""
        trace = self.trace
        if trace is None:
            return
        for site in trace.sites:
            if id(site.module) not in decided and self.free(site.module, stacks_on=stacks_on):
                yield trace, site

    def op_names(self, site: CallSite) -> list[str]:
        """The compute ops of ``site`` (views and dtype copies left out), ``op_`` written as ``op``."""
        assert self.evidence is not None
        return [op_name(o) for o in self.evidence.ops_in(site)]

    def free(self, *modules: nn.Module, stacks_on: tuple[str, ...] = ()) -> bool:
        """None of ``modules`` was changed by an earlier candidate (except by the rules in ``stacks_on``)."""
        return not any(id(m) in self.claimed and self.claimed[id(m)] not in stacks_on for m in modules)

    def user_hooks(self, module: nn.Module) -> list[str]:
        """The kinds of hooks on ``module`` other than memtrim's own (recipe scopes, recomputes)."""
        kinds = []
        for attr, kind in (("_forward_pre_hooks", "forward pre-hooks"), ("_forward_hooks", "forward hooks"),
                           ("_backward_pre_hooks", "backward pre-hooks"), ("_backward_hooks", "backward hooks")):
            if any(not memtrims(hook) for hook in (getattr(module, attr, None) or {}).values()):
                kinds.append(kind)
        return kinds

    def edited(self, name: str) -> str | None:
        """Why ``name``'s output cannot be kept (it is changed in place after its forward), or None."""
        writer = None if self.evidence is None else self.evidence.written_after(name)
        return None if writer is None else (
            f"its output is changed in place after its forward (in {writer or 'the top-level forward'}); keeping the "
            "output for backward would break, as torch's module keeps its input")

    def input_edited(self, name: str) -> str | None:
        """Why ``name`` cannot keep its output or rebuild from its input instead of keeping what torch's module
        keeps: an input of one of its calls is changed in place after the call (torch's module, keeping it, sees
        the change or raises); or None. Found by an adversarial pass (2026-12-01): a write through ``.data`` trained
        otherwise, one in place trained where torch raises."""
        writer = None if self.evidence is None else self.evidence.inputs_written_after(name)
        return None if writer is None else (
            f"its input is changed in place after its forward (in {writer or 'the top-level forward'}); torch's "
            "module keeps that input and backward reads the change (or raises), which a module keeping its output, "
            "or rebuilding from an input it keeps, would not")


@dataclass(frozen=True)
class Rule:
    """A registered rule: ``match(context)`` yields candidates (NOTE [ convert's rules ])."""

    name: str
    match: Callable[[Context], Iterable[Candidate]]
    doc: str = ""


_RULES: dict[str, Rule] = {}


def register_rule(name: str, *, before: str | None = None) -> Callable[[Callable[[Context], Iterable[Candidate]]],
                                                                        Callable[[Context], Iterable[Candidate]]]:
    """Register ``match`` as the rule ``name`` (a decorator); ``before``: run it before that rule.

    Raises:
        InvalidInputError: ``name`` is taken, or ``before`` names no rule.
    """

    def decorate(match: Callable[[Context], Iterable[Candidate]]) -> Callable[[Context], Iterable[Candidate]]:
        if name in _RULES:
            raise InvalidInputError(f"memtrim.register_rule: a rule named {name!r} exists; pick another name or "
                                    "unregister_rule it first.")
        rule = Rule(name, match, (match.__doc__ or "").strip().split("\n")[0])
        if before is None:
            _RULES[name] = rule
            return match
        if before not in _RULES:
            raise InvalidInputError(f"memtrim.register_rule: before={before!r} names no rule; expected one of "
                                    f"{sorted(_RULES)}.")
        items = list(_RULES.items())
        at = [k for k, _ in items].index(before)
        items.insert(at, (name, rule))
        _RULES.clear()
        _RULES.update(items)
        return match

    return decorate


def unregister_rule(name: str) -> None:
    """Remove the rule ``name`` (no error if there is none)."""
    _RULES.pop(name, None)


def registered_rules() -> list[Rule]:
    """The rules, in the order :func:`memtrim.convert` runs them."""
    return list(_RULES.values())


def class_swap(module: nn.Module, target: type, **attrs: Any) -> Undo:
    """Change ``module``'s class to ``target`` in place and set ``attrs``; return the undo. Parameters, buffers,
    hooks, state_dict keys and every reference to the module stay as they are."""
    old_class = module.__class__
    old = {k: module.__dict__[k] for k in attrs if k in module.__dict__}
    module.__class__ = target
    for k, v in attrs.items():
        setattr(module, k, v)

    def undo() -> None:
        module.__class__ = old_class
        for k in attrs:
            if k in old:
                setattr(module, k, old[k])
            else:
                module.__dict__.pop(k, None)

    return undo


def chain(*undos: Undo) -> Undo:
    """One undo running ``undos`` last first."""
    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def label(names: tuple[str, ...] | list[str], target: str) -> str:
    """How errors name a converted module."""
    return f"{' + '.join(repr(n) for n in names)} (converted by memtrim.convert to {target})"

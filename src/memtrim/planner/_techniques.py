"""The techniques a plan can combine: each applies memtrim's own technique to a (model, optimizer) pair.

Every technique here keeps training bitwise equal to the standard loop, but ``offload_state`` (the host's kernels:
``tolerance``) and the low-bit states (``changed``). ``memtrim.convert`` is not among them yet: convert a model
first and plan the converted model itself (its LayerNorms rebuilt for their Linears need no values; norms that keep
their output choose per feature from gamma and beta, whose values a trace of a given model knows: NOTE [ known
values ]).
"""

from __future__ import annotations

import collections
import gc
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import MemtrimStateError
from ..techniques.checkpoint import checkpoint_modules
from ..techniques.offload import offload_module
from ..techniques.optim import OptimizerInBackward
from ..techniques.optim_state import CPUOffloadOptimizer, LowBitAdamW


class NotApplicable(LookupError):
    """A technique has nothing to do on this model or optimizer (the plan leaves it out and says why). The planner
    catches this class only: a ``KeyError`` (another ``LookupError``) raised by the user's model or loss must not
    pass for it."""


class Applied:
    """A (model, optimizer) pair with techniques applied in turn, and how to undo the in-place ones."""

    def __init__(self, model: nn.Module, optimizer: Any, host: str = "cpu", clip_grad_norm: float | None = None,
                 blocks: Sequence[str | type[nn.Module]] = ()) -> None:
        self.model = model
        self.blocks = blocks  # the classes checkpointing takes as the blocks (the plan's choice); (): repeated_block
        self.optimizer = optimizer
        self.host = host  # where offloaded state goes: "meta" in a prediction, so it is not counted on the device
        self.clip_grad_norm = clip_grad_norm  # the loop's: an OptimizerInBackward clips in its two-pass backward
        self._undo: list[Callable[[], None]] = []

    @property
    def inner_optimizer(self) -> torch.optim.Optimizer:
        """The ``torch.optim`` optimizer (unwrapped from an :class:`OptimizerInBackward`)."""
        return self.optimizer.optimizer if isinstance(self.optimizer, OptimizerInBackward) else self.optimizer

    def undo(self) -> None:
        """Remove the hooks and forwards the techniques set (a converted model stays converted)."""
        while self._undo:
            self._undo.pop()()


@dataclass(frozen=True)
class Technique:
    """One option of a plan: ``name``, what it does to numerics, and ``apply`` (returns notes)."""

    name: str
    numerics: str  # "bitwise" | "tolerance" | "changed"
    description: str
    _apply: Callable[[Applied], list[str]] = field(repr=False, compare=False)

    def apply(self, applied: Applied) -> list[str]:
        """Apply to ``applied`` in place; the notes say what was done."""
        return self._apply(applied)


MAX_BLOCK_CANDIDATES = 4
"""How many choices of blocks a plan traces checkpointed, to keep the one with the lowest peak."""

BlockClasses = tuple[type[nn.Module], ...]
"""Classes whose every instance a plan may checkpoint (one class as a rule; an encoder's and a decoder's layers)."""

Blocks = tuple[str, ...]
"""The classes a plan checkpoints, by name in the model (:func:`class_names`): a factory that defines its block class
inside itself makes a new class at each call, and a plan holding classes did not pickle where they were local (an
adversarial pass on 2026-12-03)."""


def qualified(kind: type) -> str:
    """``module.QualName`` of a class."""
    return f"{kind.__module__}.{kind.__qualname__}"


def class_names(model: nn.Module) -> dict[type, str]:
    """Each class of ``model``'s modules by name: its qualified name, and where another class of the model has that
    name too (a helper defining ``class Layer`` that the model's code calls twice), ``@`` and the path of its first
    module (``Layer@encoder.0``): taken as one, an encoder's layers could not be chosen without the decoder's, and
    where one held the other no block could be checkpointed; numbered in module order, a model registering them in
    another order checkpointed the other class (adversarial passes on 2026-12-03). A factory building the same model
    again gives its new classes the same names."""
    first: dict[type, str] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        first.setdefault(type(m), path)
    shared = collections.Counter(qualified(kind) for kind in first)
    return {kind: qualified(kind) + (f"@{path}" if shared[qualified(kind)] > 1 else "") for kind, path in first.items()}


def _holds_layers(kind: type[nn.Module], module: nn.Module) -> bool:
    return kind not in (nn.ModuleList, nn.Sequential, nn.ModuleDict) and any(True for _ in module.parameters())


def _container_blocks(model: nn.Module) -> dict[type[nn.Module], int]:
    """Classes repeated in a ``ModuleList``/``Sequential``, with the parameters their instances there hold. A
    container's children all share one class, or the class two or more of them share holds submodules of its own and
    is most of the container (torchvision's mobilenet_v2 ``features``: a stem, 17 InvertedResidual blocks and a last
    convolution, which left plan without a checkpointing plan until 2026-12-03, found by a helper's run)."""
    found: dict[type[nn.Module], int] = {}
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2:
            continue
        kind, count = collections.Counter(type(c) for c in children).most_common(1)[0]
        blocks = [c for c in children if type(c) is kind]
        mixed = count < len(children)  # then the class must be most of them, and hold submodules: no leaf layer
        if count < 2 or mixed and (2 * count <= len(children) or not any(True for _ in blocks[0].children())):
            continue
        if _holds_layers(kind, blocks[0]):
            found[kind] = max(found.get(kind, 0), sum(p.numel() for block in blocks for p in block.parameters()))
    return found


def _attribute_blocks(model: nn.Module) -> dict[type[nn.Module], int]:
    """Classes of which a module of another kind holds two or more as attributes, each holding layers of its own
    (timm's regnet: a ``RegStage`` holds its ``Bottleneck`` blocks as b1, b2, ...; the model holds the stages as
    s1..s4), with the parameters all their instances hold."""
    found: dict[type[nn.Module], int] = {}
    for module in model.modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        counts = collections.Counter(type(c) for c in module.children()
                                     if any(True for _ in c.children()) and _holds_layers(type(c), c))
        for kind, count in counts.items():
            if count >= 2:
                found[kind] = 0
    for kind in found:
        found[kind] = sum(p.numel() for m in model.modules() if type(m) is kind for p in m.parameters())
    return found


def _nests(model: nn.Module, kinds: BlockClasses) -> bool:
    """Whether an instance of ``kinds`` holds another (timm's dla: a tree of trees); checkpoint_modules refuses it."""
    return any(isinstance(inner, kinds) for m in model.modules() if isinstance(m, kinds)
               for inner in list(m.modules())[1:])


def block_candidates(model: nn.Module) -> list[BlockClasses]:
    """The choices of blocks a plan may checkpoint, most likely first: every class repeated in a
    ``ModuleList``/``Sequential`` together where there are several (an encoder's and a decoder's layers), then each
    such class alone (a decoder layer, a residual block), then each class held two or more times as attributes of
    one module (timm's regnet and dla: plan found no block there until 2026-12-03), each group by the parameters its
    instances hold; at most ``MAX_BLOCK_CANDIDATES``, none whose instances nest. A plan traces each checkpointed and
    keeps the one with the lowest peak (NOTE [ choosing the blocks ])."""
    containers, attributes = _container_blocks(model), _attribute_blocks(model)
    ordered = [kind for found in (containers, attributes)
               for kind, _ in sorted(found.items(), key=lambda item: -item[1])]
    out: list[BlockClasses] = []
    for choice in [tuple(containers)] * (len(containers) > 1) + [(kind,) for kind in ordered]:
        if choice not in out and not _nests(model, choice):
            out.append(choice)
    return out[:MAX_BLOCK_CANDIDATES]


def repeated_block(model: nn.Module) -> type[nn.Module] | None:
    """The class of the model's repeated blocks: among the ``ModuleList``/``Sequential`` containers, the class repeated
    there holding the most parameters, else the first class held two or more times as attributes (the first single
    class of :func:`block_candidates`); None if none."""
    return next((choice[0] for choice in block_candidates(model) if len(choice) == 1), None)


def blocks_name(blocks: Blocks | BlockClasses) -> str:
    """``Encoder+Decoder``: the classes' names joined by ``+``."""
    def short(name: str) -> str:
        qualname, at, path = name.partition("@")
        return qualname.rsplit(".", 1)[-1] + at + path

    return "+".join(short(b) if isinstance(b, str) else b.__name__ for b in blocks)


def blocks_of(model: nn.Module, choice: BlockClasses) -> Blocks:
    """``choice``'s classes by their names in ``model`` (:func:`class_names`)."""
    names = class_names(model)
    return tuple(names.get(kind, qualified(kind)) for kind in choice)


def _in_model(model: nn.Module, blocks: Sequence[str | type[nn.Module]]) -> BlockClasses:
    """The classes of ``model`` named ``blocks`` (:func:`class_names`; a class given itself stands for itself where
    the model holds one), else those deriving from a class of that name (a plan made on a model of ``Block`` applied
    to one of its subclass): a factory that defines its block class inside itself makes a new class at each call (a
    plan holding the class found none in the next build, and left checkpointing out, until a helper's run on
    2026-12-03). ``checkpoint_modules`` then takes their subclasses too."""
    names = class_names(model)
    by_name = {name: kind for kind, name in names.items()}
    found: list[type[nn.Module]] = []
    for block in blocks:
        if not isinstance(block, str) and any(isinstance(m, block) for m in model.modules()):
            found.append(block)
            continue
        name = block if isinstance(block, str) else qualified(block)
        derived = [kind for kind in names if "@" not in name and any(qualified(base) == name for base in kind.__mro__)]
        if name not in by_name and not derived:
            raise NotApplicable(f"the model holds no {blocks_name((name,))} ({name}), the blocks the plan checkpoints")
        found += [by_name[name]] if name in by_name else derived
    return tuple(dict.fromkeys(found))


def _checkpoint(policy: str | None) -> Callable[[Applied], list[str]]:
    def apply(applied: Applied) -> list[str]:
        if applied.blocks:
            blocks = _in_model(applied.model, applied.blocks)
        else:
            block = repeated_block(applied.model)
            if block is None:
                raise NotApplicable("no repeated block class to checkpoint")
            blocks = (block,)
        handle = checkpoint_modules(applied.model, blocks, policy=policy)
        applied._undo.append(handle.remove)
        return [f"checkpoints {len(handle)} {blocks_name(blocks)} blocks" + (f" ({policy})" if policy else "")]

    return apply


def _in_backward(**options: Any) -> Callable[[Applied], list[str]]:
    def apply(applied: Applied) -> list[str]:
        clip: dict[str, Any] = {} if applied.clip_grad_norm is None else {"clip_grad_norm": applied.clip_grad_norm}
        wrapper = OptimizerInBackward(applied.optimizer, model=applied.model, **options, **clip)
        applied.optimizer = wrapper
        applied._undo.append(wrapper.remove)
        done = [f"the optimizer step runs inside backward ({options or 'defaults'})"]
        if clip:
            done.append(f"it clips the gradients' norm to {applied.clip_grad_norm} itself: call "
                        "optimizer.backward(loss) for the last micro-batch (two passes), not clip_grad_norm_")
        return done

    return apply


_HOOK_TABLES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                "_optimizer_load_state_dict_post_hooks")


def _scheduler_on(optimizer: torch.optim.Optimizer) -> Any:
    """A live object whose ``optimizer`` attribute is ``optimizer`` (an LR scheduler: torch's, ReduceLROnPlateau,
    timm's, a hand-written one; a trainer), or None. The holders of ``optimizer`` are asked (an instance whose
    attributes live in a ``__dict__`` is reached through it); one no longer referenced, waiting for the collector,
    schedules nothing. (torch's LRScheduler also marks the step it wraps, but the mark outlives the scheduler.)"""

    def held_by() -> Any:
        for holder in gc.get_referrers(optimizer):
            owners = [holder]
            if isinstance(holder, dict) and holder.get("optimizer") is optimizer:
                owners = [o for o in gc.get_referrers(holder) if getattr(o, "__dict__", None) is holder]
            for owner in owners:
                if not isinstance(owner, (dict, Applied)) and getattr(owner, "optimizer", None) is optimizer:
                    return owner
        return None

    if held_by() is None:
        return None
    gc.collect()
    return held_by()


def _check_replaceable(optimizer: torch.optim.Optimizer, technique: str) -> None:
    """A technique that trains with a new optimizer in place of ``optimizer`` cannot take over an LR scheduler built
    on it (it would go on setting the old one's learning rates, silently unused) nor the hooks registered on it
    (an EMA's step post-hook would never run again)."""
    found = _scheduler_on(optimizer)
    if found is not None:
        raise MemtrimStateError(
            f"memtrim.Plan.apply: {technique} trains with a new optimizer in place of this "
            f"{type(optimizer).__name__}, but a {type(found).__name__} holds it (an LR scheduler built on it would go "
            "on scheduling the old one). Apply the plan first, then build the scheduler on the optimizer apply() "
            "returns."
        )
    hooks = [t.removeprefix("_optimizer_").removesuffix("s").replace("_", " ") for t in _HOOK_TABLES
             if getattr(optimizer, t, None)]
    if hooks:
        raise MemtrimStateError(
            f"memtrim.Plan.apply: {technique} trains with a new optimizer in place of this "
            f"{type(optimizer).__name__}, which has {', '.join(hooks)}s registered: they would not run on the new one. "
            "Apply the plan first, then register them on the optimizer apply() returns."
        )


def _constructor_options(kind: type) -> set[str]:
    """The keyword options ``kind(params, ...)`` takes: its ``__init__``'s names, and where that passes ``**kwargs``
    on, those of the next ``__init__`` in the MRO (a subclass's own option before AdamW's)."""
    names: set[str] = set()
    for cls in kind.__mro__:
        if "__init__" not in vars(cls):
            continue
        parameters = inspect.signature(vars(cls)["__init__"]).parameters.values()
        names.update(p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names - {"self", "params"}


def _rebuilt(optimizer: torch.optim.Optimizer, build: Callable[..., torch.optim.Optimizer],
             technique: str) -> torch.optim.Optimizer:
    """``build(**options)`` with the options ``optimizer`` was built with: its ``defaults`` (what a later
    ``add_param_group`` takes) and its public settings that its class's constructor takes by name
    (``LowBitAdamW``'s ``bits``; a subclass's own option). A public setting the new optimizer then holds otherwise
    raises: the plan would train with another optimizer than the user's."""
    taken = _constructor_options(type(optimizer))
    settings = {k: v for k, v in vars(optimizer).items() if not k.startswith("_") and k in taken}
    unknown = sorted(taken - set(optimizer.defaults) - set(settings))
    if unknown and not type(optimizer).__module__.startswith(("torch.", "memtrim.")):
        # (an option kept under another name, `self._scale = scale`: the rebuild would take its default silently)
        raise MemtrimStateError(
            f"memtrim.Plan.apply: {technique} rebuilds this {type(optimizer).__name__} over the same parameter groups, "
            f"but cannot tell what it was given for {', '.join(unknown)} (not in its defaults nor an attribute of that "
            "name). Build the optimizer the plan names yourself, or plan without this technique (techniques=...)."
        )
    try:
        new = build(**{k: v for k, v in {**optimizer.defaults, **settings}.items() if k in taken})
    except (TypeError, AttributeError) as e:  # (a constructor that needs another argument; a wrapper of another)
        raise MemtrimStateError(
            f"memtrim.Plan.apply: {technique} could not rebuild this {type(optimizer).__name__} over its parameter "
            f"groups ({type(e).__name__}: {e}). Build the optimizer the plan names yourself, or plan without this "
            "technique (techniques=...)."
        ) from e
    inner = getattr(new, "optimizer", new)  # (CPUOffloadOptimizer's host optimizer)
    for key, value in vars(optimizer).items():
        if key.startswith("_") or key in ("defaults", "state", "param_groups") or not isinstance(
                value, (bool, int, float, str, tuple, type(None))):
            continue
        if vars(inner).get(key, value) != value:
            if hasattr(new, "remove"):
                new.remove()
            raise MemtrimStateError(
                f"memtrim.Plan.apply: {technique} rebuilds this {type(optimizer).__name__} over the same parameter "
                f"groups, but its {key} is {value!r} and the rebuilt one's {vars(inner)[key]!r} (a setting its "
                "constructor does not take by that name). Build the optimizer the plan names yourself, or plan "
                "without this technique (techniques=...)."
            )
    return new


def _applied_twice(optimizer: torch.optim.Optimizer, kind: type, technique: str) -> None:
    """A plan's optimizer technique applied to the optimizer a plan made already (a notebook cell run twice): wrapped
    again, a CPUOffloadOptimizer stepped host copies of host copies and the model never moved."""
    if isinstance(optimizer, kind):
        raise MemtrimStateError(
            f"memtrim.Plan.apply: {technique} would make a {kind.__name__} of this optimizer, which is one already "
            "(a plan applied twice: a notebook cell run again?). Expected the model and optimizer as built. To fix: "
            "build the model and its optimizer again, then apply the plan once."
        )


def _offload_state(applied: Applied) -> list[str]:
    optimizer = applied.optimizer
    _applied_twice(optimizer, CPUOffloadOptimizer, "offload_state")
    _check_replaceable(optimizer, "offload_state")
    if getattr(optimizer, "is_second_order", False):  # (timm's convention: Adahessian)
        raise MemtrimStateError(
            f"memtrim.Plan.apply: offload_state steps a host copy of this {type(optimizer).__name__} on host copies "
            "of the gradients, which have no graph, but it is a second-order optimizer (is_second_order): its step "
            "differentiates the gradients. Plan without offload_state (techniques=...)."
        )
    groups = [dict(group) for group in optimizer.param_groups]  # every option of each group, with its params
    applied.optimizer = _rebuilt(optimizer, lambda **options: CPUOffloadOptimizer(
        groups, type(optimizer), host=applied.host, **options), "offload_state")
    applied._undo.append(applied.optimizer.remove)
    if optimizer.state:  # an optimizer that has stepped (or loaded a checkpoint) goes on from its state
        applied.optimizer.load_state_dict(optimizer.state_dict())
    return [f"{type(optimizer).__name__} state and gradients in host memory"]


_STATE_FORMAT = {16: "bfloat16", 8: "blockwise float8", 4: "blockwise 4-bit codes"}


def _low_bit(bits: int) -> Callable[[Applied], list[str]]:
    def apply(applied: Applied) -> list[str]:
        optimizer = applied.optimizer
        _applied_twice(optimizer, LowBitAdamW, "state_bf16" if bits == 16 else f"state_{bits}bit")
        if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam) or any(
                g.get("amsgrad") or g.get("maximize") or (type(optimizer) is torch.optim.Adam and g["weight_decay"])
                for g in (*optimizer.param_groups, optimizer.defaults)):  # (defaults: a group added later)
            raise NotApplicable("low-bit state replaces AdamW (or Adam without weight decay), without amsgrad or "
                                "maximize")
        _check_replaceable(optimizer, f"state_{bits}bit" if bits != 16 else "state_bf16")
        if optimizer.state:
            raise MemtrimStateError(
                f"memtrim.Plan.apply: the low-bit state replaces this {type(optimizer).__name__}, which has state "
                "already (it has stepped, or loaded a checkpoint) that LowBitAdamW would start again from zero. "
                "Apply the plan to the optimizer before training."
            )
        keys = ("lr", "betas", "eps", "weight_decay")
        groups = [{k: g[k] for k in ("params", *keys)} for g in optimizer.param_groups]
        # (its defaults too: a group added later, progressive unfreezing, takes the user's options, not LowBitAdamW's)
        applied.optimizer = LowBitAdamW(groups, bits=bits, **{k: optimizer.defaults[k] for k in keys})
        return [f"AdamW state in {_STATE_FORMAT[bits]}"]

    return apply


def _offload(applied: Applied) -> list[str]:
    if applied.host == "meta":  # a prediction, traced on this machine's device for an accelerator target
        handle = offload_module(applied.model, include_cpu=True, host="meta")
    else:
        handle = offload_module(applied.model)
    applied._undo.append(handle.remove)
    return [handle.note]


TECHNIQUES: dict[str, Technique] = {
    t.name: t
    for t in (
        Technique("selective", "bitwise", "selective checkpointing of each block (keep matmul outputs)",
                  _checkpoint("save_matmuls")),
        Technique("checkpoint", "bitwise", "checkpoint each block (keep only its input)", _checkpoint(None)),
        Technique("offload", "bitwise", "saved activations wait in host memory", _offload),
        Technique("offload_state", "tolerance", "optimizer state and gradients in host memory, the step on the host "
                  "(CPUOffloadOptimizer; the host's kernels round differently from a GPU's)", _offload_state),
        Technique("state_bf16", "changed", "AdamW's moments in bfloat16 (LowBitAdamW(bits=16))", _low_bit(16)),
        Technique("state_8bit", "changed", "AdamW's moments in blockwise float8 (LowBitAdamW(bits=8))", _low_bit(8)),
        Technique("state_4bit", "changed", "AdamW's moments in blockwise 4-bit codes (LowBitAdamW(bits=4))",
                  _low_bit(4)),
        Technique("in_backward", "bitwise", "the optimizer step fused into backward (OptimizerInBackward)",
                  _in_backward()),
        Technique("in_backward_each", "bitwise", "the step fused into backward, one parameter at a time as soon "
                  "as its gradient is ready (bucket_bytes=0, peak='lowest')", _in_backward(bucket_bytes=0,
                                                                                           peak="lowest")),
    )
}
"""Every technique a plan can use, by name, in the order they are applied."""

EXCLUSIVE = (frozenset({"selective", "checkpoint"}), frozenset({"in_backward", "in_backward_each", "offload_state"}),
             frozenset({"state_bf16", "state_8bit", "state_4bit"}))
"""Techniques that do not combine (one checkpointing policy per block, one way of stepping the optimizer, one
state precision)."""

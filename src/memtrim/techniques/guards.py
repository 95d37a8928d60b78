"""Where the techniques' own autograd steps aside, and the clear errors they raise instead of torch's.

Shared by the lean activations (``activations/``), the norms that keep less (``norms/``), the recipes
(``recompute/``) and convert's rules: the modules run as torch's own ops under ``torch.compile`` and ``torch.func``
(:func:`plain_only`) and, for the rebuilt norms and ActLinear, under autocast (:func:`autocasting`) and under
saved-tensor hooks that are not memtrim's: a checkpointed region's, a user's (:func:`saves_checked`; recipe consumer
scopes stand aside there too); an in-place
change of a kept tensor and a double backward through a rebuilt norm raise a :class:`ConvertError` naming the module
(:func:`owner`) and saying what to do.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.hooks import RemovableHandle

from ..errors import ConvertError
from ..measure.hooks import top_saved_tensors_hooks

__all__ = [
    "CONSUMER_SCOPE_END", "CONVERTED", "DECISIONS_END", "GATED_MLP_END", "HOOKS_ENABLED", "INPUT_AND_FORWARD_HOOKS",
    "INPUT_HOOKS", "OUTPUT_HOOKS", "PRODUCER_SCOPE_END", "RECOMPUTE_HOOKS", "WatchedFusion", "activated",
    "as_if_capturing", "autocasting", "batched", "capturing", "fx_tracing", "hooks_allowed", "inplace_error",
    "keep_hook_ids", "kept_params", "mark_activated", "memtrims", "module_hooks", "no_double_backward", "owner",
    "plain_apply", "plain_only", "refuse_later_hooks", "register_end_hook", "saved_tensors", "saves_checked",
    "watch_registrations", "watch_replacement",
]


def defined_in(hook: Any, package: str) -> bool:
    """Whether ``hook`` (a function, bound method or partial of one) is defined in ``package``."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    found = getattr(hook, "__self__", None)
    where = type(found).__module__ if found is not None else getattr(hook, "__module__", "") or ""
    return where == package or where.startswith(package + ".")


def memtrims(hook: Any) -> bool:
    """Whether ``hook`` is one of memtrim's own (a function, bound method or partial of one defined in memtrim)."""
    return defined_in(hook, "memtrim")


# ---------------------------------------------------------------------- where the modules step aside
# looked up once: plain_only runs several times at every call of every converted module
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_IS_COMPILING = torch.compiler.is_compiling  # the function itself: torch.compile folds its calls to True
_FORWARD_AD = torch.autograd.forward_ad
_SYMBOLIC_TRACE = torch.fx._symbolic_trace
_GRAPH_TASK = torch._C._current_graph_task_id  # -1 outside a backward pass


def fx_tracing() -> bool:
    """True while ``torch.fx`` traces symbolically (``symbolic_trace``, torchvision's ``create_feature_extractor``):
    inputs are proxies, with no shape or value to check. (torch's ``is_fx_tracing()`` reads the same flag, and from
    torch 2.9 logs a warning at its first call.)"""
    return bool(getattr(_SYMBOLIC_TRACE, "_is_fx_tracing_flag", False))


_ACTIVATED = "_memtrim_activated"  # on a fused BatchNorm's output: the activation after it is applied already


RELU = "relu"
"""The mark of an output a fused BatchNorm + ReLU made (any of them: a ReLU applied twice is applied once)."""
FUSION = "memtrim_fusion"
"""Instance attribute on a BatchNorm convert fused with a LeakyReLU or ELU, and on that absorbed activation: the token
they share, the kind of the BatchNorm's marks (:func:`mark_activated`)."""


def mark_activated(output: torch.Tensor, kind: Any) -> torch.Tensor:
    """Mark ``output`` as a fused BatchNorm's, its activation applied, at its version now: the module that was that
    activation, an identity now (convert's ``Absorbed``), checks its input for the mark. A BatchNorm replaced after
    convert by a tool that rebuilds BatchNorms by class (``SyncBatchNorm.convert_sync_batchnorm``), without the
    activation, then gets it applied again (a ReLU) or raises, instead of leaving the activation out. ``kind``:
    :data:`RELU`, or the token convert gave this BatchNorm and its absorbed LeakyReLU or ELU (applied twice, those
    are not applied once: another BatchNorm's output is not this one's)."""
    try:
        version = None if output.is_inference() else output._version  # (inference tensors keep no version)
        setattr(output, _ACTIVATED, (kind, version))  # a change in place since would move the version
    except (AttributeError, TypeError):  # a tensor subclass without a __dict__: nothing checks it then
        pass
    return output


def activated(input: Any, kind: Any) -> bool | None:
    """True: ``input`` is the output of a fused BatchNorm of ``kind`` (:func:`mark_activated`) as it made it (or as
    far as can be told: an inference tensor has no version), or cannot carry the mark; False: it is, changed in place
    since; None: it is not."""
    mark = getattr(input, _ACTIVATED, None)
    if mark is None:
        return None if hasattr(input, "__dict__") else True
    if mark[0] != kind:
        return None
    return mark[1] is None or mark[1] == input._version


def plain_only(in_backward: bool = True) -> bool:
    """True under ``torch.compile`` (saved-tensor hooks and data-dependent shapes do not trace; the compiler plans its
    own memory), under ``torch.func`` transforms, in forward-mode AD (``torch.autograd.forward_ad``: a custom
    autograd.Function needs rules they do not have) and while ``torch.fx`` traces (:func:`fx_tracing`): the modules
    then run as torch's own ops, exactly the unconverted model. With ``in_backward`` (what keeps a recipe, whose
    rebuild is bitwise torch's), also in a forward that runs inside a backward pass under no saved-tensor hooks but
    memtrim's: reentrant checkpointing's recomputation, whose saves are used at once (the rebuilds' temporaries put a
    converted GPT-2's step peak 10 % above the plain model's, found by an adversarial pass). A non-reentrant
    checkpoint's recomputation runs under its own hooks, and must save what its forward saved; a norm rebuilt from its
    output (not torch's bits) keeps its form there, so the recomputed block trains as the converted one."""
    # one function, no calls of ours inside but in backward (about 70 calls per step of a converted resnet18)
    if _IS_COMPILING() or (_FUNCTORCH_ACTIVE is not None and _FUNCTORCH_ACTIVE()):
        return True
    if in_backward and _GRAPH_TASK() != -1:
        top = top_saved_tensors_hooks()
        if top is None or memtrims(top[0]):
            return True
    level = getattr(_FORWARD_AD, "_current_level", -1)  # >= 0 inside forward_ad.dual_level()
    return (isinstance(level, int) and level >= 0) or bool(getattr(_SYMBOLIC_TRACE, "_is_fx_tracing_flag", False))


RECOMPUTE_HOOKS = "_memtrim_recompute_hooks"
"""Attribute on memtrim's recompute pack functions: the saved-tensor hooks they pass what they keep to (or None)."""


class _HookIds:
    """Put on a module that memtrim hooks: unpickled (``torch.load`` of a whole model in another process), it moves
    torch's hook numbering past the ids the module's hooks were saved under. torch numbers hook handles from 0 in each
    process and keys a module's hooks by that number: a hook registered later on the loaded module under the id one
    of memtrim's hooks has replaced it in the dict, silently (a gated MLP's hook on its act: its saving gone; found by
    an adversarial pass)."""

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _hook_ids_restored, (RemovableHandle.next_id,)


_HOOK_IDS = _HookIds()

_OWN_HANDLES = [0]
_OWN_HANDLES_LOCK = threading.Lock()


def register_own(hooks: list[tuple[Callable[[Any], Any], Any]]) -> list[Any]:
    """Register each ``hook`` through its ``register`` (a tensor's ``register_hook``, a node's ``register_prehook``)
    and count the handles torch makes for them as memtrim's: :func:`foreign_handles` leaves them out. For hooks memtrim
    registers at every forward or step (a check's pre-hooks, OptimizerInBackward's output hooks and the ones of its
    two-pass backward): torch numbers every handle (``RemovableHandle.next_id``), and a converted model's norms walk
    its modules again for foreign hooks after any handle was made, so these made every converted model walk its
    modules at every forward (1.35 ms a forward of a 32-layer Llama on the CPU; an adversarial pass). Returns the
    handles."""
    with _OWN_HANDLES_LOCK:
        handles = [register(hook) for register, hook in hooks]
        _OWN_HANDLES[0] += len(hooks)
    return handles


def foreign_handles() -> int | None:
    """How many hook handles torch has made that :func:`register_own` did not (None: this torch does not number
    them). torch's count is not atomic across threads: a registration of memtrim's and one of another thread's made at
    once can count once, and the other's hook then goes unseen here (an adversarial pass forced it with a trace
    function; 1.86M registrations from another thread lost none on CPython 3.11)."""
    with _OWN_HANDLES_LOCK:
        count = getattr(RemovableHandle, "next_id", None)
        return None if count is None else count - _OWN_HANDLES[0]


def _hook_ids_restored(next_id: int) -> _HookIds:
    if RemovableHandle.next_id < next_id:
        RemovableHandle.next_id = next_id
    return _HOOK_IDS


_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def module_hooks(module: nn.Module) -> list[Any]:
    """Every forward, forward pre-, backward and backward pre-hook on ``module`` (memtrim's and others')."""
    return [h for name in _HOOK_DICTS for h in getattr(module, name, {}).values()]


def keep_hook_ids(*modules: nn.Module) -> Callable[[], None]:
    """Mark ``modules``, which memtrim puts hooks on, so that a hook registered after they are unpickled gets an id of
    its own (:class:`_HookIds`). Returns the undo, to run after the installer's hooks are removed: it drops the mark
    where no hook of memtrim's is left (a model pickled after ``remove()`` then loads without memtrim). Picklable."""
    for module in modules:
        module.__dict__.setdefault("_memtrim_hook_ids", _HOOK_IDS)
    return functools.partial(_forget_hook_ids, modules)


# the keys of memtrim's always_call forward hooks, one per role (negative: torch never numbers a handle so)
CONSUMER_SCOPE_END, PRODUCER_SCOPE_END, GATED_MLP_END, DECISIONS_END = -1, -2, -3, -4


def register_end_hook(module: nn.Module, hook: Callable[..., Any], key: int, *,
                      with_kwargs: bool = False) -> RemovableHandle:
    """``module.register_forward_hook(hook, always_call=True)`` (it runs where the forward raised, to close what the
    pre-hook opened), keyed in the module's hook dicts by ``key`` (one per role of memtrim's) instead of torch's
    running handle number. torch.compile guards an always_call hook by its key (``hook_id in
    _forward_hooks_always_called``), so keys numbered per module made each block of a model compiled block by block
    (``block.compile()`` on each layer) a graph of its own: a converted Llama's gated MLPs, 4 graphs for 4 layers where
    the plain model makes 1. A module already holding ``key`` keeps torch's number (compiled apart, still right)."""
    handle = module.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=True)
    if key in module._forward_hooks:
        return handle
    tables: tuple[dict[int, Any], ...] = (module._forward_hooks, module._forward_hooks_always_called,
                                          module._forward_hooks_with_kwargs)
    for table in tables:
        if handle.id in table:
            table[key] = table.pop(handle.id)  # (the hook was just appended: it stays last)
    handle.id = key
    return handle


def _forget_hook_ids(modules: tuple[nn.Module, ...]) -> None:
    for module in modules:
        hooks = module_hooks(module)
        if module.__dict__.get("_memtrim_hook_ids") is _HOOK_IDS and not any(memtrims(h) for h in hooks):
            del module.__dict__["_memtrim_hook_ids"]


_UNWRAP_IF_DEAD = getattr(torch._C._functorch, "unwrap_if_dead", None)


def plain_apply(function: type[torch.autograd.Function]) -> Callable[..., Any]:
    """``function.apply`` with less Python, for a per-call path that has just found :func:`plain_only` false. torch's
    ``Function.apply`` binds default arguments (for a ``setup_context``, which ours do not define), checks for
    functorch transforms (plain_only has), unwraps the tensors a finished transform left (kept by a side effect from
    inside ``torch.func.vjp``: passed on wrapped, the gradient stopped there and the input got none; found by an
    adversarial pass), then calls the C++ apply. This does the unwrapping and the call: about 9 Python calls a call
    of a norm where torch's made about 17."""
    apply = super(torch.autograd.Function, function).apply  # type: ignore[misc]
    unwrap, tensor = _UNWRAP_IF_DEAD, torch.Tensor
    if unwrap is None:  # (a torch without it: its own apply)
        return function.apply

    def applied(*args: Any) -> Any:
        return apply(*[unwrap(a) if isinstance(a, tensor) else a for a in args])

    return applied


HOOKS_ENABLED = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)  # (a per-call path reads it)


def hooks_allowed() -> bool:
    """Whether saved-tensor hooks may be entered now: not inside ``torch.autograd.graph.disable_saved_tensors_hooks``
    (entering any raises the user's message there). What would enter some runs as torch's own ops instead."""
    return HOOKS_ENABLED is None or bool(HOOKS_ENABLED())


def saves_checked() -> bool:
    """Whether what an op saves now is checked for in-place changes at unpack: by autograd (no saved-tensor hooks)
    or by memtrim's own hooks that repeat the check (a tracker, ``OffloadActivations``; a recompute scope passes what
    it keeps to the hooks below it). Not under others: a checkpoint's (which also recomputes what a node saved, and
    allows one unpack), ``save_on_cpu``'s, a user's. What rebuilds a tensor from an op's saved inputs (a node's, or
    ActLinear's) must not rely on those: an input changed in place would rebuild another tensor where torch kept the
    tensor itself. Everything convert changed runs as torch's own ops under those hooks: a user's may pack lossily
    (to bfloat16), and a rebuild from packed tensors is not what torch's backward reads from them; inside a checkpoint,
    keeping less of what is dropped anyway gains nothing, and torch's own ops let the recomputation stop early."""
    top = top_saved_tensors_hooks()
    while top is not None:
        if not hasattr(top[0], RECOMPUTE_HOOKS):
            return memtrims(top[0])
        top = getattr(top[0], RECOMPUTE_HOOKS)
    return True


def holds_values(x: torch.Tensor) -> bool:
    """Whether ``x`` has data: not a meta tensor, nor a fake one (as ``memtrim.plan`` traces)."""
    return not (x.is_meta or is_fake(x))


def capturing(x: torch.Tensor) -> bool:
    """Whether ``x`` is on a CUDA device whose current stream is capturing a CUDA graph: nothing may make the host
    wait for the GPU then (the capture fails), and what the host decides is recorded once, for every replay. Also
    true, on any device, inside :func:`as_if_capturing`."""
    return _AS_IF_CAPTURING or (x.is_cuda and torch.cuda.is_current_stream_capturing())


_AS_IF_CAPTURING = False


@contextlib.contextmanager
def as_if_capturing() -> Iterator[None]:
    """Every converted module runs inside as while a CUDA graph is captured (:func:`capturing` true), on any device:
    what a capture would record, run on the CPU (the tests, and benchmarks/convert_zoo.py's bytes kept under a
    capture). For one thread at a time; not for training."""
    global _AS_IF_CAPTURING
    before, _AS_IF_CAPTURING = _AS_IF_CAPTURING, True
    try:
        yield
    finally:
        _AS_IF_CAPTURING = before


def autocasting(x: torch.Tensor) -> bool:
    """Whether autocast is on for ``x``'s device type. The rebuilt norms and ActLinear then run as torch's own ops:
    autocast picks each op's dtype (LayerNorm in float32, Linear in the low precision), and an output kept in bfloat16
    would rebuild xhat with bfloat16's rounding where torch's backward reads the input in float32."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():  # the usual case, without building a device object
        return False
    return torch.is_autocast_enabled(x.device.type)


_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)  # a per-call path: looked up once (private; the
                                                                    # public per-device check follows it either way)


def any_autocast() -> bool:
    """Whether autocast is on for any device type (a recipe records it at its producer's call)."""
    if _ANY_AUTOCAST is not None:
        return bool(_ANY_AUTOCAST())
    return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


# ---------------------------------------------------------------------- clear errors instead of torch's
CONVERTED = "_memtrim_converted"
"""Instance attribute :func:`memtrim.convert` sets on every module a change touched (the rule's name)."""

_HOOK_KINDS = {"_forward_pre_hooks": "forward pre-hooks", "_forward_hooks": "forward hooks",
               "_backward_pre_hooks": "backward pre-hooks", "_backward_hooks": "backward hooks"}
OUTPUT_HOOKS = ("_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""The hooks that see a module's output or its gradient (not its input: a pruning or spectral-norm pre-hook)."""
INPUT_HOOKS = ("_forward_pre_hooks", "_backward_pre_hooks", "_backward_hooks")
"""The hooks that see a module's input or its gradients (not its output)."""
INPUT_AND_FORWARD_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
"""Those and the forward hooks, which see the input too: an absorbed activation that was not in place got the
BatchNorm's output, and gets the activation's output since convert (one in place, where input and output are one
tensor, got that already)."""


# ---------------------------------------------------------------------- a fused activation replaced later
# NOTE [ a fused activation replaced after convert ]
# A fused BatchNorm applies the activation after it, and that activation's module is an identity (or, torchvision's
# shared ReLU, passes the fused output through). A model changed after convert that registers another module in the
# activation's place (``model.act = nn.SiLU()``, a utility swapping every ReLU) would apply the new activation on top
# of the old one, silently. The BatchNorm keeps its activation in ``__dict__`` (no child: state_dict and
# named_modules are unchanged); one global module-registration hook of torch's marks a watched activation when
# another module is registered under one of its names, and the BatchNorm's next call raises
# (:func:`refuse_later_hooks`, which it runs at every call); registered again, the activation is in its place again.
# The BatchNorm also keeps weak references to the activation's places (parent, name), checked at every call: that
# sees a module written into ``_modules`` directly (``Sequential.insert``) or registered after ``del`` of the name.
# A copy or a pickle drops them (they are this model's modules) and keeps the registration watch alone. Not seen: a
# changed ``forward`` or ``__class__`` of the activation itself.
_PARTNER = "memtrim_partner"  # on a fused BatchNorm: the activation module it applies
_WATCHED = "memtrim_watched"  # on that activation: whether a registration replacing it is recorded
_REPLACED = "memtrim_replaced_by"  # on that activation: what was registered in its place, once it was
_PLACES = "memtrim_places"  # on a fused BatchNorm: (weakref to a parent, name) where its activation is registered
_registration_hook: Any = None


def _on_registration(parent: nn.Module, name: str, new: Any) -> None:
    """torch's global module-registration hook: record that a watched activation was replaced."""
    if parent.__dict__.get("_is_replica"):  # nn.DataParallel's replica, whose _modules start as the original's
        return
    modules = parent.__dict__.get("_modules")
    old = modules.get(name) if modules else None
    if old is new:
        return
    if old is not None and old.__dict__.get(_WATCHED):
        old.__dict__[_REPLACED] = f"{type(new).__name__} registered as {name!r}"
    if isinstance(new, nn.Module) and new.__dict__.get(_WATCHED):  # put back: in its place again
        new.__dict__.pop(_REPLACED, None)


def watch_registrations(bn: nn.Module) -> None:
    """Install torch's global registration hook if fused ``bn`` has an activation to watch: at convert, and when a
    converted model is unpickled or copied (a new process has no hook yet)."""
    global _registration_hook
    if _registration_hook is None and _PARTNER in bn.__dict__:
        _registration_hook = torch.nn.modules.module.register_module_module_registration_hook(_on_registration)


def watch_replacement(bn: nn.Module, activation: nn.Module,
                      places: list[tuple[nn.Module, str]]) -> Callable[[], None]:
    """Make fused ``bn`` raise at its next call once another module is registered in ``activation``'s place, or
    its ``places`` (parent, name) no longer hold it (NOTE [ a fused activation replaced after convert ]). Returns the
    undo."""
    bn.__dict__[_PARTNER] = activation
    bn.__dict__[_PLACES] = tuple((weakref.ref(parent), name) for parent, name in places)
    watch_registrations(bn)
    activation.__dict__[_WATCHED] = True  # (left on by the undo: torchvision's shared ReLU may serve other BatchNorms)
    activation.__dict__.pop(_REPLACED, None)

    def undo() -> None:
        bn.__dict__.pop(_PARTNER, None)
        bn.__dict__.pop(_PLACES, None)

    return undo


class WatchedFusion:
    """Mixin of memtrim's fused BatchNorms: a copy or pickle drops the places of the activation convert fused (weak
    references to this model's modules: the copy keeps the registration watch alone), and an unpickled one installs
    that watch in its process (NOTE [ a fused activation replaced after convert ])."""

    def __getstate__(self) -> dict:
        """``nn.Module``'s, without the places of a fused activation."""
        state = super().__getstate__()  # type: ignore[misc]
        state.pop(_PLACES, None)
        return state

    def __setstate__(self, state: dict) -> None:
        """``nn.Module``'s, and the registration watch in this process for a BatchNorm convert fused."""
        super().__setstate__(state)  # type: ignore[misc]
        watch_registrations(self)  # type: ignore[arg-type]


def refuse_later_hooks(module: nn.Module, fused: str, tables: tuple[str, ...]) -> None:
    """Raise if ``module``, which convert fused with a neighbour (``fused`` says how), has hooks of the user's in
    ``tables`` (the ones that would see a value fusion changed: a fused BatchNorm's output, already its ReLU's; the
    input of a ReLU that is now an identity): convert leaves hooked modules alone, so they were registered after it.
    A module convert did not change (``CONVERTED`` unset: built by hand) is left alone. Also raises for a fused
    BatchNorm whose activation was replaced since (NOTE [ a fused activation replaced after convert ]). Called at every
    call of a fused module: the usual case is five or six dictionary lookups. ``tables``: :data:`OUTPUT_HOOKS`,
    :data:`INPUT_HOOKS` or :data:`INPUT_AND_FORWARD_HOOKS`."""
    state = module.__dict__
    partner = state.get(_PARTNER)
    if partner is not None:
        places = state.get(_PLACES)
        if places is None or _IS_COMPILING():  # a copy, or torch.compile (torch 2.4 cannot trace a weakref's call)
            replaced = partner.__dict__.get(_REPLACED)
        else:
            replaced = None
            for parent_ref, name in places:
                parent = parent_ref()
                if parent is not None and parent._modules.get(name) is not partner:
                    replaced = f"{type(parent._modules.get(name)).__name__} in its place {name!r}"
        if state.get("qconfig") is not None:  # torch.ao's prepare_qat matches modules by exact class
            raise ConvertError(
                f"memtrim: {owner(module)} was fused by memtrim.convert with the activation after it, and a "
                "quantization tool (torch.ao.quantization's prepare/prepare_qat) gave it a qconfig after convert: "
                "it matches modules by their exact class, so the fused pair gets no observers or fake quantization "
                "and the model would train otherwise than the prepared unconverted one. To fix: train a model for "
                "quantization unconverted (memtrim.convert leaves modules that have a qconfig alone)."
            )
        if replaced is not None:
            raise ConvertError(
                f"memtrim: {owner(module)} was fused by memtrim.convert with the activation after it, which it "
                f"applies itself since; that activation was replaced after convert ({replaced}), so the model would "
                "apply the old activation and then the new one. Expected the activation convert fused; found it "
                "replaced. To fix: replace modules before memtrim.convert (convert the unconverted model again), or "
                "leave the pair out (module_filter)."
            )
    if state.get(CONVERTED) is None:
        return
    for attr in tables:  # (a loop, not a generator: no call per table)
        if state[attr]:
            break
    else:
        return
    found = [_HOOK_KINDS[attr] for attr in tables if any(not memtrims(hook) for hook in state[attr].values())]
    if found:
        raise ConvertError(
            f"memtrim: {owner(module)} was fused by memtrim.convert ({fused}), and has {' and '.join(found)} "
            "registered after convert: they would see the fused module's values, not those of the model before "
            f"convert. Expected no such hooks on a fused module; found {', '.join(found)}. To fix: register the hooks "
            "before convert (it leaves hooked modules alone), or convert a copy made before the hooks."
        )


def owner(module: nn.Module) -> str:
    """How errors name ``module``: by its name in the model when :func:`memtrim.convert` converted it."""
    return getattr(module, "memtrim_owner", None) or f"memtrim.nn.{type(module).__name__}"


def inplace_error(owner: str, error: RuntimeError, params: tuple[str, ...] = (),
                  input_needs_grad: bool = True) -> BaseException:
    """The error for an in-place change of a tensor ``owner`` keeps (torch's message otherwise names only a node).
    ``params``: the names of the parameters it rebuilds its input from that were changed (else its output was);
    ``input_needs_grad``: whether the module's input needed a gradient."""
    if "modified by an inplace operation" not in str(error):
        return error
    if params:
        unread = (" (torch's own norm does not read its bias in backward: the unconverted model trains through such "
                  "a change of the bias)" if "bias" in params else
                  " (its input needs no gradient here, as after frozen embeddings: the unconverted model, whose "
                  "backward then needs its weight only for the weight's own gradient, may train through such a "
                  "change)" if not input_needs_grad else "")
        return ConvertError(
            f"memtrim: {owner} rebuilds its input in backward from its output and its {' and '.join(params)}, and "
            f"{'they were' if len(params) > 1 else 'it was'} changed in place after the forward (an optimizer step "
            f"or an edit under no_grad before backward){unread}. Expected them unchanged until backward; found: "
            f"{error} To fix: change parameters after backward (loss.backward() before optimizer.step()), or leave "
            "this module out of memtrim.convert (module_filter)."
        )
    return ConvertError(
        f"memtrim: {owner} keeps its output for backward (that is how it saves memory), and that output was changed "
        f"in place after the forward. Expected it unchanged until backward; found: {error} To fix: clone the output "
        "before changing it in place (in the model's code, or in a forward hook on the module: convert's trace does "
        "not tell a hook's change from the module's own), or leave this module out of memtrim.convert "
        "(module_filter, or pass example_inputs so convert sees a change the model's code makes and skips it)."
    )


def saved_tensors(ctx: Any) -> tuple[Any, ...]:
    """``ctx.saved_tensors``, with autograd's in-place error turned into one that names ``ctx.owner`` and what was
    changed: a parameter of ``ctx.kept_params`` (name, tensor or None, version at the forward), or the output."""
    try:
        return ctx.saved_tensors
    except RuntimeError as e:
        changed = tuple(name for name, t, version in getattr(ctx, "kept_params", ())
                        if t is not None and t._version != version)
        needs = getattr(ctx, "needs_input_grad", None)  # (the input is the Function's first argument)
        raise inplace_error(ctx.owner, e, changed, bool(needs[0]) if needs else True) from e


def kept_params(weight: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[tuple[str, Any, int], ...]:
    """``ctx.kept_params`` for :func:`saved_tensors`: a norm's weight and bias with their versions now."""
    return (("weight", weight, -1 if weight is None else weight._version),
            ("bias", bias, -1 if bias is None else bias._version))


class _Refuse(torch.autograd.Function):
    """Identity in forward; its backward (a second derivative through a rebuilt norm) raises a ConvertError."""

    @staticmethod
    def forward(ctx: Any, message: str, n_anchors: int, *tensors: torch.Tensor) -> Any:
        ctx.message = message
        return tuple(t.view_as(t) for t in tensors[n_anchors:])

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise ConvertError(ctx.message)


_IS_BATCHED = getattr(torch._C._functorch, "is_batchedtensor", None)
_IS_LEGACY_BATCHED = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)


def batched(t: Any) -> bool:
    """Whether ``t`` is a tensor batched by vmap: ``autograd.grad(is_grads_batched=True)`` (and torch's
    ``jacobian``/``hessian`` with ``vectorize=True``) run backward under it. Its shape is one sample's, its layout
    not torch's to follow, and its ``requires_grad`` False even where its graph goes on (a custom Function sees
    none of that graph)."""
    return isinstance(t, torch.Tensor) and bool((_IS_BATCHED is not None and _IS_BATCHED(t))
                                                or (_IS_LEGACY_BATCHED is not None and _IS_LEGACY_BATCHED(t)))


def no_double_backward(backward: Callable[..., tuple]) -> Callable[..., tuple]:
    """Like ``torch.autograd.function.once_differentiable``, but differentiating the result raises a ConvertError
    naming the module (``ctx.owner``), and does so whenever create_graph is on and anything the gradients depend on
    (incoming gradients or the inputs and parameters kept in ctx) requires grad."""

    @functools.wraps(backward)
    def wrapper(ctx: Any, *grads: Any) -> tuple:
        if not torch.is_grad_enabled():  # (a backward without create_graph: the usual case, no context to enter)
            return backward(ctx, *grads)
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        vmapped = any(batched(g) for g in grads)
        found = ("a vmapped backward with create_graph=True (autograd.grad(is_grads_batched=True), jacobian or "
                 "hessian with vectorize=True), which hides the gradient's graph from memtrim: its second-order "
                 "terms would be lost" if vmapped else "a backward through its gradient")
        what = getattr(ctx, "rebuilds", "rebuilds its input from its output")  # (what ``ctx`` says it does instead)
        message = (f"memtrim: {ctx.owner} {what} in backward, so it has no second "
                   "derivative (double backward: create_graph=True followed by a backward through the gradient, "
                   f"as in a gradient penalty). Expected a single backward; found {found}. "
                   "To fix: leave this module out of memtrim.convert (module_filter), or use torch's module here.")
        if vmapped:  # (refused now: the refusal below would be attached to a graph vmap hides)
            raise ConvertError(message)
        anchors = [t for t in (*grads, *ctx.saved_tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not anchors:
            return outputs
        present = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor)]
        wrapped = _Refuse.apply(message, len(anchors), *anchors, *[outputs[i] for i in present])
        result = list(outputs)
        for i, t in zip(present, wrapped if isinstance(wrapped, tuple) else (wrapped,)):
            result[i] = t
        return tuple(result)

    return wrapper

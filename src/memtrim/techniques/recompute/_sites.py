"""Call-site installers: module hooks that mark producers' outputs, run consumers as consumer scopes, recompute a
gated MLP's product, or checkpoint a pointwise module. See NOTE [ recipes at consumer call sites ] in _core.py.

Every installer returns a :class:`Handle` whose ``remove()`` undoes it; none changes a module's class, parameters,
buffers or state_dict. The hooks are bound methods of small module-level classes (deepcopy and pickle work), with
per-thread state only.
"""

from __future__ import annotations

import enum
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from ...errors import ConvertError
from ...proof.compare import bitwise_equal
from ..guards import (
    CONSUMER_SCOPE_END,
    GATED_MLP_END,
    INPUT_AND_FORWARD_HOOKS,
    INPUT_HOOKS,
    PRODUCER_SCOPE_END,
    RELU,
    activated,
    autocasting,
    capturing,
    holds_values,
    hooks_allowed,
    keep_hook_ids,
    memtrims,
    plain_only,
    refuse_later_hooks,
    register_end_hook,
    saves_checked,
)
from ._core import (
    _close_interrupted,
    _scopes,
    enter_consumer_scope,
    entry_of,
    exit_consumer_scope,
    exit_if_on_top,
    is_recomputable,
    producing,
    register,
    source_of,
    tag_output,
)

__all__ = [
    "LIMITS", "Handle", "PassThroughReLU", "checkpoint_call", "keep_recipes_in", "recompute_gated_mlp",
    "recompute_op_output", "recompute_output", "recompute_sum",
]


class Handle:
    """Undoes one installer's changes (``remove()``; idempotent)."""

    users = 0  # a shared consumer scope's: the handles of keep_recipes_in not removed yet

    def __init__(self, *removers: Callable[[], Any]) -> None:
        self._removers = list(removers)

    def remove(self) -> None:
        """Undo the installer's changes (hooks removed, the previous forward restored); a second call does nothing."""
        while self._removers:
            self._removers.pop()()


_NODE_KEPT = ("; a call under saved-tensor hooks other than memtrim's (a checkpoint, save_on_cpu) or with a forward "
              "set on the instance keeps its output as torch does")
_NODE_FREED = ("a backward that reaches a consumer after an earlier backward freed the graph (retain_graph=False) "
               "raises, where torch alone might not: pass retain_graph=True to the earlier one")

LIMITS: dict[str, tuple[str, ...]] = {
    "recompute_output": (
        "the activation's output is rebuilt in backward by its own forward (bitwise); double backward exact",
        "steps aside under torch.compile and torch.func",
    ),
    "recompute_norm": (
        "the norm's output is rebuilt in backward by its own forward (bitwise); double backward exact",
        "saves nothing under autocast and steps aside under torch.compile and torch.func",
    ),
    "recompute_op_output": (
        "the activation's output is rebuilt in backward by the same op on what its autograd node saved (bitwise); "
        "double backward exact" + _NODE_KEPT, _NODE_FREED,
        "steps aside under torch.compile and torch.func",
    ),
    "recompute_op_norm": (
        "the norm's output is rebuilt in backward by the same op on what its autograd node saved and the eps the "
        "forward read (bitwise); double backward exact" + _NODE_KEPT, _NODE_FREED,
        "saves nothing under autocast and steps aside under torch.compile and torch.func",
    ),
    "recompute_gated_mlp": (
        "act(gate) and act(gate) * up are rebuilt in backward by the same ops (bitwise); double backward exact",
        "steps aside under torch.compile and torch.func",
    ),
    "recompute_sum": (
        "the lookups and their sum are rebuilt in backward by the same ops (bitwise); double backward exact",
        "the rebuild reads the embedding weights: one changed in place between forward and backward raises "
        "autograd's in-place error (torch's lookup keeps only the indices and would not), and a change through "
        "`.data` is not seen",
        "steps aside under torch.compile and torch.func",
    ),
    "checkpoint_call": (
        "the module's forward runs again in backward (torch.utils.checkpoint, non-reentrant, RNG state preserved)",
        "when its output is also rebuilt for a consumer, one recompute serves both (bitwise); double backward through "
        "it then agrees to rounding, not bitwise",
        "steps aside under torch.compile and torch.func",
    ),
    "batchnorm_relu": (
        "the ReLU output is rebuilt in backward by torch's BatchNorm forward on the BatchNorm's input: bitwise on the "
        "CPU; on CUDA bitwise where checked (an H200: cuDNN's kernel, float32 and float64, contiguous), not on every "
        "kernel path, so the report says not bitwise there; double backward exact where it is bitwise",
        "the rebuild reads the weight and bias (in eval also the running statistics, copied at the forward): one "
        "changed in place between forward and backward raises autograd's in-place error, the bias too (which torch's "
        "own backward does not read), and under saved-tensor hooks too; a change through `.data` is not seen",
        "steps aside under torch.compile and torch.func",
    ),
}
"""What convert's report says about each mechanism (copied into ``Change.limits``), by mechanism name."""


def _name(module: nn.Module, owner: str | None) -> str:
    return owner or getattr(module, "memtrim_owner", None) or type(module).__name__


def _active() -> bool:
    return torch.is_grad_enabled() and not plain_only()


# ---------------------------------------------------------------------- consumer scopes
def _enter(module: nn.Module, args: Any) -> None:
    enter_consumer_scope(module)


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    exit_consumer_scope()


def _forget_scope(module: nn.Module) -> None:
    module.__dict__.pop("_memtrim_consumer_scope", None)


def keep_recipes_in(module: nn.Module) -> Handle:
    """Run ``module``'s forward as a consumer scope: tensors its ops save that are marked recomputable keep their
    recipe instead (the consumer module itself — Linear, HF Conv1D, Conv2d — or the parent whose own forward calls
    ``F.linear``/``matmul`` on a marked tensor). Every other saved tensor passes through unchanged.

    Args:
        module: the consumer call site.

    Returns:
        A :class:`Handle` of this caller's use of the scope. The hooks are installed once per module and shared:
        ``remove()`` uninstalls them once every caller's handle is removed (two changes whose producers feed one
        consumer, a shared activation: removing one took the other's scope, and its saving, with it; found by an
        adversarial pass).
    """
    scope = module.__dict__.get("_memtrim_consumer_scope")
    if not (isinstance(scope, Handle) and scope._removers):
        forget = keep_hook_ids(module)
        pre = module.register_forward_pre_hook(_enter)
        post = register_end_hook(module, _exit, CONSUMER_SCOPE_END)
        # a partial, not a closure: the scope lives in the module's __dict__, so it must pickle (torch.save(model))
        # and deepcopy with the module (the removers run last first)
        scope = Handle(forget, functools.partial(_forget_scope, module), pre.remove, post.remove)
        module.__dict__["_memtrim_consumer_scope"] = scope
    scope.users = getattr(scope, "users", 0) + 1
    return Handle(functools.partial(_leave_scope, scope))


def _leave_scope(scope: Handle) -> None:
    """One user of a consumer scope is done with it: the last one removes it."""
    scope.users = getattr(scope, "users", 1) - 1
    if scope.users <= 0:
        scope.remove()


# ---------------------------------------------------------------------- producers
class _OutputRecipe:
    """Forward hooks of :func:`recompute_output`: a producer scope around the call (where the producer's own backward
    keeps its output), the output marked at its end."""

    # class-level defaults: hooks pickled before these options existed load with them
    parameters, under_autocast, keeps_output, strict = False, True, True, False
    setting_names: tuple[str, ...] = ()
    installed: tuple[Any, ...] | None = None  # the settings' values at install: the ones the rule's evidence saw
    hook_id: int | None = None  # the id of the hook that marks: a forward hook before it could change the output

    def __init__(self, module: nn.Module, fn: Callable[..., torch.Tensor] | None, owner: str | None,
                 parameters: bool = False, under_autocast: bool = True, keeps_output: bool = True,
                 strict: bool = False) -> None:
        self.module, self.fn, self.owner = module, fn, owner
        self.parameters, self.under_autocast, self.keeps_output = parameters, under_autocast, keeps_output
        self.strict = strict
        if parameters:  # the module's plain settings (eps, normalized_shape, ...), read at each call and rebuild
            self.setting_names = tuple(k for k, v in module.__dict__.items() if not k.startswith("_")
                                       and k != "training" and isinstance(v, (*_NUMBERS_AND_TEXT, tuple)))
            self.installed = _settings(module, self.setting_names)
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        del state["_local"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._local = threading.local()

    def _scopes(self) -> list[Any]:
        scopes = getattr(self._local, "scopes", None)
        if scopes is None:
            scopes = self._local.scopes = []
        return scopes

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if plain_only():  # torch.compile must trace none of this
            return
        scopes = self._scopes()
        while scopes:  # left open by an interrupted forward (see recompute._core._close_interrupted): a norm or an
            stale = scopes.pop()  # activation is never inside its own forward
            if stale is not None:
                exit_if_on_top(stale)
        scope: producing | None = None
        if _active() and (self.under_autocast or not _autocast_on(args, kwargs)):
            scope = producing()
            scope.__enter__()
        scopes.append(scope)

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if plain_only():
            return
        scopes = self._scopes()
        scope = scopes.pop() if scopes else None
        if scope is None:
            return
        try:
            if isinstance(output, torch.Tensor) and torch.is_grad_enabled():
                self.mark(output, args, kwargs)
        finally:
            scope.__exit__(None, None, None)

    def post_alone(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """The only hook where no producer scope is needed (``keeps_output=False``): everything is decided at the
        call's end (grad mode and autocast do not change inside a module's forward). One hook, fewer checks: this
        runs at every call of every converted norm and activation."""
        if (not isinstance(output, torch.Tensor) or not torch.is_grad_enabled() or plain_only()
                or (not self.under_autocast and _autocast_on(args, kwargs))):
            return
        self.mark(output, args, kwargs)

    def mark(self, output: torch.Tensor, args: tuple, kwargs: dict) -> None:
        """Register ``output`` as rebuilt from the call's tensors (callers have checked grad mode and plain_only)."""
        # NOTE: this runs at every call of every converted norm and activation: its Python is a measurable part of
        # a small model's step (benchmarks/convert_overhead.py), so the usual call takes the short paths
        if not output.requires_grad:  # the producer keeps nothing (a frozen norm on a frozen input): a recipe would
            return                    # make its consumers keep its input where torch keeps nothing
        module = self.module
        if self.hook_id is not None and _hook_before(module, self.hook_id):
            return  # a user's hook ran first (prepend=True, or a global one): the output may not be forward's
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):  # the usual call: module(x)
            positions = _FIRST
            resolved: list[Any] = [source_of(args[0])]
        else:
            flat = list(args) + list(kwargs.values())
            if not flat or not all(isinstance(a, torch.Tensor) or _plain(a) for a in flat):
                # only tensors and plain constants: the rebuild passes the call's other arguments again, and an
                # object the forward changes (a key/value cache it appends to) would be changed a second time
                return
            positions = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
            if not positions:
                return
            resolved = [source_of(flat[i]) for i in positions]
        owner = _name(module, self.owner)
        params: list[tuple[str, torch.Tensor]] = []
        if self.parameters:  # sources too: version-checked like autograd's, and what the rebuild reads
            if "parametrizations" in module._modules:  # a weight computed at each access (a random one: weight
                return                                  # dropout) would not be the forward's
            settings = _settings(module, self.setting_names)
            if self.installed is not None and settings != self.installed:
                # a setting changed since the rule looked (an Embedding given max_norm, whose forward then writes its
                # weight): the evidence no longer holds, so the output is kept as torch keeps it
                return
            params = [(k, p) for k, p in (*module._parameters.items(), *module._buffers.items()) if p is not None]
            resolved += [p for _, p in params]
        if self.fn is not None:
            register(output, self.fn, resolved, owner=owner, checked=True)
            return
        rebuild = _Rebuild(module, args, kwargs, positions, owner)
        if params:
            rebuild.params, rebuild.setting_names, rebuild.strict = params, self.setting_names, self.strict
            rebuild.settings = _state(module) if self.strict else settings
        register(output, rebuild, resolved, owner=owner, checked=True)


_FIRST = [0]  # the tensor positions of the usual call, module(x) (read only)
_NUMBERS_AND_TEXT = (bool, int, float, str, type(None))  # settings compared by value (with tuples of them)
_PLAIN = (*_NUMBERS_AND_TEXT, complex, torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


def _plain(value: Any) -> bool:
    """A constant a forward cannot change: None, a number, a string, a dtype, device or enum member."""
    return isinstance(value, _PLAIN)


def _hook_before(module: nn.Module, hook_id: int) -> bool:
    """Whether a forward hook not memtrim's runs before the one ``hook_id`` names (torch runs the global ones first,
    then the module's in order; ``prepend=True`` puts a hook first): it may return another output than
    ``forward``'s."""
    global_hooks = torch.nn.modules.module._global_forward_hooks
    if not global_hooks and next(iter(module._forward_hooks), None) == hook_id:  # the usual case: ours comes first
        return False
    for key, hook in (*global_hooks.items(), *module._forward_hooks.items()):
        if key == hook_id:
            return False
        if not memtrims(hook):
            return True
    return False


_MODULE_SLOTS = frozenset(nn.Module().__dict__) - {"training"}
"""What ``nn.Module.__init__`` puts in every module's ``__dict__`` (parameters, buffers, submodules, hook tables):
checked apart or not read by ``forward``; ``training`` is left in."""


def _state(module: nn.Module) -> dict[str, Any]:
    """Everything else a module's ``forward`` may read from its ``__dict__``: tensors by identity and version,
    numbers, strings and tuples of them by value, any other object by identity."""
    found: dict[str, Any] = {}
    for k, v in module.__dict__.items():
        if k in _MODULE_SLOTS or k.startswith("_memtrim"):
            continue
        if isinstance(v, torch.Tensor):
            found[k] = ("tensor", id(v), v._version)
        elif isinstance(v, (*_NUMBERS_AND_TEXT, tuple)):
            found[k] = v
        else:
            found[k] = ("object", id(v))
    return found


def _autocast_on(args: tuple, kwargs: dict) -> bool:
    x = args[0] if args and isinstance(args[0], torch.Tensor) else next(
        (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return x is not None and autocasting(x)


class _Rebuild:
    """A producer call's rebuild: ``module.forward`` on the call's arguments with the tensors replaced by the
    rebuild's sources (constants and keyword names as in the call). With ``params`` (the module's own parameters,
    sources after the call's tensors), the rebuild reads the module as the forward did: the parameters it had then (a
    parameter replaced since, by assignment or ``load_state_dict(assign=True)``, is swapped back for the call with
    ``torch.func.functional_call``) and, if its settings (``eps``, ...; with ``strict`` everything else in its
    ``__dict__``, ``training`` included) changed since, it raises instead of rebuilding another output.

    An object with slots, not a closure: one is made at every producer call."""

    __slots__ = ("module", "args", "names", "positions", "owner", "params", "setting_names", "strict", "settings")

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, positions: list[int], owner: str) -> None:
        self.module, self.positions, self.owner = module, positions, owner
        # the call's arguments with its tensors left out (None), then its keyword arguments' values in order
        self.args: tuple[Any, ...] | None = (None if positions is _FIRST else
                                             tuple(None if isinstance(a, torch.Tensor) else a
                                                   for a in (*args, *kwargs.values())))
        self.names: tuple[str, ...] = tuple(kwargs)
        self.params: list[tuple[str, torch.Tensor]] = []
        self.setting_names: tuple[str, ...] = ()
        self.strict = False
        self.settings: Any = None  # the settings at the call (a tuple of setting_names' values; strict: a dict)

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        module = self.module
        if self.args is None:  # module(x)
            call_args: Any = tensors[:1]
            call_kwargs: dict[str, Any] = {}
        else:
            flat = list(self.args)
            for i, t in zip(self.positions, tensors):
                flat[i] = t
            n_args = len(flat) - len(self.names)
            call_args, call_kwargs = flat[:n_args], dict(zip(self.names, flat[n_args:]))
        params = self.params
        if not params:
            return module.forward(*call_args, **call_kwargs)
        now = _state(module) if self.strict else _settings(module, self.setting_names)
        if now != self.settings:  # (==: identity or equality, item by item)
            self._changed(now)
        found, buffers = module._parameters, module._buffers
        if all((found[name] if name in found else buffers.get(name)) is p for name, p in params):
            return module.forward(*call_args, **call_kwargs)
        forward_params = {name: t for (name, _), t in zip(params, tensors[len(self.positions):])}
        return torch.func.functional_call(module, forward_params, tuple(call_args), call_kwargs)

    def _changed(self, now: Any) -> None:
        before = self.settings if self.strict else dict(zip(self.setting_names, self.settings))
        now = now if self.strict else dict(zip(self.setting_names, now))
        changed = [k for k in {**before, **now} if not _same(before.get(k, _UNSET), now.get(k, _UNSET))]
        if changed:
            what = ", ".join(f"{k}: {_shown(before.get(k, _UNSET))} -> {_shown(now.get(k, _UNSET))}" for k in changed)
            raise ConvertError(
                f"memtrim: {self.owner} rebuilds its output in backward from its input, and its settings changed "
                f"since the forward ({what}); torch would use the forward's output. To fix: change the module after "
                "backward, or leave it out of memtrim (module_filter, or remove() the handle)."
            )


_UNSET = ("unset",)


def _same(a: Any, b: Any) -> bool:
    return a is b or a == b


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "unset"
    if isinstance(value, tuple) and value[:1] == ("tensor",):
        return f"a tensor at version {value[2]}"
    if isinstance(value, tuple) and value[:1] == ("object",):
        return "an object"
    return repr(value)


def _settings(module: nn.Module, names: tuple[str, ...]) -> tuple[Any, ...]:
    """The values of a module's plain settings ``names`` (``eps``, ``normalized_shape``, ...: the public numbers,
    strings and tuples of them its ``__dict__`` held when the recipe was installed; ``training`` left out)."""
    found = module.__dict__
    return tuple(found.get(k) for k in names)


def recompute_output(module: nn.Module, fn: Callable[..., torch.Tensor] | None = None, *,
                     owner: str | None = None, parameters: bool = False, under_autocast: bool = True,
                     keeps_output: bool = True, strict: bool = False) -> Handle:
    """Mark ``module``'s output, after each call, as recomputable from its tensor arguments.

    The default rebuild is the module's own forward on the same arguments, so it is bitwise for any activation
    class (HF ``ACT2FN`` classes, timm's). The module's own saves during the call are decided at its end, so an
    activation whose backward keeps its output (relu, sigmoid, tanh) keeps the recipe too. Calls whose output
    shares a storage with an input (``inplace=True``) keep their output as usual.

    Args:
        module: a producer whose forward is a pure function of its tensor arguments (no RNG, no side effects), whose
            inputs are kept for backward anyway (GELU, SiLU, ... keep their input). A call that also passes anything
            but plain constants (None, numbers, strings, dtypes, devices, enum members: a list, or an object such as
            a key/value cache the forward appends to) keeps its output as usual.
        fn: the rebuild, called with the call's tensor arguments; default: the module's forward.
        owner: how errors name the module (default: its ``memtrim_owner`` label or class name).
        parameters: the module's own parameters and buffers are sources too (a LayerNorm's weight and bias): one
            changed in place between forward and backward raises autograd's error instead of rebuilding another
            output, one replaced is swapped back for the rebuild, and a changed plain setting (``eps``) raises.
            A module with parametrizations (its weight computed at each access) is not marked.
        strict: with ``parameters``, everything else in the module's ``__dict__`` is a setting too (its ``training``
            flag, plain and private attributes, tensors that are not buffers: by identity and version), read at each
            call: any of them changed before backward raises instead of rebuilding another output. For modules
            memtrim does not know (``recompute_modules``).
        keeps_output: False when the module's own backward does not keep its output (LayerNorm, GELU, SiLU keep
            their input): its saves then pass straight on, without a producer scope deciding them at the call's end
            (less Python per call). Where it does keep it, False would leave the output kept: correct, no saving.
        under_autocast: False leaves calls under autocast unmarked (a norm that autocast runs in float32 would
            rebuild, without autocast, in its input's dtype).

    Returns:
        A :class:`Handle`. Marking alone saves nothing: the consumers that keep the output need
        :func:`keep_recipes_in`.
    """
    wrapper = _checkpointed(module)
    if wrapper is not None and fn is None and next(module.parameters(), None) is None:
        # checkpointed too: one recompute serves both (NOTE [ one recompute for a checkpointed activation and its
        # consumers ])
        wrapper.recipe_owner = _name(module, owner)

        def unshare() -> None:
            wrapper.recipe_owner = None

        return Handle(unshare)
    hooks = _OutputRecipe(module, fn, owner, parameters, under_autocast, keeps_output, strict)
    forget = keep_hook_ids(module)
    if not keeps_output:  # nothing to open before the call: one hook
        post = module.register_forward_hook(hooks.post_alone, with_kwargs=True)
        hooks.hook_id = post.id
        return Handle(forget, post.remove)
    pre = module.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    post = register_end_hook(module, hooks.post, PRODUCER_SCOPE_END, with_kwargs=True)
    hooks.hook_id = post.id
    return Handle(forget, pre.remove, post.remove)


class _OpTag:
    """The forward hook of :func:`recompute_op_output`: tags the node that made the output (one per module)."""

    hook_id: int | None = None  # the id of this hook (pickled before it existed: None, nothing checked)

    def __init__(self, owner: str, eps: str | None) -> None:
        self.owner, self.eps = owner, eps

    def tag(self, module: nn.Module, args: tuple, output: Any) -> None:
        # NOTE: this runs at every call of every converted LayerNorm and activation: the short path
        if plain_only() or not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        if "forward" in module.__dict__:  # a forward set on the instance (memtrim.checkpoint_modules, a user's) may
            return                         # run the op under hooks this hook, outside it, does not see
        if self.hook_id is not None and _hook_before(module, self.hook_id):
            # a user's hook ran first (prepend=True, or a global one): it may have changed the output in place
            # under no_grad, which leaves its node and moves only the version this tag would take as the op's
            return
        if self.eps is None:
            tag_output(output, self.owner)
            return
        eps = module.__dict__.get(self.eps)  # the forward's eps: read now, a later change does not reach the rebuild
        if isinstance(eps, float):
            tag_output(output, self.owner, eps)


def recompute_op_output(module: nn.Module, *, owner: str | None = None, eps: str | None = None) -> Handle:
    """Let the consumers of ``module``'s output rebuild it from the autograd node of the op that made it: the same
    op on what that node saved, so bitwise (NOTE [ recipes from the producer's autograd node ] in _core.py). Less
    Python per call than :func:`recompute_output`, and no settings to compare: the node holds the weight, bias and
    input the forward used, and autograd checks them for in-place changes as it does for its own backward.

    Args:
        module: a module whose output is one op's output, or a view of one: a LayerNorm (``native_layer_norm``) or
            an activation of ``NODE_OPS`` (gelu, silu, ...; any class). A call whose output another op made (or
            changed in place) keeps it as usual.
        owner: how errors name the module (default: its ``memtrim_owner`` label or class name).
        eps: for a LayerNorm, the name of the module attribute its forward passes as eps (the node does not keep
            it): read at each call. None for an activation.

    Returns:
        A :class:`Handle`; ``remove()`` uninstalls the hook. Marking alone saves nothing: the consumers that keep
        the output need :func:`keep_recipes_in`.
    """
    if _checkpointed(module) is not None:  # one recompute serves both (recompute_output)
        return recompute_output(module, owner=owner)
    tagger = _OpTag(_name(module, owner), eps)
    forget = keep_hook_ids(module)
    hook = module.register_forward_hook(tagger.tag)
    tagger.hook_id = hook.id
    return Handle(forget, hook.remove)


# ---------------------------------------------------------------------- gated MLP
def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


class _GatedMLP:
    """Forward hooks of :func:`recompute_gated_mlp` (per-thread state of the call in flight)."""

    def __init__(self, owner: str, last: tuple[tuple[str, int], ...] = ()) -> None:
        self.owner = owner
        self.last = last  # (name in the MLP, id of our forward hook on it) of the act and up
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"owner": self.owner, "last": self.last}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["owner"], state.get("last", ()))  # type: ignore[misc]

    def _state(self) -> dict[str, Any]:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = {}
        return state

    # NOTE: these hooks run at every call of every converted MLP: each checks plain_only once, and a tensor with a
    # grad_fn stands for grad mode on (a module's hooks run in its forward's grad mode). The consumer scope starts in
    # the later of the act's and up's hooks, once a and u are made (the saves before it pass no hooks: Python at every
    # save), where ours is the last forward hook on both: a producer scope that another installer put on the act or up
    # and that closes after our hook would close ours (tried on 2026-11-30). Otherwise it spans the MLP's whole call,
    # as it did before; the later start keeps more in unusual MLPs (a save of a before up runs: README). A tensor
    # changed in place without a graph (under no_grad its grad_fn stays) between the call that made it and down's call
    # would be rebuilt without the change: ``a`` and ``u`` must still have the versions they had then, and ``m`` its
    # first. State is kept only during the MLP's call, which clears it at its end.
    def enter(self, module: nn.Module, args: Any) -> None:
        if plain_only():
            return
        state = self._state()
        state.clear()
        state["call"] = module  # this MLP's call is in flight (an act shared with another MLP runs outside it too)
        if not self._deferred(module):
            enter_consumer_scope(module, checked=True)
            state["scope"] = True
            return
        stack = _scopes()
        if stack:  # one of this MLP's scopes an interrupted call left open: closed as enter_consumer_scope does
            _close_interrupted(stack, id(module))

    def _deferred(self, module: nn.Module) -> bool:
        """Whether the scope can wait until ``a`` and ``u`` are made (entered in the later of their hooks): no
        forward hook runs after ours on the act or ``up`` (one that closes a producer scope would close ours). Not
        for hooks pickled before ``last`` was kept (their ids unknown)."""
        if not self.last:
            return False
        for name, hook_id in self.last:
            hooked = module._modules.get(name)
            if hooked is None and "." in name:
                try:
                    hooked = module.get_submodule(name)
                except AttributeError:  # (replaced by a function or removed since: its hooks never run)
                    return False
            if hooked is None or next(reversed(hooked._forward_hooks), None) != hook_id:
                return False
        return True

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if plain_only():
            return
        state = self._state()
        scoped = "scope" in state
        state.clear()  # nothing outlives the call: no graph kept alive by a forward without backward
        if scoped:
            exit_consumer_scope(checked=True)

    def _both_made(self, state: dict[str, Any]) -> None:
        """``a`` and ``u`` are made: the scope starts here (deferred: the saves of gate, up and the act before it
        pass no hooks), before the product saves ``a`` and ``down`` saves ``m``."""
        if "scope" not in state:
            enter_consumer_scope(state["call"], checked=True)
            state["scope"] = True

    def act_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if plain_only():
            return
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            state = self._state()
            entry = entry_of(output) if "call" in state else None  # (outside the call: nothing would clear it)
            if entry is not None:  # marked by recompute_output's hook, which runs first
                state["a"] = (entry, output.grad_fn._sequence_nr(), output, output._version)
                if "u" in state:
                    self._both_made(state)

    def up_done(self, module: nn.Module, args: Any, output: Any) -> None:
        if plain_only():
            return
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            state = self._state()
            if "call" in state:
                state["u"] = (output, output.grad_fn._sequence_nr(), output._version)
                if "a" in state:
                    self._both_made(state)

    def down_pre(self, module: nn.Module, args: tuple) -> None:
        if plain_only():
            return
        state = self._state()
        a, u = state.pop("a", None), state.pop("u", None)
        if a is None or u is None or not args or not isinstance(args[0], torch.Tensor):
            return
        m = args[0]
        node = m.grad_fn
        if (node is None or type(node).__name__ != "MulBackward0" or m._version != 0 or a[2]._version != a[3]
                or u[0]._version != u[2]):
            return
        inputs = [n._sequence_nr() if n is not None else None for n, _ in node.next_functions]
        up = source_of(u[0])  # up's output rebuilt too (memtrim.recompute_modules): a nested recipe
        if inputs == [a[1], u[1]]:
            sources: list[Any] = [a[0], up]
        elif inputs == [u[1], a[1]]:
            sources = [up, a[0]]
        else:
            return  # not act(gate(x)) * up(x) in this call: m is kept as usual
        register(m, _mul, sources, owner=self.owner, checked=True)


def recompute_gated_mlp(mlp: nn.Module, *, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
                        act: str = "act_fn", owner: str | None = None, act_keeps_output: bool = True) -> Handle:
    """Keep only ``g = gate(x)`` and ``u = up(x)`` in ``down(act(g) * u)`` (Llama, Mistral, Qwen MLPs).

    ``a = act(g)`` (kept by the product) and ``m = a * u`` (kept by ``down``) are rebuilt in backward by the act's
    own forward and the same multiplication: bitwise. Per call, ``m`` is recomputed only if its grad_fn is a
    multiplication whose two inputs are exactly ``a``'s and ``u``'s nodes, and none of the three was changed in place
    since its op made it; otherwise it is kept as usual.

    Args:
        mlp: the MLP module; ``gate``, ``up``, ``down``, ``act``: names of its submodules.
        owner: how errors name it (default: its ``memtrim_owner`` label or class name).
        act_keeps_output: False where the act's backward keeps only its input (silu, gelu: what convert's rule sees
            in the trace): its saves then pass straight on, one hook fewer per call. True (the default) runs the act
            as a producer scope, whose own saved output keeps the recipe too (sigmoid, tanh).

    Returns:
        A :class:`Handle`.
    """
    name = _name(mlp, owner)
    act_module, up_module, down_module = (mlp.get_submodule(n) for n in (act, up, down))
    hooks = _GatedMLP(name)
    marks = recompute_output(act_module, owner=f"{name}.{act}", keeps_output=act_keeps_output)
    forget = keep_hook_ids(act_module, up_module, down_module, mlp)
    act_hook = act_module.register_forward_hook(hooks.act_done)  # after recompute_output's: a is marked by then
    up_hook = up_module.register_forward_hook(hooks.up_done)
    hooks.last = ((act, act_hook.id), (up, up_hook.id))
    removable = (
        act_hook,
        up_hook,
        down_module.register_forward_pre_hook(hooks.down_pre),
        mlp.register_forward_pre_hook(hooks.enter),
        register_end_hook(mlp, hooks.exit, GATED_MLP_END),
    )
    return Handle(forget, marks.remove, *(h.remove for h in removable))  # (removed last first)


# ---------------------------------------------------------------------- a sum of recomputable outputs
def _sum_tree(node: Any, leaves: dict[int, int], depth: int = 0) -> int | tuple | None:
    """``node``'s graph as a tree of additions over ``leaves`` (a grad_fn's sequence number -> leaf index): an int
    for a leaf, ``(left, right)`` for ``left + right``; None if anything else (another op, ``alpha != 1``, an input
    without a graph) is in it."""
    if node is None or depth > 8:
        return None
    leaf = leaves.get(node._sequence_nr())
    if leaf is not None:
        return leaf
    if node.name() != "AddBackward0" or node._saved_alpha != 1:
        return None
    (left, _), (right, _) = node.next_functions
    a, b = _sum_tree(left, leaves, depth + 1), _sum_tree(right, leaves, depth + 1)
    return None if a is None or b is None else (a, b)


def _evaluate(tree: int | tuple, *sources: torch.Tensor) -> torch.Tensor:
    if isinstance(tree, int):
        return sources[tree]
    return _evaluate(tree[0], *sources) + _evaluate(tree[1], *sources)


class _Sum:
    """Forward hooks of :func:`recompute_sum`: each producer's last marked output on this thread (held until the
    consumer's call, so an in-place change of it before the sum is seen), and the consumer's pre-hook."""

    def __init__(self, owner: str, n_producers: int) -> None:
        self.owner, self.n_producers = owner, n_producers
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        return {"owner": self.owner, "n_producers": self.n_producers}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["owner"], state["n_producers"])  # type: ignore[misc]

    def _made(self) -> list[Any]:
        made = getattr(self._local, "made", None)
        if made is None:
            made = self._local.made = [None] * self.n_producers
        return made

    def producer_done(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if plain_only():
            return
        made = self._made()
        made[index] = None
        if isinstance(output, torch.Tensor) and output.grad_fn is not None and _active():
            entry = entry_of(output)  # marked by recompute_output's hook, which runs first
            if entry is not None:
                made[index] = (output, entry, output.grad_fn._sequence_nr())

    def consumer_pre(self, module: nn.Module, args: tuple) -> None:
        if plain_only():
            return
        made = self._made()
        found = [m for m in made if m is not None]
        made[:] = [None] * self.n_producers  # nothing outlives the call
        # (under torch.jit.trace the check's ops below would join the traced graph, and while a CUDA graph is
        # captured its comparison, which waits for the GPU, would fail the capture: the sum is kept as usual there)
        if (not found or not args or not isinstance(args[0], torch.Tensor) or not _active() or torch.jit.is_tracing()
                or capturing(args[0])):
            return
        x = args[0]
        if x.grad_fn is None or entry_of(x) is not None:
            return  # no graph, or a producer's output itself (already marked)
        # a producer's output changed in place since (its version moved) is no leaf: the sum is kept as usual
        alive = [(t, e, node) for t, e, node in found if t._version == e.version]
        tree = _sum_tree(x.grad_fn, {node: i for i, (_, _, node) in enumerate(alive)})
        if tree is None:
            return
        # the graph does not show an edit of the sum under no_grad (its version moves, its grad_fn stays): the
        # same additions of the lookups must give it, bit for bit (fake and meta tensors, as a plan traces, have no
        # values and train nothing: marked as real ones would be)
        if holds_values(x):
            with torch.no_grad():
                if not bitwise_equal(_evaluate(tree, *(t for t, _, _ in alive)), x):
                    return
        register(x, functools.partial(_evaluate, tree), [e for _, e, _ in alive], owner=self.owner)


def recompute_sum(consumers: list[nn.Module], producers: list[nn.Module], *, owner: str) -> Handle:
    """Mark a consumer's first argument, when it is a sum of the ``producers``' outputs in this forward (``a + b``,
    ``(a + b) + c``, ``s += c``; nothing else between), as that sum: rebuilt in backward by the same additions, in
    the same order, of the producers' rebuilt outputs (bitwise). GPT-style token + position embeddings kept by the
    first norm.

    Per call, the argument's grad_fn graph decides: only additions (``alpha`` 1) whose leaves are the producers'
    outputs, unchanged since they were made, and adding those outputs again must give the argument bit for bit (an
    edit of the sum under no_grad keeps the graph); anything else is kept as usual.

    Args:
        consumers: the modules whose first argument is the sum (each needs :func:`keep_recipes_in` to keep the
            recipe).
        producers: modules whose outputs :func:`recompute_output` marks (installed here too, for a pure forward of
            tensor arguments and parameters: an embedding lookup).
        owner: how errors name the sum.

    Returns:
        A :class:`Handle`.
    """
    hooks = _Sum(owner, len(producers))
    removers: list[Callable[[], Any]] = []
    for i, producer in enumerate(producers):
        removers.append(recompute_output(producer, owner=f"{owner}: {_name(producer, None)}", parameters=True,
                                         keeps_output=False).remove)
        removers.append(producer.register_forward_hook(functools.partial(hooks.producer_done, i)).remove)
    removers.insert(0, keep_hook_ids(*producers, *consumers))
    removers += [consumer.register_forward_pre_hook(hooks.consumer_pre).remove for consumer in consumers]
    return Handle(*removers)


# ---------------------------------------------------------------------- pointwise modules: checkpoint the call
class _Checkpointed:
    """Set as a module's instance ``forward`` (its bound ``__call__``: :func:`checkpoint_call`): runs the class's (or
    the previous instance) forward under non-reentrant checkpoint; or, once :func:`recompute_output` also marks the
    module's output (``recipe_owner`` set), under :class:`_SharedRecompute`, so that backward runs the forward once
    for both (NOTE [ one recompute for a checkpointed activation and its consumers ])."""

    def __init__(self, module: nn.Module, inner: Callable[..., Any] | None) -> None:
        self.module, self.inner = module, inner
        self.recipe_owner: str | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own forward. (Not ``forward.__get__(module)``: torch 2.11's compiler breaks the graph on a
        descriptor's ``__get__``, 9 breaks in a converted GPT-2.)"""
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.forward
        # inside a checkpointed region (memtrim's checkpoint_modules, HF gradient checkpointing) the region keeps its
        # inputs alone: a checkpoint of its own would recompute this forward a second time in backward
        if not _active() or not saves_checked() or not hooks_allowed() or not any(
                isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        if self.recipe_owner is not None and not kwargs and all(isinstance(a, torch.Tensor) for a in args):
            cell = _Graph(fn)
            output = _SharedRecompute.apply(cell, *args)
            if isinstance(output, torch.Tensor):
                register(output, cell.rebuild, [source_of(a) for a in args], owner=self.recipe_owner)
            return output
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)


# NOTE [ one recompute for a checkpointed activation and its consumers ]
# A pointwise module made of several ops (HF NewGELUActivation: pow, mul, add, tanh...) is checkpointed (it keeps
# only its input) and its output is also a recipe for its consumer (the next Linear keeps the input instead). In
# backward the consumer comes first and rebuilds the output; then the activation's own backward needs the forward's
# intermediates. Done separately, the forward runs twice in backward. Instead the consumer's rebuild runs the
# forward with grad on detached inputs and leaves that graph in a per-call cell, and the activation's backward
# differentiates it (running the forward itself only when no rebuild came first). Same ops on the same values: the
# gradients are those of the checkpointed call, bitwise. With create_graph=True the backward runs the forward on
# the saved inputs themselves (so the gradient has a history) and drops any graph the cell holds. Only for modules
# without parameters and with no randomness (recompute_output's contract): the Function has no parameter inputs.
class _Graph:
    """One call's forward, and the graph a consumer's rebuild made of it until the call's backward takes it."""

    __slots__ = ("fn", "graph")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.graph: tuple[list[torch.Tensor], torch.Tensor] | None = None

    def run(self, inputs: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], torch.Tensor]:
        leaves = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in inputs]
        with torch.enable_grad():
            return leaves, self.fn(*leaves)

    def rebuild(self, *sources: torch.Tensor) -> torch.Tensor:
        """The recipe's function: the output, keeping its graph for the call's backward."""
        self.graph = self.run(sources)
        return self.graph[1].detach()

    def take(self) -> tuple[list[torch.Tensor], torch.Tensor] | None:
        graph, self.graph = self.graph, None
        return graph


class _SharedRecompute(torch.autograd.Function):
    """A parameterless pointwise call that keeps its inputs and differentiates a recomputed forward in backward (NOTE
    [ one recompute for a checkpointed activation and its consumers ])."""

    @staticmethod
    def forward(ctx: Any, cell: _Graph, *inputs: torch.Tensor) -> Any:
        ctx.cell = cell
        ctx.save_for_backward(*inputs)
        return cell.fn(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        inputs = ctx.saved_tensors
        graph = ctx.cell.take()
        if torch.is_grad_enabled():  # create_graph=True: a gradient with a history, through the inputs' own
            # graph, taken with respect to aliases of the inputs: with respect to the inputs themselves, the hooks the
            # user registered on them would run on this inner gradient, and again in the outer backward
            with torch.enable_grad():
                leaves = [t.view_as(t) if t.requires_grad else t for t in inputs]
                output = ctx.cell.fn(*leaves)
        else:
            leaves, output = graph if graph is not None else ctx.cell.run(inputs)
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[1:]) if need]
        found = torch.autograd.grad(output, [leaves[i] for i in wanted], grad, allow_unused=True,
                                    create_graph=torch.is_grad_enabled())
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        for i, g in zip(wanted, found):
            grads[i] = g
        return (None, *grads)


_BOUND_FORWARD = torch.__version__ >= "2.5"  # (torch 2.5 inlines modules' forwards: inline_inbuilt_nn_modules)


def _checkpointed(module: nn.Module) -> _Checkpointed | None:
    """The :class:`_Checkpointed` that :func:`checkpoint_call` set as ``module``'s forward (its bound ``__call__``;
    the object itself in a model pickled before), if any."""
    forward = module.__dict__.get("forward")
    found = forward if isinstance(forward, _Checkpointed) else getattr(forward, "__self__", None)
    return found if isinstance(found, _Checkpointed) else None


def checkpoint_call(module: nn.Module) -> Handle:
    """Keep only ``module``'s inputs: its forward runs under non-reentrant ``torch.utils.checkpoint`` and is recomputed
    in backward (RNG state preserved). For pointwise modules that keep more than their input (HF
    ``NewGELUActivation`` keeps 4 input-sized tensors).

    Checkpoint saves the inputs through the saved-tensor hooks outside it, so memtrim's tracker counts them (and a
    marked input keeps its recipe); it nests inside an outer checkpoint or HF gradient checkpointing. Under
    torch.compile/torch.func, with grad off, or with no input requiring grad the forward runs plainly.

    Args:
        module: a module whose forward is pointwise (or otherwise cheap) in its inputs.

    Returns:
        A :class:`Handle`; ``remove()`` restores the previous forward.
    """
    inner = module.__dict__.get("forward")
    wrapper = _Checkpointed(module, inner)
    # its bound __call__, not the object: torch.compile guards a callable object by identity, a bound method by its
    # function, so a model compiled block by block (block.compile() on each layer) made a graph per block (HF GPT-2's
    # NewGELUActivation: 4 graphs for 4 layers where the plain model makes 1). A bound method pickles as
    # getattr(wrapper, "__call__") and deepcopies to the copy's wrapper. torch 2.4 compiles each module instance
    # apart anyway, and breaks the graph at a forward bound to another object than its module: the object there
    module.forward = wrapper.__call__ if _BOUND_FORWARD else wrapper

    def remove() -> None:
        if _checkpointed(module) is wrapper:
            if inner is None:
                del module.forward
            else:
                module.forward = inner

    return Handle(remove)


# ---------------------------------------------------------------------- a ReLU shared with fused call sites
class PassThroughReLU(nn.ReLU):
    """``nn.ReLU`` that returns an input produced by a fused BatchNormReLU unchanged (it is relu'd already).

    torchvision's BasicBlock/Bottleneck call one ``relu`` module after ``bn1`` (fused: the BatchNormReLU does the
    ReLU) and after ``out += identity`` (not fused). Another ``relu_`` on the fused output would bump its version,
    so its consumers would keep it instead of its recipe; this module returns such an input itself (an identity
    check on the registry) and relus anything else exactly as ``nn.ReLU``. A fused output changed in place since (on
    a path the traced forward did not take) raises ``ConvertError``: relu'd again it would not be the unconverted
    model's value. Under torch.compile/torch.func and with grad off it always relus (relu is idempotent). Swap in
    with ``module.__class__ = PassThroughReLU``.
    """


    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``input`` itself if a fused BatchNormReLU made it (relu'd already), else ``nn.ReLU``'s forward."""
        refuse_later_hooks(self, "where its input is a fused BatchNorm's output, relu'd already",
                           INPUT_HOOKS if self.inplace else INPUT_AND_FORWARD_HOOKS)
        if _active():
            if is_recomputable(input, tag="relu"):
                return input
            if activated(input, RELU) is False:  # relu(relu(bn) + b) would be wrong
                raise ConvertError(
                    f"memtrim.convert: {_name(self, None)} got the output of the BatchNorm fused with one of its call "
                    "sites (relu'd already by that BatchNorm since convert), changed in place since, on a path the "
                    "traced forward did not take: relu'd again it would be relu(relu(bn) + change) where the "
                    "unconverted model computes relu(bn + change). Convert with example inputs that take this path, "
                    "or leave the BatchNorm out (module_filter)."
                )
        return super().forward(input)


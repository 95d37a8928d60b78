"""The seam between measurement and techniques: what techniques tell the trackers, and what a tracker is told.

Techniques keep tensors for backward where autograd's saved-tensor hooks do not see them, or consume gradients
inside backward; they report it here, and every tracker watching the calling thread accounts it. This module is
the whole surface a technique uses (nothing else under ``memtrim.measure`` is for them):

* :func:`hold_for_backward`: a tensor kept for backward outside autograd (a reversible stack's last output, a
  recompute recipe's source) counts as an activation until its owner dies.
* :func:`note_gradients`: gradients consumed inside backward (``OptimizerInBackward``) are labelled as such.
* :func:`check_saved_version`: autograd's in-place check, which autograd skips for hooked saved tensors.
* :func:`active` / :func:`current`: the trackers running anywhere / watching the calling thread.
* :func:`tensors_in`: the tensors in nested arguments, as the trackers see them.
* :class:`Category`: what a storage holds; :class:`TrackerListener`: what a tracker is told (``memtrim.Tracker``
  implements it; the hooks below call nothing else on it).

Each call costs nothing when no tracker is active. Example::

    from memtrim.measure import hooks

    hooks.hold_for_backward(kept, owner=ctx_or_frame)   # counted as activations until owner is collected
    hooks.note_gradients([p.grad for p in params])       # before an optimizer consumes them in backward

NOTE [ how the tracker sees what autograd keeps ]
A ``TorchDispatchMode`` sees every op's inputs and outputs, so it knows when a storage is born and (through a
weak reference to the storage) when it dies. It does not know *why* a storage is alive. Three hooks tell it:

* saved-tensor hooks (``torch.autograd.graph`` default hooks): every tensor autograd saves for backward passes
  through ``_pack``. We keep a detached alias of it (the same storage autograd would keep) in a small holder
  whose destruction tells us autograd let go. Autograd skips its own in-place check when hooks are in use, so
  ``_unpack`` repeats it: modifying a saved tensor in place still raises, as without memtrim. A detached
  alias (rather than the tensor itself) avoids the reference cycle output -> grad_fn -> holder -> output that
  would otherwise keep saved outputs alive until the garbage collector runs.
* ``FunctionCtx.__setattr__``/``__delattr__``: custom ``autograd.Function`` s that store tensors as ctx
  attributes (memcnn, revlib...) bypass saved-tensor hooks; the patched setters report those tensors, and a
  finaliser on the ctx reports their release when the graph dies.
* ``UntypedStorage.resize_``: resizing a storage from Python does not go through the dispatcher.

Threads. Dispatch modes and saved-tensor hooks are thread-local (autograd carries both into the threads that
run a backward), while module, optimizer and ``FunctionCtx`` hooks are process-wide. So the saved-tensor hooks
are pushed once per thread, by that thread's first tracker, and popped by its last; the process-wide hooks are
installed once while any tracker is active and forward each event only to :func:`current` — the trackers
whose dispatch mode is on the calling thread's mode stack. A tracker therefore sees its own thread's work
(and its backward, wherever autograd runs it) and nothing of another thread's. Storage frees and resizes are
keyed by storage identity, so they reach whichever tracker accounts that storage.

Within a thread, one set of saved-tensor hooks serves every active tracker and each event goes to all of
them. Hooks a user pushes *inside* a tracker (checkpointing, offloading) take precedence, which is right: what
they keep is not kept by autograd. Hooks pushed *outside* a tracker are composed with ours, so they keep
working.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.autograd.function as _autograd_function
import torch.nn.modules.module as _module_mod
import torch.optim.optimizer as _optim_mod

from .report import Category

if TYPE_CHECKING:  # pragma: no cover
    from .tracker import Tracker

__all__ = [
    "Category",
    "TrackerListener",
    "active",
    "check_saved_version",
    "compiled_autograd_running",
    "compiled_module",
    "current",
    "hold_for_backward",
    "note_gradients",
    "tensors_in",
    "top_saved_tensors_hooks",
]


class TrackerListener(Protocol):
    """What a tracker is told, and by whom: the hooks in this module call these methods and nothing else.

    :class:`memtrim.Tracker` implements it. The ``on_*`` methods are callbacks (called inside ops, module calls and
    garbage collection: they must not raise); :meth:`label` is also public API for code that knows what a tensor
    is (a batch, a gradient).
    """

    def on_hold(self, tensor: Any) -> Any:
        """``tensor`` (or the tensors inside it) is kept for backward from now; returns a token for
        :meth:`on_release`."""

    def on_release(self, held: Any) -> None:
        """What :meth:`on_hold` returned ``held`` for is no longer kept for backward."""

    def on_ctx_attribute(self, ctx: Any, name: str, old: Any, new: Any) -> None:
        """A custom ``autograd.Function`` set (``new``) or deleted (``new`` None) the attribute ``name`` of its
        ``ctx``: tensors stored there are kept for backward until the ctx dies."""

    def on_storage_resized(self, storage: torch.UntypedStorage) -> None:
        """``storage.resize_`` was called from Python (it does not go through the dispatcher)."""

    def on_module_enter(self, module: torch.nn.Module) -> None:
        """A module's forward starts (a global forward pre-hook)."""

    def on_module_exit(self, module: torch.nn.Module) -> None:
        """A module's forward ended, normally or not."""

    def on_optimizer_enter(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` starts."""

    def on_optimizer_exit(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` ended."""

    def label(self, tensor: Any, category: Category | str) -> None:
        """Account the storages of ``tensor`` under ``category`` from their birth."""


_lock = threading.RLock()
_active: list[Tracker] = []  # every active tracker, in every thread
_undo: list[Callable[[], None]] = []
_local = threading.local()  # .trackers: this thread's active trackers, in the order they started

_PLAIN = (torch.Tensor, torch.nn.Parameter)

# the attribute by which current() recognises a tracker's dispatch mode
MODE_ATTRIBUTE = "_memtrim_tracker"


def active() -> tuple[Tracker, ...]:
    """Every active tracker, in every thread (empty when nothing is measured).

    Example: ``max(t.live_bytes("cpu") for t in hooks.active())`` reads live memory where no allocator counts it.
    """
    return tuple(_active)


def current() -> tuple[Tracker, ...]:
    """The active trackers that watch the calling thread: those whose dispatch mode is on its mode stack (which
    autograd carries into the threads that run a backward), outermost first."""
    if not _active:
        return ()
    depth = _stack_depth()
    if depth == 1:  # the usual case, on every module call: one mode, a tracker's or not
        tracker = getattr(_stack_at(0), MODE_ATTRIBUTE, None)
        return (tracker,) if tracker is not None else ()
    found = []
    for i in range(depth):
        tracker = getattr(_stack_at(i), MODE_ATTRIBUTE, None)
        if tracker is not None:
            found.append(tracker)
    return tuple(found)


_stack_depth = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in (nested lists, tuples and dicts of) ``obj``, as the trackers count them: a wrapper
    subclass (``__tensor_flatten__``) stands for its inner tensors.

    Hand-written rather than ``torch.utils._pytree``: the tracker runs it on every op, and pytree makes about
    twenty Python calls for two tensors where this makes two.
    """
    found: list[torch.Tensor] = []
    _collect(obj, found)
    return found


def _collect(obj: Any, found: list[torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor or not hasattr(obj, "__tensor_flatten__"):
            found.append(obj)
        else:
            for name in obj.__tensor_flatten__()[0]:
                _collect(getattr(obj, name), found)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if type(item) is torch.Tensor:
                found.append(item)
            elif isinstance(item, (torch.Tensor, list, tuple, dict)):
                _collect(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect(item, found)


def compiled_autograd_running() -> bool:
    """Whether torch's compiled autograd is on (``torch._dynamo.compiled_autograd._enable``, or its compiled graph
    running a backward now). It runs saved-tensor unpack hooks inside its own graph, after it has released what the
    eager nodes saved, so a rebuild from a node's saved tensors finds them freed. Read without importing dynamo."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return ca is not None and bool(getattr(ca, "in_compiled_autograd_region", False)
                                   or getattr(ca, "compiled_autograd_enabled", False))


def check_saved_version(tensor: torch.Tensor, version: int, who: str | Callable[[], str], *,
                        source: bool = False) -> None:
    """Autograd's in-place check, which autograd skips for tensors that go through saved-tensor hooks.

    Args:
        tensor: the tensor kept for backward.
        version: ``tensor._version`` when it was kept.
        who: the API that kept it, named in the message (or a function giving the whole reason, called only then).
        source: ``tensor`` is kept to rebuild another tensor from (a recipe's source), not because torch keeps it.

    Raises:
        RuntimeError: ``tensor`` was modified in place since; the message is autograd's own.
    """
    if tensor._version != version:
        why = who() if callable(who) else (
            f"{who} rebuilds in backward a tensor torch keeps, from this one; torch itself may not need it, so "
            "change it after backward or leave the module out of memtrim" if source else
            f"{who} repeats autograd's own check under its saved-tensor hooks, here inside torch's compiled "
            "autograd, whose graph runs these hooks; the plain model may not fail there: run this backward "
            "without compiled autograd, or leave the module out of memtrim" if compiled_autograd_running() else
            f"{who} repeats autograd's own check under its saved-tensor hooks; the same code fails without memtrim")
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version {version} "
            f"instead. ({why}.)"
        )


def note_gradients(tensors: Iterable[Any]) -> None:
    """Label ``tensors`` as gradients in every tracker watching this thread.

    Techniques that consume gradients inside backward (and free them before the tracker's own gradient hook could
    see them land) call this first.
    """
    trackers = current()
    if not trackers:
        return
    for tracker in trackers:
        for tensor in tensors:
            tracker.label(tensor, Category.GRADIENTS)


def hold_for_backward(tensor: Any, owner: Any) -> None:
    """Tell the trackers watching this thread that ``tensor`` is kept for backward by ``owner`` (not through
    autograd's saved tensors) until ``owner`` is garbage collected: they count it as an activation meanwhile.

    Args:
        tensor: a tensor, or nested lists, tuples or dicts of them.
        owner: any weak-referenceable object whose life is the hold's (a ctx, a frame, a recipe).
    """
    trackers = current()
    if not trackers:
        return  # nobody to tell (a tracker started later sees the tensor as alive from its start)
    held = [(tracker, tracker.on_hold(tensor)) for tracker in trackers]

    def release() -> None:
        for tracker, token in held:
            tracker.on_release(token)

    weakref.finalize(owner, release)


# ---------------------------------------------------------------------- the hooks (called by Tracker only)
class _Saved:
    """What autograd stores instead of a saved tensor while a tracker is active."""

    __slots__ = ("tensor", "version", "outer", "packed", "held", "__weakref__")
    tensor: torch.Tensor | None  # an alias of the saved tensor, where no hooks outside keep their own
    version: int
    outer: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None
    packed: Any
    held: list[tuple[Tracker, Any]]

    def __del__(self) -> None:
        try:
            for tracker, token in self.held:
                tracker.on_release(token)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def _make_pack(
    outer: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None, trackers: list[Tracker]
) -> tuple[Callable[[torch.Tensor], _Saved], Callable[[_Saved], torch.Tensor]]:
    """The saved-tensor hooks of one thread; ``trackers`` is that thread's list of active trackers."""

    def pack(tensor: torch.Tensor) -> _Saved:
        holder = _Saved()
        holder.version = tensor._version
        holder.outer = outer
        kept: Any = tensor  # the original: a trainable leaf is a parameter
        if outer is not None:
            # the hooks outside decide what is kept (a bfloat16 copy, a host copy) and whether a change in place
            # raises (torch checks no version under hooks; allow_mutation_on_saved_tensors keeps the old values): no
            # alias of the original here, which kept it alive beside their copy (found by an adversarial pass:
            # memtrim's own offloading outside a tracked block, +264,708 B after forward)
            holder.tensor, holder.packed = None, outer[0](tensor)
            if tensors_in(holder.packed):
                kept = holder.packed
        else:
            holder.packed = None
            if type(tensor) in _PLAIN:
                with torch._C._DisableTorchDispatch():  # our own alias: no op for the trackers (or other modes) to see
                    holder.tensor = tensor.detach()
            else:  # a tensor subclass (FakeTensor, DTensor...) makes its alias through its own dispatch
                holder.tensor = tensor.detach()
        holder.held = [(tracker, tracker.on_hold(kept)) for tracker in trackers]
        return holder

    def unpack(holder: _Saved) -> torch.Tensor:
        if holder.outer is not None:
            return holder.outer[1](holder.packed)
        assert holder.tensor is not None
        check_saved_version(holder.tensor, holder.version, "memtrim.track")
        return holder.tensor

    return pack, unpack


def _ctx_setattr(self: Any, name: str, value: Any) -> None:
    old = self.__dict__.get(name) if hasattr(self, "__dict__") else None
    object.__setattr__(self, name, value)
    if not hasattr(self, "__dict__") or name not in self.__dict__:
        return  # a C-level slot (to_save, dirty_tensors, ...), handled by autograd itself
    for tracker in current():
        tracker.on_ctx_attribute(self, name, old, value)


def _ctx_delattr(self: Any, name: str) -> None:
    old = self.__dict__.get(name) if hasattr(self, "__dict__") else None
    object.__delattr__(self, name)
    for tracker in current():
        tracker.on_ctx_attribute(self, name, old, None)


def _install() -> None:
    """The process-wide hooks (the saved-tensor hooks are per thread: see activate)."""
    ctx_cls: Any = _autograd_function.FunctionCtx
    ctx_cls.__setattr__ = _ctx_setattr
    ctx_cls.__delattr__ = _ctx_delattr

    def restore_ctx() -> None:
        del ctx_cls.__setattr__
        del ctx_cls.__delattr__

    _undo.append(restore_ctx)

    storage_cls: Any = torch.UntypedStorage
    original_resize = storage_cls.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        result = original_resize(self, size)
        for tracker in tuple(_active):
            tracker.on_storage_resized(self)
        return result

    storage_cls.resize_ = resize_

    def restore_resize() -> None:
        del storage_cls.resize_

    _undo.append(restore_resize)

    handles = [
        _module_mod.register_module_forward_pre_hook(_module_pre),
        _module_mod.register_module_forward_hook(_module_post, always_call=True),
        _optim_mod.register_optimizer_step_pre_hook(_optimizer_pre),
        _optim_mod.register_optimizer_step_post_hook(_optimizer_post),
    ]
    _undo.extend(handle.remove for handle in handles)


def _module_pre(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    for tracker in current():
        tracker.on_module_enter(module)


def _module_post(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
    for tracker in current():
        tracker.on_module_exit(module)


def _optimizer_pre(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for tracker in current():
        tracker.on_optimizer_enter(optimizer)


def _optimizer_post(optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for tracker in current():
        tracker.on_optimizer_exit(optimizer)


# ---------------------------------------------------------------------- the saved-tensor hooks on top
# torch 2.8 added the getter; 2.4 to 2.7 have no way to read the thread's stack of saved-tensor hooks. There, memtrim
# mirrors the stack that Python pushes and pops (``saved_tensors_hooks.__enter__``/``__exit__``, which
# ``torch.utils.checkpoint``, ``save_on_cpu`` and memtrim itself use), per thread, by wrapping torch's two private
# calls once, at import. A stack pushed in C++, or carried by autograd into a device thread running a backward, is not
# seen there: what memtrim's own hooks then chain to is nothing.
_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_mirror = threading.local()


def top_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) saved-tensor hooks active on this thread, or None.

    A private torch call, kept on purpose: torch has no public API that reads the active hooks (entering a
    ``saved_tensors_hooks`` replaces them, and ``disable_saved_tensors_hooks`` forbids them), and memtrim's own hooks
    chain to them so that what they pass through still reaches an outer checkpoint or a tracker. torch's own compiler
    reads them the same way (``torch._functorch._aot_autograd.utils.top_saved_tensors_hooks``). Before torch 2.8, the
    mirror above."""
    if _TOP_HOOKS is not None:
        return _TOP_HOOKS(False)
    stack = getattr(_mirror, "stack", None)
    return stack[-1] if stack else None


def _mirror_the_stack() -> None:
    autograd = torch._C._autograd
    push, pop = autograd._push_saved_tensors_default_hooks, autograd._pop_saved_tensors_default_hooks

    def push_mirrored(pack_hook: Callable[[torch.Tensor], Any], unpack_hook: Callable[[Any], torch.Tensor]) -> None:
        push(pack_hook, unpack_hook)  # raises where hooks are disabled: nothing mirrored then
        stack = getattr(_mirror, "stack", None)
        if stack is None:
            stack = _mirror.stack = []
        stack.append((pack_hook, unpack_hook))

    def pop_mirrored() -> None:
        pop()
        stack = getattr(_mirror, "stack", None)
        if stack:
            stack.pop()

    autograd._push_saved_tensors_default_hooks = push_mirrored
    autograd._pop_saved_tensors_default_hooks = pop_mirrored


if _TOP_HOOKS is None:
    _mirror_the_stack()


def activate(tracker: Tracker) -> None:
    """Start forwarding events to ``tracker`` (called by ``Tracker.__enter__``): the process-wide hooks if it is
    the first tracker anywhere, the saved-tensor hooks if it is the first in this thread. Call from the thread
    that will run the work, before pushing the tracker's dispatch mode."""
    with _lock:
        if not _active:
            _install()
        _active.append(tracker)
    trackers = getattr(_local, "trackers", None)
    if trackers is None:
        trackers = _local.trackers = []
    if not trackers:
        try:
            outer = top_saved_tensors_hooks()
            torch._C._autograd._push_saved_tensors_default_hooks(*_make_pack(outer, trackers))
        except BaseException:
            _remove_active(tracker)
            raise
    trackers.append(tracker)


def deactivate(tracker: Tracker) -> None:
    """Stop forwarding events to ``tracker`` (called by ``Tracker.__exit__``); the last tracker of a thread pops
    its saved-tensor hooks, the last tracker anywhere removes the process-wide hooks. Call from the thread that
    called :func:`activate`."""
    trackers = getattr(_local, "trackers", None)
    try:
        if trackers and tracker in trackers:
            trackers.remove(tracker)
            if not trackers:
                torch._C._autograd._pop_saved_tensors_default_hooks()
    finally:
        _remove_active(tracker)


def _remove_active(tracker: Tracker) -> None:
    with _lock:
        if tracker in _active:
            _active.remove(tracker)
        if not _active:
            while _undo:
                _undo.pop()()


def compiled_module(model: torch.nn.Module) -> str | None:
    """Which module of ``model`` was compiled (``Module.compile()``, or a ``torch.compile`` wrapper), named as an
    error says it ("the model", "the model's module 'h.0'"), or None."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # (not imported: nothing was compiled)
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    for name, module in model.named_modules():
        if (wrapper is not None and isinstance(module, wrapper)) or getattr(module, "_compiled_call_impl", None):
            return f"the model's module {name!r}" if name else "the model"
    return None

"""Process-wide hooks shared by every active tracker.

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

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.autograd.function as _autograd_function
import torch.nn.modules.module as _module_mod
import torch.optim.optimizer as _optim_mod

if TYPE_CHECKING:  # pragma: no cover
    from .tracker import Tracker

_lock = threading.RLock()
_active: list[Tracker] = []  # every active tracker, in every thread
_undo: list[Callable[[], None]] = []
_local = threading.local()  # .trackers: this thread's active trackers, in the order they started

_PLAIN = (torch.Tensor, torch.nn.Parameter)

# the attribute by which current() recognises a tracker's dispatch mode
MODE_ATTRIBUTE = "_memtrim_tracker"


def active_trackers() -> tuple[Tracker, ...]:
    """Every active tracker, in every thread."""
    return tuple(_active)


def current() -> tuple[Tracker, ...]:
    """The active trackers that watch the calling thread: those whose dispatch mode is on its mode stack (which
    autograd carries into the threads that run a backward), outermost first."""
    if not _active:
        return ()
    found = []
    for i in range(torch._C._len_torch_dispatch_stack()):
        tracker = getattr(torch._C._get_dispatch_stack_at(i), MODE_ATTRIBUTE, None)
        if tracker is not None:
            found.append(tracker)
    return tuple(found)


class _Saved:
    """What autograd stores instead of a saved tensor while a tracker is active."""

    __slots__ = ("tensor", "version", "outer", "packed", "trackers", "__weakref__")

    def __del__(self) -> None:
        try:
            for tracker in self.trackers:
                tracker._release_saved(self.tensor)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def check_saved_version(tensor: torch.Tensor, version: int, who: str) -> None:
    """Autograd's in-place check, which it skips for tensors that go through saved-tensor hooks."""
    if tensor._version != version:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected version {version} "
            f"instead. ({who} repeats autograd's own check under its saved-tensor hooks; the same code fails "
            "without memtrim.)"
        )


def _make_pack(
    outer: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None, trackers: list[Tracker]
) -> tuple[Callable, Callable]:
    """The saved-tensor hooks of one thread; ``trackers`` is that thread's list of active trackers."""

    def pack(tensor: torch.Tensor) -> _Saved:
        holder = _Saved()
        holder.version = tensor._version
        if type(tensor) in _PLAIN:
            with torch._C._DisableTorchDispatch():  # our own alias: no op for the trackers (or other modes) to see
                holder.tensor = tensor.detach()
        else:  # a tensor subclass (FakeTensor, DTensor...) makes its alias through its own dispatch
            holder.tensor = tensor.detach()
        holder.outer = outer
        holder.packed = outer[0](tensor) if outer is not None else None
        holder.trackers = tuple(trackers)
        for tracker in holder.trackers:
            tracker._hold_saved(tensor)  # the original: a trainable leaf is a parameter, its alias is not
        return holder

    def unpack(holder: _Saved) -> torch.Tensor:
        check_saved_version(holder.tensor, holder.version, "memtrim.track")
        if holder.outer is not None:
            return holder.outer[1](holder.packed)
        return holder.tensor

    return pack, unpack


def _ctx_setattr(self: Any, name: str, value: Any) -> None:
    old = self.__dict__.get(name) if hasattr(self, "__dict__") else None
    object.__setattr__(self, name, value)
    if not hasattr(self, "__dict__") or name not in self.__dict__:
        return  # a C-level slot (to_save, dirty_tensors, ...), handled by autograd itself
    for tracker in current():
        tracker._ctx_attribute(self, name, old, value)


def _ctx_delattr(self: Any, name: str) -> None:
    old = self.__dict__.get(name) if hasattr(self, "__dict__") else None
    object.__delattr__(self, name)
    for tracker in current():
        tracker._ctx_attribute(self, name, old, None)


def _install() -> None:
    """The process-wide hooks (the saved-tensor hooks are per thread: see activate)."""
    ctx_cls = _autograd_function.FunctionCtx
    ctx_cls.__setattr__ = _ctx_setattr  # type: ignore[method-assign,assignment]
    ctx_cls.__delattr__ = _ctx_delattr  # type: ignore[method-assign,assignment]

    def restore_ctx() -> None:
        del ctx_cls.__setattr__
        del ctx_cls.__delattr__

    _undo.append(restore_ctx)

    storage_cls = torch.UntypedStorage
    original_resize = storage_cls.resize_

    def resize_(self: torch.UntypedStorage, size: int) -> Any:
        result = original_resize(self, size)
        for tracker in tuple(_active):
            tracker._storage_resized(self)
        return result

    storage_cls.resize_ = resize_  # type: ignore[method-assign]

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


def _module_pre(module: torch.nn.Module, args: tuple) -> None:
    for tracker in current():
        tracker._module_enter(module, args)


def _module_post(module: torch.nn.Module, args: tuple, output: Any) -> None:
    for tracker in current():
        tracker._module_exit(module)


def _optimizer_pre(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for tracker in current():
        tracker._optimizer_enter(optimizer)


def _optimizer_post(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for tracker in current():
        tracker._optimizer_exit(optimizer)


def activate(tracker: Tracker) -> None:
    """Start forwarding events to ``tracker``: the process-wide hooks if it is the first tracker anywhere, the
    saved-tensor hooks if it is the first in this thread. Call from the thread that will run the work, before
    pushing the tracker's dispatch mode."""
    with _lock:
        if not _active:
            _install()
        _active.append(tracker)
    trackers = getattr(_local, "trackers", None)
    if trackers is None:
        trackers = _local.trackers = []
    if not trackers:
        try:
            outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
            torch._C._autograd._push_saved_tensors_default_hooks(*_make_pack(outer, trackers))
        except BaseException:
            _remove_active(tracker)
            raise
    trackers.append(tracker)


def deactivate(tracker: Tracker) -> None:
    """Stop forwarding events to ``tracker``; the last tracker of a thread pops its saved-tensor hooks, the last
    tracker anywhere removes the process-wide hooks. Call from the thread that called :func:`activate`."""
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


def note_gradients(tensors: list[Any]) -> None:
    """Techniques that consume gradients inside backward call this first, so trackers label them."""
    for tracker in current():
        for tensor in tensors:
            tracker._include(tensor, "gradients")


def hold_for_backward(tensor: Any, owner: Any) -> None:
    """``tensor`` is kept for backward by ``owner`` (not through autograd's saved tensors) until ``owner`` dies:
    active trackers count it as an activation meanwhile."""
    trackers = current()
    if not trackers:
        return  # nobody to tell (a tracker started later sees the tensor as alive from its start)
    records = [tracker._hold(tensor, +1) for tracker in trackers]

    def release() -> None:
        for tracker, held in zip(trackers, records):
            for record in held:
                tracker._change_holds(record, -1)

    weakref.finalize(owner, release)


def ctx_finalizer(ctx: Any, callback: Callable[[], None]) -> None:
    weakref.finalize(ctx, callback)

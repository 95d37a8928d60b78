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

Only one set of saved-tensor hooks is active at a time, so the hooks are installed once for all trackers and
each event is forwarded to every active tracker. Hooks a user pushes *inside* a tracker (checkpointing,
offloading) take precedence, which is right: what they keep is not kept by autograd. Hooks pushed *outside*
a tracker are composed with ours, so they keep working.
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
_active: list[Tracker] = []
_undo: list[Callable[[], None]] = []


def active_trackers() -> tuple[Tracker, ...]:
    return tuple(_active)


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


def _make_pack(outer: tuple[Callable[[Any], Any], Callable[[Any], Any]] | None) -> tuple[Callable, Callable]:
    def pack(tensor: torch.Tensor) -> _Saved:
        holder = _Saved()
        holder.version = tensor._version
        holder.tensor = tensor.detach()
        holder.outer = outer
        holder.packed = outer[0](tensor) if outer is not None else None
        holder.trackers = tuple(_active)
        for tracker in holder.trackers:
            tracker._hold_saved(holder.tensor)
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
    for tracker in tuple(_active):
        tracker._ctx_attribute(self, name, old, value)


def _ctx_delattr(self: Any, name: str) -> None:
    old = self.__dict__.get(name) if hasattr(self, "__dict__") else None
    object.__delattr__(self, name)
    for tracker in tuple(_active):
        tracker._ctx_attribute(self, name, old, None)


def _install() -> None:
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack, unpack = _make_pack(outer)
    torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    _undo.append(torch._C._autograd._pop_saved_tensors_default_hooks)

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
    for tracker in tuple(_active):
        tracker._module_enter(module, args)


def _module_post(module: torch.nn.Module, args: tuple, output: Any) -> None:
    for tracker in tuple(_active):
        tracker._module_exit(module)


def _optimizer_pre(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for tracker in tuple(_active):
        tracker._optimizer_enter(optimizer)


def _optimizer_post(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    for tracker in tuple(_active):
        tracker._optimizer_exit(optimizer)


def activate(tracker: Tracker) -> None:
    with _lock:
        if not _active:
            _install()
        _active.append(tracker)


def deactivate(tracker: Tracker) -> None:
    with _lock:
        if tracker in _active:
            _active.remove(tracker)
        if not _active:
            while _undo:
                _undo.pop()()


def note_gradients(tensors: list[Any]) -> None:
    """Techniques that consume gradients inside backward call this first, so trackers label them."""
    for tracker in tuple(_active):
        for tensor in tensors:
            tracker._include(tensor, "gradients")


def hold_for_backward(tensor: Any, owner: Any) -> None:
    """``tensor`` is kept for backward by ``owner`` (not through autograd's saved tensors) until ``owner`` dies:
    active trackers count it as an activation meanwhile."""
    if not _active:
        return  # nobody to tell (a tracker started later sees the tensor as alive from its start)
    trackers = tuple(_active)
    records = [tracker._hold(tensor, +1) for tracker in trackers]

    def release() -> None:
        for tracker, held in zip(trackers, records):
            for record in held:
                tracker._change_holds(record, -1)

    weakref.finalize(owner, release)


def ctx_finalizer(ctx: Any, callback: Callable[[], None]) -> None:
    weakref.finalize(ctx, callback)

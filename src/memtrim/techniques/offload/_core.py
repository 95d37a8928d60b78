"""Activation offloading through saved-tensor hooks.

NOTE [ offloading saved tensors ]
Between forward and backward, autograd keeps the tensors each op saved. ``OffloadActivations`` (a
``torch.autograd.graph.saved_tensors_hooks`` subclass, as torchtune's ``OffloadActivations``) packs every saved
tensor that lives on an accelerator and is at least ``min_bytes`` into host memory, and unpacks it back onto its
device when backward needs it. The copy is exact, so training is bitwise the same. Parameters (and any leaf that
requires grad), and views of them (``nn.Linear`` saves ``weight.t()``), are never copied: they stay on the device
anyway. A tensor saved by two ops (ReLU's output, kept by the ReLU and by the next Linear) is copied once: the same
storage, view (conjugate and negative bits included) and version give the copy made already (a weak table:
autograd's saved slots own the copies). A copy keeps the tensor's strides where it is dense (channels_last, a
transpose): backward kernels choose by layout. Autograd skips its in-place check for hooked saved tensors, so
``_unpack`` repeats it (``check_saved_version``) on what stays in place, on a copy whose tensor is alive, and on a
copy whose tensor a later save of the same storage, through any view, found changed (the tensor alive then); a saved
view is checked through its base, which shares its version counter and outlives a temporary slice: what raises
without offloading raises with it. Not seen: a change in place after the tensor's last save once the tensor (and its
base) has died (nothing of it is left to read the version from: a view kept for the purpose would keep its storage on
the device); and a change through ``.data``, which moves no version counter: backward reads the copy, the values at
the save, where torch reads the changed tensor. On
CUDA the device-to-host copy runs on a side stream into pinned memory, ordered after the op that made the tensor;
``record_stream`` keeps the device block from reuse until the copy is done, and the copy back waits for that copy's
event. On a machine without an accelerator host memory is device memory: nothing is moved and
``OffloadHandle.note`` says so. ``memtrim.plan`` predicts offloading on fake tensors with ``host="meta"``: the copies
are made (on no memory) and counted, and the device's bytes are what remain.
Like torch's ``save_on_cpu``, the hooks see only what ``save_for_backward`` keeps, not attributes a custom Function
sets on ``ctx``. ``torch.func`` transforms and a compiled backward refuse saved-tensor hooks: offload outside them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import InvalidInputError, MemtrimStateError
from ...measure.hooks import check_saved_version, top_saved_tensors_hooks
from .._bound import InstanceForward
from ..guards import holds_values

_API = "memtrim.offload_module"
_MARK = "_memtrim_offloaded"


class _Offloaded:
    """A saved tensor waiting in host memory, with what autograd's in-place check needs: the version it was saved at
    and a weak reference to the tensor, or to its base where it is a view (a view shares its base's version counter,
    and the base outlives a temporary view: ``fc(a[:, :4])`` saves a slice that dies at once). ``version`` is None
    once a later save saw it changed in place."""

    __slots__ = ("host", "device", "event", "version", "tensor_ref", "view", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, event: Any, tensor: torch.Tensor,
                 view: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> None:
        self.host = host
        self.device = device
        self.event = event
        self.version: int | None = tensor._version
        self.tensor_ref = weakref.ref(_base(tensor))
        self.view = view  # (shape, strides) over ``host``'s elements: a tensor that reads its elements repeatedly

    def viewed_as(self, tensor: torch.Tensor) -> _Offloaded:
        """This copy, for ``tensor``: another view of the same storage elements (a reshape, a transpose)."""
        other = object.__new__(_Offloaded)
        other.host, other.device, other.event, other.version = self.host, self.device, self.event, self.version
        other.tensor_ref, other.view = self.tensor_ref, (tuple(tensor.shape), tuple(tensor.stride()))
        return other

    def unpacked_as(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shape and strides this copy comes back with."""
        return self.view if self.view is not None else (tuple(self.host.shape), tuple(self.host.stride()))


def _reach(tensor: torch.Tensor) -> int | None:
    """How many storage elements ``tensor`` reaches from its offset: its own count where it is dense (contiguous or
    permuted), fewer where it reads elements repeatedly (an expanded mask: stride 0), more where it has gaps (a
    slice). None where it has no elements, or reads its storage with other values (a conjugate or negative view)."""
    if tensor.numel() == 0 or tensor.is_conj() or tensor.is_neg():
        return None
    return 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))


def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` covers its elements exactly once, without gaps (torch keeps the strides of such a tensor in
    ``empty_like`` and ``to``)."""
    return torch.empty_like(tensor, device="meta").stride() == tensor.stride()


def _copied_bytes(tensor: torch.Tensor) -> int:
    """The bytes a copy of ``tensor`` takes: the storage elements it reaches (``_reach``)."""
    reach = _reach(tensor)
    return (tensor.numel() if reach is None else reach) * tensor.element_size()


class _Kept:
    """A saved tensor left where it is: a detached alias (no cycle through its grad_fn) and its version; or, where
    saved-tensor hooks were active outside the context (memtrim's tracker), what those made of it, so that they still
    see it kept for backward."""

    __slots__ = ("tensor", "version", "packed", "outer", "tensor_ref")

    def __init__(self, tensor: torch.Tensor, outer: Any) -> None:
        self.outer, self.version = outer, tensor._version
        self.tensor_ref: weakref.ref[torch.Tensor] | None
        if outer is not None:  # checked at unpack through the tensor (or its base) while it lives, as a copy is
            self.tensor, self.packed = None, outer[0](tensor)
            self.tensor_ref = weakref.ref(_base(tensor))
        else:
            self.tensor, self.packed, self.tensor_ref = tensor.detach(), None, None


_WHO = "memtrim.OffloadActivations"


def _views_a_parameter(tensor: torch.Tensor) -> bool:
    """A view of a parameter (``nn.Linear`` saves ``weight.t()``): it stays on the device with the parameter, so a host
    copy would free nothing and add a device copy in backward."""
    base = tensor._base
    return base is not None and (isinstance(base, nn.Parameter) or (base.is_leaf and base.requires_grad))


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors autograd saves inside it wait in host memory until backward.

    Args:
        min_bytes: smaller tensors stay where they are (the copy would cost more than it frees).
        pin_memory: copy into pinned host memory (faster, asynchronous copies); ignored without an accelerator.
        include_cpu: copy CPU tensors too (into new CPU tensors: no saving, the same copy-out/copy-back path; for
            checking that path on a machine without an accelerator).
        host: where saved tensors wait: ``"cpu"`` (the default), or ``"meta"`` for a prediction that allocates
            nothing (``memtrim.plan`` traces a step on fake tensors; the tensors then have no values to keep).
        keep: tensors that stay on the device anyway, left there with every view of them (``offload_module`` passes
            its model's buffers: a causal mask expanded for each layer).

    Attributes:
        offloaded_bytes: bytes moved to the host since the context was made.

    Example::

        with memtrim.OffloadActivations(min_bytes=1 << 20):
            loss = model(x).sum()
        loss.backward()   # outside the context is fine: unpacking needs no hooks
    """

    def __init__(self, *, min_bytes: int = 1 << 20, pin_memory: bool = True, include_cpu: bool = False,
                 host: str | torch.device = "cpu", keep: Iterable[torch.Tensor] = ()) -> None:
        if not isinstance(min_bytes, int) or isinstance(min_bytes, bool) or min_bytes < 0:
            raise InvalidInputError(f"memtrim.OffloadActivations: min_bytes must be an int >= 0, got {min_bytes!r}.")
        try:
            self.host = torch.device(host)
        except (RuntimeError, TypeError, ValueError) as e:
            raise InvalidInputError(f"memtrim.OffloadActivations: cannot read the host device {host!r} ({e}).") from e
        if self.host.type not in ("cpu", "meta"):
            raise InvalidInputError(
                f"memtrim.OffloadActivations: host must be 'cpu' (or 'meta' for a prediction), got {host!r}."
            )
        self.min_bytes = min_bytes
        self.pin_memory = pin_memory
        self.include_cpu = include_cpu
        self.offloaded_bytes = 0
        self._streams: dict[torch.device, Any] = {}
        # a tensor saved by two ops (ReLU's output, by the ReLU and the next Linear) is copied once: its view and
        # version -> (a weak reference to its storage, the version, the copy, held weakly: autograd holds it)
        self._copies: dict[tuple[Any, ...], tuple[weakref.ref, int, weakref.ref]] = {}
        # every copy of a storage, through any view: id(storage) -> (a weak reference to it, weak references to the
        # copies), for the in-place check of a later save of the same storage
        self._by_storage: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}
        self._outers: list[Any] = []  # the saved-tensor hooks active when it was entered, per entry still open
        storages = (t.untyped_storage() for t in keep if isinstance(t, torch.Tensor) and t.device.type != "meta")
        self._kept = {id(st): weakref.ref(st) for st in storages}
        super().__init__(self._pack, self._unpack)

    def __enter__(self) -> OffloadActivations:  # type: ignore[override]  # torch's returns None
        # what it leaves in place goes to the hooks active outside it (a tracker's: they count it as kept for
        # backward, and repeat autograd's in-place check), as a recompute scope passes its tensors on
        outer = top_saved_tensors_hooks()
        if outer is not None and outer[0] == self._pack:  # entered again inside itself (one context shared by
            outer = self._outers[-1] if self._outers else None  # nested blocks): passing its tensors to itself
            # recursed without end (an adversarial pass on 2026-12-03)
        self._outers.append(outer)
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._outers.pop()
        if not self._outers:
            self._copies.clear()  # what one block saved; a context entered again starts a new table
            self._by_storage.clear()

    @property
    def _outer(self) -> Any:
        return self._outers[-1] if self._outers else None

    # the hooks run as Python under torch.compile (a compiled forward's saves pass through them): traced, dynamo
    # compiled their bookkeeping frame by frame at every call, past its recompile limit
    @torch.compiler.disable
    def _pack(self, tensor: torch.Tensor) -> Any:
        device = tensor.device
        if (
            device.type == "meta"
            or (device.type == "cpu" and not self.include_cpu)
            or tensor.layout is not torch.strided
            or (tensor.is_leaf and tensor.requires_grad)
            or isinstance(tensor, nn.Parameter)
            or _views_a_parameter(tensor)
            or self._keeps(tensor)
            or _copied_bytes(tensor) < self.min_bytes
        ):
            return _Kept(tensor, self._outer)  # autograd skips its in-place check under hooks: _unpack (or the
                                               # hooks outside) repeats it
        storage = tensor.untyped_storage()
        version = tensor._version
        earlier = self._by_storage.get(id(storage))
        if earlier is not None and earlier[0]() is storage:
            # a copy of this storage, through any view, whose tensor is alive and shares this one's version counter
            # but was saved at another version: changed in place since, so backward through it must raise
            for ref in earlier[1]:
                copy = ref()
                if (copy is not None and copy.version is not None and copy.version != version
                        and _same_tensor(copy.tensor_ref(), tensor)):
                    copy.version = None
        else:
            earlier = self._by_storage[id(storage)] = (weakref.ref(storage), [])
        # keyed by the storage elements it reaches, not its view: a GELU's (batch, seq, features) output and the
        # (batch * seq, features) view the next Linear saves of it (copied twice until 2026-12-02), a tensor and its
        # transpose, are one copy, each viewed back as it was
        reach = _reach(tensor)
        layout = ("reach", reach) if reach is not None else (tuple(tensor.shape), tuple(tensor.stride()))
        key = (id(storage), tensor.storage_offset(), layout, tensor.dtype, tensor.is_conj(),
               tensor.is_neg())  # x.conj() is x's storage and view, with other values
        known = self._copies.get(key)
        if known is not None and known[0]() is storage:
            copy = known[2]()
            if copy is not None and known[1] == version:  # the same values, copied already
                if copy.unpacked_as() == (tuple(tensor.shape), tuple(tensor.stride())):
                    return copy
                again = copy.viewed_as(tensor)
                earlier[1].append(weakref.ref(again))
                return again
        packed = self._copy_out(tensor, device, reach)
        self._copies[key] = (weakref.ref(storage), version, weakref.ref(packed))
        earlier[1].append(weakref.ref(packed))
        return packed

    def _keeps(self, tensor: torch.Tensor) -> bool:
        if not self._kept:
            return False
        storage = tensor.untyped_storage()
        ref = self._kept.get(id(storage))
        return ref is not None and ref() is storage

    def _copy_out(self, tensor: torch.Tensor, device: torch.device, reach: int | None) -> _Offloaded:
        view = None
        if reach is not None and not _dense(tensor):
            # the storage elements it reaches, viewed as it was when it comes back: a dense copy of an expanded
            # (batch, heads, T, T) mask was 32x its storage (and came back so to the device), and a dense copy of a
            # slice with gaps (Wav2Vec2's conv output trimmed by [..., :-1]) came back with other strides, which sent
            # GELU's backward down another kernel: other bits (found by adversarial passes)
            view = (tuple(tensor.shape), tuple(tensor.stride()))
            tensor_or_span = tensor.as_strided((reach,), (1,), tensor.storage_offset())
        else:
            tensor_or_span = tensor
        if self.host.type == "meta":  # a prediction: the copy out (and back, in _unpack) is what it counts
            if holds_values(tensor):
                raise _META_HOST_ERROR
            self.offloaded_bytes += tensor_or_span.numel() * tensor.element_size()
            return _Offloaded(tensor_or_span.to("meta"), device, None, tensor, view)
        # the tensor's strides where it is dense (channels_last, a transpose): backward kernels pick their algorithm
        # by layout, so a contiguous copy could change the gradients' bits
        strides = torch.empty_like(tensor_or_span, device="meta").stride()
        host = torch.empty_strided(tensor_or_span.shape, strides, dtype=tensor.dtype,
                                   pin_memory=self.pin_memory and device.type == "cuda")
        event = None
        if device.type == "cuda":
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                host.copy_(tensor_or_span, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            tensor.record_stream(stream)
        else:
            host.copy_(tensor_or_span)
        self.offloaded_bytes += host.numel() * host.element_size()
        return _Offloaded(host, device, event, tensor, view)

    @staticmethod
    @torch.compiler.disable
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, _Kept):
            if packed.outer is not None:
                alive = packed.tensor_ref() if packed.tensor_ref is not None else None
                if alive is not None:
                    check_saved_version(alive, packed.version, _WHO)
                return packed.outer[1](packed.packed)
            assert packed.tensor is not None
            check_saved_version(packed.tensor, packed.version, _WHO)
            return packed.tensor
        tensor = packed.tensor_ref()
        if packed.version is None:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation "
                f"after {_WHO} copied it for backward. ({_WHO} repeats autograd's own check under its saved-tensor "
                "hooks; the same code fails without memtrim.)"
            )
        if tensor is not None:
            check_saved_version(tensor, packed.version, _WHO)
        if packed.event is not None:
            torch.cuda.current_stream(packed.device).wait_event(packed.event)
        # only a copy made on a side stream can be pinned (torch 2.4's fake tensors cannot answer is_pinned)
        back = packed.host.to(packed.device, non_blocking=packed.event is not None and packed.host.is_pinned())
        return back if packed.view is None else back.as_strided(*packed.view)


def _base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor ``tensor`` views, or itself: it shares ``tensor``'s version counter and lives at least as long."""
    return tensor if tensor._base is None else tensor._base


def _same_tensor(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share a version counter: the same tensor, or views of the same base."""
    if a is None:
        return False
    return a is b or _base(a) is _base(b)


@dataclass
class OffloadHandle:
    """What :func:`offload_module` did; ``remove()`` restores the model's own forward."""

    min_bytes: int
    note: str
    _model: nn.Module | None = field(default=None, repr=False)
    _options: dict[str, Any] = field(default_factory=dict, repr=False)  # OffloadActivations' other options

    def remove(self) -> None:
        """Undo: the model's forward no longer offloads (a second call does nothing)."""
        model = self._model
        if model is not None and model.__dict__.get(_MARK) is self:
            del model.forward
            delattr(model, _MARK)
        self._model = None


def _offloaded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    handle: OffloadHandle = self.__dict__[_MARK]
    # the model's buffers stay on the device anyway: a saved view of one (an expanded causal mask) stays with them
    with OffloadActivations(min_bytes=handle.min_bytes, keep=self.buffers(), **handle._options):
        return type(self).forward(self, *args, **kwargs)


_META_HOST_ERROR = InvalidInputError(
    "memtrim.OffloadActivations: host='meta' is how memtrim.plan predicts offloading on fake tensors; a real "
    "tensor's copy on meta holds no values, and backward failed with torch's 'Cannot copy out of meta tensor' (found "
    "by an adversarial pass). Expected host='cpu' (the default) for a model with real parameters."
)


def offload_module(model: nn.Module, *, min_bytes: int = 1 << 20, include_cpu: bool = False,
                   host: str | torch.device = "cpu") -> OffloadHandle:
    """Offload what ``model``'s forward saves for backward to host memory (NOTE [ offloading saved tensors ]), in
    place; bitwise the same training.

    Args:
        model: the module whose forward is wrapped (its parameters are never copied).
        min_bytes: saved tensors smaller than this stay on the device.
        include_cpu, host: as :class:`OffloadActivations`' (a model on the CPU standing in for an accelerator's,
            tensors waiting on ``"meta"``: how ``memtrim.plan`` predicts offloading on fake tensors).

    Returns:
        An :class:`OffloadHandle`; ``note`` says what will happen on this model's device (nothing on a CPU model).

    Raises:
        InvalidInputError: ``model`` is not a module, or ``min_bytes`` is not an int >= 0.
        MemtrimStateError: the model is offloaded already, or has a forward set on the instance.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"{_API}: model must be a torch.nn.Module, got {type(model).__name__}.")
    if OffloadActivations(min_bytes=min_bytes, include_cpu=include_cpu, host=host).host.type == "meta" and any(
            holds_values(t) for t in model.parameters()):  # (validates the options too)
        raise _META_HOST_ERROR
    if _MARK in model.__dict__ or "forward" in model.__dict__:
        raise MemtrimStateError(
            f"{_API}: the model already has a forward set on the instance (offloaded or checkpointed already). "
            "Call remove() on the earlier handle first, or offload a submodule."
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    note = (
        f"saved tensors of at least {min_bytes} B go to pinned host memory"
        if device.type not in ("cpu", "meta")
        else f"saved tensors of at least {min_bytes} B are copied to host memory (include_cpu: a model on the host "
        "saves nothing so; nothing is pinned without an accelerator)"
        if include_cpu
        else "the model is on the host already (no accelerator): nothing is moved and nothing is saved"
    )
    handle = OffloadHandle(min_bytes=min_bytes, note=note, _model=model,
                           _options={"include_cpu": include_cpu, "host": host})
    model.forward = InstanceForward(_offloaded_forward, model)
    model.__dict__[_MARK] = handle
    return handle

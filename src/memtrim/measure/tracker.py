"""The exact memory tracker: every tensor storage, by category, phase, module and op, on any device.

NOTE [ memtrim's accounting ]
* Unit: a storage (``Tensor.untyped_storage()``), counted once however many views share it, at its
  ``nbytes()``. Resizes are events of their own. This is the memory tensors occupy; allocator rounding,
  caching and kernel-internal workspaces are not storages (on CUDA the report adds the allocator's own peaks).
* Time: an event list. A storage is born when it first appears as an op's output, dies when its last
  reference goes (a weak reference tells us), and storages that existed before the tracker started are
  counted from event 0 (found at entry for the model, its gradients and the optimizer state, or when an op
  first reads them).
* Categories: ``parameters``, ``buffers``, ``gradients``, ``optimizer_state`` and ``inputs`` are what a
  storage *is*; they are assigned from birth (a gradient is born in backward as an op output and becomes
  ``.grad`` moments later; Adam's ``exp_avg`` is born inside ``step``). Any other storage is ``activations``
  while autograd keeps it for backward (see NOTE [ how the tracker sees what autograd keeps ] in hooks.py),
  else ``temporaries`` if it was born inside the tracker and ``other`` if it existed before.
* Phases: ``backward`` while the autograd engine runs, ``optimizer`` inside ``Optimizer.step``, ``forward``
  inside a module's forward or while an op records a graph, ``other`` otherwise.
* Modules: the innermost module whose forward is running; in backward, the module whose forward created the
  autograd node that is running (nodes are matched to modules by their sequence numbers).

The tracker holds weak references to tensors and storages only. Totals by category are computed when a
report is asked for, by replaying the event list, so a storage's category can be settled after its birth.
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import InvalidInputError, MemtrimStateError
from . import hooks
from .hooks import _collect, tensors_in
from .report import CATEGORIES, Category, MemoryReport, TimelineEvent

__all__ = ["Tracker", "track"]

# the categories that say what a storage is (Tracker.label gives them); the others follow from what keeps it
_IDENTITY = frozenset(c.value for c in (Category.PARAMETERS, Category.BUFFERS, Category.GRADIENTS,
                                        Category.OPTIMIZER_STATE, Category.INPUTS))
_CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}

# torch.tensor(...) builds its tensor below the dispatcher and then passes it through one of these
_FRESH_OPS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
# ops that read metadata and make no storage: under FakeTensorMode ``tensor.device`` dispatches prim.device, also from
# inside the tracker's own bookkeeping (a record's device name), where accounting it would count a storage twice
_METADATA_OPS = frozenset({torch.ops.prim.device.default, torch.ops.prim.layout.default})

# event kinds
_START, _ALLOC, _FREE, _RESIZE, _HOLD = "start", "alloc", "free", "resize", "hold"


class _Record(weakref.ref):
    """One storage's life: a weak reference to the storage, whose callback tells the tracker that owns the record
    (held weakly too, so a finished tracker is freed as soon as its user drops it) that the storage died.

    Made by :meth:`Tracker._new_record`, which sets the fields: one object per storage, and no Python ``__init__``,
    because a record is made for nearly every op's output.
    """

    __slots__ = ("device", "nbytes", "start_nbytes", "birth_category", "category", "holds", "alive", "key", "owner")
    device: str
    nbytes: int
    start_nbytes: int  # a storage counted from the start (one of ``_start_records``): its size then
    birth_category: str
    category: str
    holds: int
    alive: bool
    key: int  # id() of the storage while it lives
    owner: weakref.ref[Tracker]

    def effective(self, category: str, holds: int) -> str:
        if category in _IDENTITY:
            return category
        return "activations" if holds > 0 else category


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: Tracker) -> None:
        super().__init__()
        self.tracker = tracker
        setattr(self, hooks.MODE_ATTRIBUTE, tracker)  # how hooks.current() finds the trackers of a thread

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        # runs for every op: tensors_in inlined for the usual flat argument tuple
        info = _OPS.get(id(func)) or _op_info(func)
        if info[2] is _METADATA:
            return func(*args, **(kwargs or {}))
        tracker = self.tracker
        inputs: list[torch.Tensor] = []
        for arg in args:
            if type(arg) in _PLAIN_TENSORS:
                inputs.append(arg)
            elif isinstance(arg, _CONTAINERS):
                _collect(arg, inputs)
        if kwargs:
            _collect(kwargs, inputs)
        else:
            kwargs = {}
        name = info[1]
        seen = tracker._op_start(info[2], name, inputs)
        try:
            out = func(*args, **kwargs)
        finally:
            tracker._op = None
        tracker._op_end(name, seen, out)
        return out


class Tracker:
    """Accounts the live bytes of every tensor storage touched while it is active. Use :func:`track`.

    Besides the queries (:meth:`report`, :meth:`live_by_category`...) and :meth:`label`, a tracker implements
    :class:`~memtrim.measure.hooks.TrackerListener`: its ``on_*`` methods are what the process-wide hooks in
    :mod:`memtrim.measure.hooks` tell it, and are not meant to be called otherwise.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        if model is not None and not isinstance(model, torch.nn.Module):
            raise InvalidInputError(
                f"memtrim.track: model must be a torch.nn.Module or None, got {type(model).__name__}. "
                "Pass the module you train (or nothing)."
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInputError(
                f"memtrim.track: optimizer must be a torch.optim.Optimizer or None, got "
                f"{type(optimizer).__name__}. Pass the optimizer itself (not a function that builds one)."
            )
        compiled = hooks.compiled_module(model) if model is not None else None
        if compiled is not None:
            # (found by an adversarial pass on 2026-12-03: the report was of the eager step, not the compiled one's
            # peak, and the model ran eagerly ever after)
            raise InvalidInputError(
                f"memtrim.track: {compiled} was compiled (torch.compile or Module.compile()). Under the tracker "
                "(a Python dispatch mode) torch.compile skips every compiled frame and caches that skip: the step "
                "would run eagerly, a different program than the compiled one, and the model would stay eager "
                "afterwards. Expected an uncompiled model; to fix: track the model before compiling it (for "
                "torch.compile(model), its _orig_mod), or measure the compiled step with torch.cuda's allocator "
                "statistics (torch.cuda.max_memory_allocated).")
        self._model_ref = weakref.ref(model) if model is not None else None
        self._optimizer_refs: list[weakref.ref] = [weakref.ref(optimizer)] if optimizer is not None else []
        self._owner = weakref.ref(self)  # what each record holds, rather than the tracker itself
        self._records: dict[int, _Record] = {}  # id(live storage) -> record
        self._events: list[tuple] = []  # (kind, record, value, op, phase, module)
        self._start_records: list[_Record] = []
        # every parameter seen: id -> weak reference. An entry whose parameter died is stale (its id may be reused),
        # so a lookup checks ``ref() is param``; a WeakIdKeyDictionary costs about ten Python calls per insertion.
        self._params: dict[int, weakref.ref[torch.Tensor]] = {}
        self._unhooked: list[int] = []  # ids (keys of _params) of parameters whose gradient hook waits for backward
        # Looked up on every module call / every gradient accumulation, so keyed by id() (a WeakIdKeyDictionary
        # lookup costs eight Python calls); they name the model's own modules and parameters, alive with it.
        self._names: dict[int, str] = {}  # id(module) -> qualified name
        self._param_module: dict[int, str] = {}  # id(parameter) -> qualified name of its module
        self._hook_handles: list[Any] = []
        self._ctx: dict[int, dict[str, list[_Record]]] = {}  # id(ctx) -> its attributes' holds, until it dies
        self._module_stack: list[str] = []
        self._module_tasks: list[int] = []  # the autograd graph task each module on the stack started in (-1: none)
        # NOTE [ nodes to modules ]: sorted, disjoint ranges [first, end) of autograd sequence numbers, each
        # with the innermost module whose forward created those nodes; built at module exit (see on_module_exit)
        self._segments: list[tuple[int, int, str]] = []
        self._segment_starts: list[int] = []
        self._open_modules: list[tuple[int, int, str]] = []  # (first seq nr, len(_segments) at entry, name)
        self._optimizer_depth = 0
        self._op: str | None = None
        self._phase = "other"
        self._module: str | None = None
        self._active = False
        self._finished = False
        self._mode: _Mode | None = None
        self._thread: int | None = None
        self._allocator_device: torch.device | None = None  # an accelerator whose allocator's peaks are read
        self._allocator_peaks: tuple[int, int] | None = None
        self._allocator_start: int | None = None
        self._cuda_snapshot: Any = None  # memory_viz's history: CUDA only

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> Tracker:
        if self._active or self._finished:
            raise MemtrimStateError(
                "memtrim.track: this tracker was already used; create a new one with memtrim.track(...)."
            )
        self._thread = threading.get_ident()
        self._events.append((_START, None, 0, None, "other", None))
        self._scan_model_and_optimizers(initial=True)
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            self._hook_handles.append(
                model.register_forward_pre_hook(_InputsHook(self), with_kwargs=True, prepend=True)
            )
        self._start_allocator()
        self._active = True
        hooks.activate(self)
        self._mode = _Mode(self)
        try:
            self._mode.__enter__()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        if threading.get_ident() != self._thread:
            raise MemtrimStateError(
                "memtrim.track: a tracker must stop in the thread that started it (its dispatch mode and "
                "saved-tensor hooks belong to that thread). Use one tracker per thread, each in a `with` block."
            )
        try:
            self._mode.__exit__(*exc)
            self._reconcile(model=True)
        finally:
            self._stop()

    def _stop(self) -> None:
        hooks.deactivate(self)
        self._stop_allocator()
        self._active = False
        self._finished = True
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        # a finished tracker reads no parameter again; a weak reference would stop torch from swapping one for its
        # moved copy (``model.to()`` with swap_module_params_on_conversion, or with tensor-subclass parameters)
        self._params.clear()
        self._unhooked.clear()

    # ------------------------------------------------------------------ public queries
    def live_by_category(self, device: str | torch.device | None = None) -> dict[str, int]:
        """Bytes alive right now (or when the tracker stopped), by category."""
        self._refuse_before_start("live_by_category")
        self._reconcile()  # (not the model's walk: OptimizerInBackward's peak="never_higher" asks during backward)
        device = self._choose_device(device)
        totals = dict.fromkeys(CATEGORIES, 0)
        for record in self._records.values():
            if record.alive and record.device == device:
                totals[record.effective(record.category, record.holds)] += record.nbytes
        return totals

    def saved_for_backward_bytes(self, device: str | torch.device | None = None) -> int:
        """Bytes of live storages autograd keeps for backward right now, whatever their category (an in-place
        op's saved output may be the caller's input; a Linear keeps its weight)."""
        self._refuse_before_start("saved_for_backward_bytes")
        device = self._choose_device(device)
        return sum(r.nbytes for r in self._records.values() if r.alive and r.holds > 0 and r.device == device)

    def live_bytes(self, device: str | torch.device | None = None) -> int:
        """Total bytes alive right now (or when the tracker stopped)."""
        return sum(self.live_by_category(device).values())

    def report(self, device: str | torch.device | None = None) -> MemoryReport:
        """The :class:`MemoryReport` of everything seen so far, for one device (default: the model's)."""
        self._refuse_before_start("report")
        self._reconcile(model=True)
        if device is not None:
            self._refuse_unseen(device)
        device = self._choose_device(device)
        allocator = None
        if (self._allocator_peaks is not None and self._allocator_device is not None
                and device == str(self._allocator_device)):
            allocator = (*self._allocator_peaks, self._allocator_start)
        return _replay(self._events, self._start_records, (device,), allocator)

    def _report_across(self, devices: Sequence[str]) -> MemoryReport:
        """One report of the storages on all of ``devices`` together, as if they were one device (a model built on
        ``meta`` and planned for the CPU: its optimizer's step counters are CPU tensors, which the CPU run counts)."""
        self._refuse_before_start("report")
        self._reconcile(model=True)
        return _replay(self._events, self._start_records, tuple(self._device_key(d) for d in devices), None)

    def export_memory_snapshot(self, path: str) -> None:
        """Write the CUDA allocator's snapshot (the pickle PyTorch's memory_viz page reads) to ``path``.

        Raises:
            MemtrimStateError: no CUDA allocator history was recorded (CUDA was not initialised at the start).
        """
        import pickle

        snapshot = self._cuda_snapshot
        device = self._allocator_device
        if snapshot is None and self._active and device is not None and device.type == "cuda":
            snapshot = torch.cuda.memory._snapshot()
        if snapshot is None:
            raise MemtrimStateError(
                "Tracker.export_memory_snapshot: no CUDA allocator history was recorded; it exists only when "
                "CUDA is initialised when the tracker starts (a model or tensor already on a GPU). Use "
                "report().to_json() on other devices."
            )
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)

    # ------------------------------------------------------------------ devices and the accelerator's allocator
    def _refuse_before_start(self, query: str) -> None:
        """A query before the block: its records' deaths were not followed (the tracker was not active), so they
        stayed alive in every later report (an adversarial pass: gradients freed before the block counted in it)."""
        if not self._active and not self._finished:
            raise MemtrimStateError(
                f"Tracker.{query}: the tracker has not started; call it inside the `with memtrim.track(...)` block "
                "or after it.")

    def _seen_devices(self) -> set[str]:
        return {r.device for r in self._start_records} | {e[1].device for e in self._events if e[0] == _ALLOC}

    def _refuse_unseen(self, device: str | torch.device) -> None:
        """A report asked of a device the tracker saw nothing on: its report was all zeros, and its plot raised
        NumPy's "need at least one array" (an adversarial pass). A live count there is 0, as it should be."""
        seen = self._seen_devices()
        name = self._device_key(device)
        if seen and name not in seen:
            raise InvalidInputError(
                f"Tracker.report: the tracker saw no tensor on {str(device)!r} (it saw {', '.join(sorted(seen))}). "
                "Expected a device the tracked code used; to fix: report() (the model's device) or one of those.")

    def _device_key(self, device: str | torch.device) -> str:
        """The name records carry for ``device``: ``"cpu"`` for any CPU (``"cpu:0"``), and a device without an index
        (``"cuda"``) as the one of its type the tracker saw (the current one where it saw several or none): the
        records are named by ``str(tensor.device)``, ``"cuda:0"``, and ``report("cuda")`` once matched none of
        them and returned zeros (an adversarial pass)."""
        resolved = torch.device(device)
        if resolved.type == "cpu":
            return "cpu"
        if resolved.index is not None or resolved.type == "meta":
            return str(resolved)
        of_type = sorted(d for d in self._seen_devices() if torch.device(d).type == resolved.type)
        if len(of_type) == 1:
            return of_type[0]
        module = getattr(torch, resolved.type, None)
        current = getattr(module, "current_device", None)
        return f"{resolved.type}:{current() if callable(current) else 0}"

    def _choose_device(self, device: str | torch.device | None) -> str:
        if device is not None:
            return self._device_key(device)
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None:
            for tensor in list(model.parameters()) + list(model.buffers()):
                return _device_name(tensor)
        sizes: dict[str, int] = {}
        for record in self._start_records:
            sizes[record.device] = sizes.get(record.device, 0) + record.nbytes
        for kind, record, value, *_ in self._events:
            if kind == _ALLOC:
                sizes[record.device] = sizes.get(record.device, 0) + value
        return max(sizes, key=sizes.__getitem__) if sizes else "cpu"

    def _start_allocator(self) -> None:
        """Reset the accelerator allocator's peaks (the model's device, else the current one) and, on CUDA, record
        the allocator's history for memory_viz. Only an accelerator already initialised: never start one."""
        module, kind = _initialised_accelerator()
        if module is None:
            return
        model = self._model_ref() if self._model_ref is not None else None
        device = None
        if model is not None:
            device = next((p.device for p in model.parameters() if p.device.type == kind), None)
        self._allocator_device = device = device or torch.device(kind, module.current_device())
        _fold_allocator_peaks(device)
        module.synchronize(device)
        module.reset_peak_memory_stats(device)
        self._allocator_peaks = (0, 0)
        self._allocator_start = module.memory_allocated(device)
        if device.type == "cuda":
            try:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            except Exception:  # pragma: no cover - history is a bonus, never a failure
                pass

    def _stop_allocator(self) -> None:
        device = self._allocator_device
        if device is None:
            return
        torch.get_device_module(device).synchronize(device)
        self._fold_allocator_peak()
        if device.type != "cuda":
            return
        try:
            self._cuda_snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
        except Exception:  # pragma: no cover
            self._cuda_snapshot = None

    def _fold_allocator_peak(self) -> None:
        device = self._allocator_device
        if device is None or self._allocator_peaks is None:
            return
        module = torch.get_device_module(device)
        allocated = module.max_memory_allocated(device)
        reserved = module.max_memory_reserved(device)
        self._allocator_peaks = (max(self._allocator_peaks[0], allocated), max(self._allocator_peaks[1], reserved))

    # ------------------------------------------------------------------ discovery and labels
    def _scan_model_and_optimizers(self, initial: bool = False) -> None:
        model = self._model_ref() if self._model_ref is not None else None
        if model is not None and initial:
            self._scan_model(model)
        for ref in self._optimizer_refs:
            optimizer = ref()
            if optimizer is not None:
                self._scan_optimizer(optimizer)
        known_as = self._known_as
        for ref in list(self._params.values()):
            param = ref()
            if param is None:
                continue
            if not initial and not known_as(param, "parameters"):  # `param.data = ...`: a new storage
                self._include(param, "parameters")
            grad = param.grad
            if grad is not None and not known_as(grad, "gradients"):
                self._include(grad, "gradients")

    def _known_as(self, tensor: torch.Tensor, category: str) -> bool:
        """Whether ``tensor``'s storage has a record of ``category`` at its current size (what lets a rescan skip
        what it knows with one lookup)."""
        if type(tensor) in _PLAIN_TENSORS and tensor.layout is _STRIDED:  # _storage_of, inlined: 4,000 calls at exit
            storage: torch.UntypedStorage | None = tensor.untyped_storage()
        else:
            storage = _storage_of(tensor)
        record = self._records.get(id(storage)) if storage is not None else None
        return (storage is not None and record is not None and record.category == category
                and record.nbytes == storage.nbytes())

    def _scan_model(self, model: torch.nn.Module) -> None:
        """The model's modules' names, its parameters (each with the first module it is registered in) and its
        buffers. What ``named_modules`` and ``named_parameters(remove_duplicate=False)`` give, walked once by hand:
        their generators cost several Python calls per module, and a 1000-layer model's entry paid 17 ms for them.
        A model that overrides them (FSDP cleans its names) is asked through them."""
        root_name = type(model).__name__
        if (type(model).named_modules is not torch.nn.Module.named_modules
                or type(model).named_parameters is not torch.nn.Module.named_parameters):
            for name, module in model.named_modules():
                self._names[id(module)] = name or root_name
            for name, param in model.named_parameters(remove_duplicate=False):
                self._watch_param(param, name.rpartition(".")[0] or root_name)
            for buffer in model.buffers():
                self._include(buffer, "buffers")
            return
        names = self._names
        params: list[tuple[torch.Tensor, str]] = []
        buffers = {}
        stack: list[tuple[str, torch.nn.Module]] = [("", model)]
        while stack:  # pre-order, children in registration order: named_modules' order
            prefix, module = stack.pop()
            owner = prefix or root_name
            if id(module) not in names:
                names[id(module)] = owner
            for registered in module._parameters.values():
                if registered is not None:
                    params.append((registered, owner))
            for kept in module._buffers.values():
                if kept is not None:
                    buffers[id(kept)] = kept
            if module._modules:
                children = [(f"{prefix}.{name}" if prefix else name, child)
                            for name, child in module._modules.items() if child is not None]
                stack.extend(reversed(children))
        self._watch_model_params(params)
        for buffer in buffers.values():
            self._include(buffer, "buffers")

    def _watch_model_params(self, params: list[tuple[torch.Tensor, str]]) -> None:
        """At entry: :meth:`_watch_param` for each (parameter, its first module's name), in one loop with the usual
        case inlined (a 1000-layer model enters with 2,000 parameters; the general path costs three calls each)."""
        watched, owners, records, unhooked = self._params, self._param_module, self._records, self._unhooked
        for param, owner in params:
            key = id(param)
            known = watched.get(key)
            if known is not None and known() is param:
                continue  # registered twice (tied): its first module names it
            if known is not None or param.layout is not _STRIDED or type(param) not in _PLAIN_TENSORS:
                self._watch_param(param, owner)  # the general path for the unusual
                continue
            watched[key] = weakref.ref(param)
            owners[key] = owner
            storage = param.untyped_storage()
            if id(storage) not in records:
                self._new_record(storage, param, "parameters", True)
            else:
                self._include_one(param, "parameters")
            if param.requires_grad:
                unhooked.append(key)

    def _watch_param(self, param: torch.Tensor, module_name: str | None = None, record: bool = True) -> None:
        """Watch ``param`` (its gradient is labelled when it lands); with ``record``, give its storage a record
        counted from the start (a caller that makes the record itself passes False)."""
        key = id(param)
        known = self._params.get(key)
        if known is not None and known() is param:
            return
        self._params[key] = weakref.ref(param)
        if module_name is not None:
            self._param_module[key] = module_name
        elif known is not None:  # the id of a parameter that died: its module's name is not this one's
            self._param_module.pop(key, None)
        storage = _storage_of(param) if record else None  # at entry, once per parameter: a new record made directly
        if storage is not None and id(storage) not in self._records:
            self._new_record(storage, param, "parameters", True)
        elif storage is not None:
            self._include_one(param, "parameters")
        if param.requires_grad:
            self._unhooked.append(key)

    def _hook_gradients(self) -> None:
        """Backward has started: from now on, each gradient autograd accumulates is labelled when it lands.
        Registered once per parameter, at the first backward, so that a tracker that never sees a backward (an
        inference loop) does not pay for it."""
        for key in self._unhooked:
            ref = self._params.get(key)
            param = ref() if ref is not None else None
            if param is not None and param.requires_grad and param.grad_fn is None:
                self._hook_handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))
        self._unhooked.clear()

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._active and param.grad is not None:
            self._include(param.grad, "gradients")

    def _scan_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                self._watch_param(param)
        for state in optimizer.state.values():
            for tensor in tensors_in(state):
                self._include(tensor, "optimizer_state")

    def label(self, tensor: Any, category: Category | str) -> None:
        """Account the storages of ``tensor`` (a tensor or nested lists, tuples and dicts of them) under
        ``category`` from their birth, or from the tracker's start if they existed before.

        For code that knows what a tensor is: a batch passed to the model other than as an argument, gradients
        consumed inside backward. A stronger label wins (parameters, buffers, optimizer_state, gradients, inputs,
        in that order).

        Args:
            tensor: what to label.
            category: one of ``parameters``, ``buffers``, ``gradients``, ``optimizer_state``, ``inputs`` (a
                :class:`~memtrim.measure.hooks.Category` or its string); activations, temporaries and other are
                decided by the tracker.

        Raises:
            InvalidInputError: ``category`` is not one of those five.

        Example::

            with memtrim.track(model) as tracker:
                tracker.label(batch["labels"], "inputs")
        """
        self._refuse_before_start("label")
        name = category.value if isinstance(category, Category) else category
        if name not in _IDENTITY:
            raise InvalidInputError(
                f"Tracker.label: category must be one of {sorted(_IDENTITY)}, got {category!r}. Activations, "
                "temporaries and other follow from what keeps a storage alive; the tracker decides them."
            )
        self._include(tensor, name)

    def _include(self, tensor: torch.Tensor, category: str) -> None:
        """Account ``tensor``'s storage under ``category`` from its birth (or from the start)."""
        if type(tensor) in _PLAIN_TENSORS:
            self._include_one(tensor, category)
        else:
            for t in tensors_in(tensor):
                self._include_one(t, category)

    def _include_one(self, tensor: torch.Tensor, category: str) -> None:
        record = self._see(tensor, category, existed=True)
        if record is None:
            return
        if record.category != category and _PRIORITY[category] <= _PRIORITY[record.category]:
            record.birth_category = category
            record.category = category

    def _reconcile(self, model: bool = False) -> None:
        """Labels what changed since the last look: a parameter's new storage (``param.data = ...``), gradients,
        optimizer state; with ``model``, the model's parameters and buffers too, which may be new objects (``to_empty``
        from meta, ``to()`` across device types: a report once called them temporaries, found by an adversarial
        pass). Not per step (an optimizer's step reconciles), nor per live count: a walk of the whole model; reports
        and the exit."""
        if self._finished:
            return
        tracked = self._model_ref() if model and self._model_ref is not None else None
        if tracked is not None:
            self._scan_model(tracked)
        self._scan_model_and_optimizers()

    # ------------------------------------------------------------------ storages
    def _see(self, tensor: torch.Tensor, category: str | None, existed: bool) -> _Record | None:
        """The record of ``tensor``'s storage; a new storage gets one (``category`` None: decide from the
        tensor), born now or, if ``existed``, counted from the start."""
        storage = _storage_of(tensor)
        if storage is None:
            return None
        record = self._records.get(id(storage))
        if record is None:
            return self._new_record(storage, tensor, category or self._existing_category(tensor), existed)
        if record.nbytes != storage.nbytes():
            self.on_storage_resized(storage)
        return record

    def _new_record(self, storage: torch.UntypedStorage, tensor: torch.Tensor, category: str, existed: bool) -> _Record:
        record = _Record(storage, _storage_died)
        record.device = _device_name(tensor)
        record.nbytes = nbytes = storage.nbytes()
        record.birth_category = record.category = category
        record.holds = 0
        record.alive = True
        record.key = key = id(storage)
        record.owner = self._owner
        self._records[key] = record
        if existed:
            record.start_nbytes = nbytes
            self._start_records.append(record)
        elif self._op is not None:
            self._events.append((_ALLOC, record, nbytes, self._op, self._phase, self._module))
        else:
            self._event(_ALLOC, record, nbytes)
        return record

    def on_storage_resized(self, storage: torch.UntypedStorage) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`."""
        record = self._records.get(id(storage))
        if record is not None and record.nbytes != storage.nbytes():
            record.nbytes = storage.nbytes()
            self._event(_RESIZE, record, record.nbytes)

    def _event(self, kind: str, record: _Record, value: Any) -> None:
        phase, module = self._phase, self._module
        if self._op is None:
            phase, module = self._context()
        self._events.append((kind, record, value, self._op, phase, module))

    # ------------------------------------------------------------------ ops
    def _op_start(self, kind: str, name: str, inputs: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, _Record]]:
        """Record the op's inputs (storages that existed before are counted from the start) and its context;
        returns, for an op that writes its inputs (``kind`` from _op_info), their (storage, record) pairs for
        _op_end to check for resizes."""
        self._op = name
        seen = []
        if kind is not _FRESH:  # torch.tensor(...) hands its new tensor to lift_fresh: born now, not before
            records = self._records
            writes = kind is _WRITES
            for tensor in inputs:
                if tensor.layout is not _STRIDED:  # _storage_of, inlined (the per-op path)
                    continue
                try:
                    storage = tensor.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                record = records.get(id(storage))
                if record is None:
                    record = self._new_record(storage, tensor, self._existing_category(tensor), True)
                elif record.nbytes != storage.nbytes():
                    self.on_storage_resized(storage)
                if writes:
                    seen.append((storage, record))
        self._phase, self._module = self._context(inputs)
        if self._unhooked and self._phase == "backward":
            self._hook_gradients()
        return seen

    def _op_end(self, name: str, seen: list[tuple[torch.UntypedStorage, _Record]], out: Any) -> None:
        self._op = name
        records = self._records
        try:
            for tensor in (out,) if type(out) is torch.Tensor else tensors_in(out):
                storage = _storage_of(tensor)  # _see, inlined (the per-op path)
                if storage is None:
                    continue
                record = records.get(id(storage))
                if record is None:
                    self._new_record(storage, tensor, "temporaries", False)
                elif record.nbytes != storage.nbytes():
                    self.on_storage_resized(storage)
            for storage, record in seen:  # resize_ and friends change an input's storage
                if record.nbytes != storage.nbytes():
                    self.on_storage_resized(storage)
        finally:
            self._op = None

    def _existing_category(self, tensor: torch.Tensor) -> str:
        if self._model_ref is None and not self._optimizer_refs and tensor.is_leaf and tensor.requires_grad:
            self._watch_param(tensor, record=False)  # no model given: trainable leaves are the parameters (the
            return "parameters"                        # caller records the storage: once)
        return "other"

    def _context(self, inputs: list[torch.Tensor] | None = None) -> tuple[str, str | None]:
        task = _graph_task_id()
        if task != -1:
            if self._module_tasks and self._module_tasks[-1] == task:
                # a forward run by this backward (checkpointing's recomputation): the module running, not the node
                # that asked for it (which named the module after the region: an adversarial pass on 2026-12-02)
                return "backward", self._module_stack[-1]
            return "backward", self._backward_module()
        if self._optimizer_depth > 0:
            return "optimizer", None
        if self._module_stack:
            return "forward", self._module_stack[-1]
        if inputs and _grad_enabled():
            for tensor in inputs:
                if tensor.requires_grad:
                    return "forward", None
        return "other", None

    # ------------------------------------------------------------------ autograd holds
    def on_hold(self, tensor: Any) -> list[_Record]:
        """See :class:`~memtrim.measure.hooks.TrackerListener`: the token is the records held."""
        held = []
        for t in tensors_in(tensor):
            record = self._see(t, None, existed=True)
            if record is not None:
                self._change_holds(record, +1)
                held.append(record)
        return held

    def on_release(self, held: list[_Record]) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`."""
        for record in held:
            self._change_holds(record, -1)

    def _change_holds(self, record: _Record, delta: int) -> None:
        if not self._active or not record.alive:
            return
        record.holds += delta
        self._event(_HOLD, record, delta)

    def on_ctx_attribute(self, ctx: Any, name: str, old: Any, new: Any) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`. Keyed by id(ctx): the finaliser drops the entry
        when the ctx dies, so an id is never reused while it is in the table."""
        held = self._ctx.get(id(ctx))
        if held is None:
            if new is None or not tensors_in(new):
                return
            held = self._ctx[id(ctx)] = {}
            weakref.finalize(ctx, self._ctx_died, id(ctx))
        self.on_release(held.pop(name, []))
        if new is not None:
            held[name] = self.on_hold(new)

    def _ctx_died(self, key: int) -> None:
        for records in self._ctx.pop(key, {}).values():
            for record in records:
                self._change_holds(record, -1)

    # ------------------------------------------------------------------ modules and optimizers
    def _model_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model is called: its tensor arguments, positional and keyword, are ``inputs``."""
        for tensor in tensors_in(args):
            self._include(tensor, "inputs")
        if kwargs:
            for tensor in tensors_in(kwargs):
                self._include(tensor, "inputs")

    def on_module_enter(self, module: torch.nn.Module) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`."""
        name = self._names.get(id(module)) or type(module).__name__
        self._module_stack.append(name)
        self._module_tasks.append(_graph_task_id())
        self._open_modules.append((self._next_sequence_nr(), len(self._segments), name))

    def on_module_exit(self, module: torch.nn.Module) -> None:
        """See NOTE [ nodes to modules ]: the segments added since this module started are its submodules'
        (calls nest), sorted; the gaps between them are this module's own nodes. Each call costs the number of
        segments inside it, so the whole run costs (segments x nesting depth), and a lookup is a bisection."""
        if not self._module_stack:
            return
        name = self._module_stack.pop()
        self._module_tasks.pop()
        if not self._open_modules or self._open_modules[-1][2] != name:
            return
        first, marker, _ = self._open_modules.pop()
        end = self._next_sequence_nr()
        if end <= first:
            return  # created no autograd node (no grad, inference mode, or only non-differentiable ops)
        merged = []
        cursor = first
        for segment in self._segments[marker:]:
            if segment[0] > cursor:
                merged.append((cursor, segment[0], name))
            merged.append(segment)
            cursor = segment[1]
        if end > cursor:
            merged.append((cursor, end, name))
        self._segments[marker:] = merged
        self._segment_starts[marker:] = [segment[0] for segment in merged]

    def _next_sequence_nr(self) -> int:
        """The autograd sequence number the next node created in this thread will get."""
        return _peek_sequence_nr()

    def _backward_module(self) -> str | None:
        node: Any = torch._C._current_autograd_node()
        if node is None:
            return None
        if type(node) is _ACCUMULATE_GRAD:
            return self._param_module.get(id(node.variable))
        seq = node._sequence_nr()
        index = bisect.bisect_right(self._segment_starts, seq) - 1
        if index >= 0:
            _, end, name = self._segments[index]
            if seq < end:
                return name
        return None

    def on_optimizer_enter(self, optimizer: torch.optim.Optimizer) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`."""
        if not any(ref() is optimizer for ref in self._optimizer_refs):
            self._optimizer_refs.append(weakref.ref(optimizer))
        self._reconcile()
        self._optimizer_depth += 1

    def on_optimizer_exit(self, optimizer: torch.optim.Optimizer) -> None:
        """See :class:`~memtrim.measure.hooks.TrackerListener`."""
        self._optimizer_depth = max(0, self._optimizer_depth - 1)
        self._scan_optimizer(optimizer)


def track(model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None) -> Tracker:
    """Account every tensor storage that the code inside the ``with`` block touches, exactly, on any device.

    Why: memory tools that read allocator peaks (CUDA only, stale unless reset) or process RSS (blind to
    tensors) cannot say *where* memory goes. This tracker sees every storage, so later techniques can claim
    "this saves N bytes" and be checked.

    Args:
        model: the module being trained. Its parameters, buffers and gradients are counted from the start,
            its tensor arguments are ``inputs``, and its submodules' qualified names label the timeline.
        optimizer: the optimizer; its state is counted from the start (any optimizer that steps inside the
            block is recognised anyway).

    Returns:
        A :class:`Tracker`; call ``report()`` on it after (or inside) the block.

    Raises:
        InvalidInputError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an ``Optimizer``.
        MemtrimStateError: the tracker is entered a second time, or its block ends in another thread.

    Example::

        with memtrim.track(model, optimizer) as tracker:
            loss_fn(model(x), y).backward()
            optimizer.step()
        print(tracker.report())

    See NOTE [ memtrim's accounting ] in memtrim/measure/tracker.py for what is counted and how.
    """
    return Tracker(model, optimizer)


# ---------------------------------------------------------------------- helpers
_PRIORITY = {name: i for i, name in enumerate(
    ("parameters", "buffers", "optimizer_state", "gradients", "inputs", "activations", "temporaries", "other")
)}


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_CONTAINERS = (torch.Tensor, list, tuple, dict)
_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]  # not in torch's stubs


class _InputsHook:
    """The model's forward pre-hook that labels its tensor arguments, positional and keyword, as ``inputs``
    (global pre-hooks see no keyword arguments). It holds the tracker weakly; a copy or pickle of the model
    made inside the block carries an inert hook, not the tracker."""

    __slots__ = ("ref",)

    def __init__(self, tracker: Tracker | None = None) -> None:
        self.ref = weakref.ref(tracker) if tracker is not None else None

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        tracker = self.ref() if self.ref is not None else None
        if tracker is not None and tracker._active and tracker in hooks.current():
            tracker._model_inputs(args, kwargs)

    def __reduce__(self) -> tuple:
        return (_InputsHook, ())


_STRIDED = torch.strided


def _storage_of(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """``tensor``'s storage, or None for a tensor without one the tracker can count (sparse, some subclasses)."""
    if tensor.layout is not _STRIDED:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, ValueError):  # ValueError: an uninitialised (lazy) parameter
        return None


def _storage_died(record: _Record) -> None:
    """A record's callback: its storage died."""
    tracker = record.owner()
    if tracker is None or not tracker._active or not record.alive:
        return
    record.alive = False
    records = tracker._records
    if records.get(record.key) is record:
        del records[record.key]
    tracker._event(_FREE, record, record.nbytes)


def _device_name(tensor: torch.Tensor) -> str:
    return "cpu" if tensor.is_cpu else str(tensor.device)


# the next autograd sequence number of this thread, without creating a node
_peek_sequence_nr = torch._C._autograd._get_sequence_nr
# looked up on every op
_graph_task_id = torch._C._current_graph_task_id
_grad_enabled = torch.is_grad_enabled


# what the dispatch mode needs to know of an op, looked up once per op: id(op) -> (op, name, kind). Keyed by id
# because OpOverload's __hash__ is a Python function; the op itself is kept in the value, so its id stays its own.
_OPS: dict[int, tuple[Any, str, str]] = {}
_METADATA, _FRESH, _WRITES, _READS = "metadata", "fresh", "writes", "reads"


def _op_info(func: Any) -> tuple[Any, str, str]:
    """(op, its name, its kind): ``metadata`` (makes no storage, passed through), ``fresh`` (torch.tensor's
    lift_fresh: its input is born now), ``writes`` (may write, and so resize, an argument: in-place and out= ops,
    by their schema) or ``reads``."""
    packet = getattr(func, "overloadpacket", None)
    if packet is not None:
        name = f"{getattr(func, 'namespace', 'aten')}.{packet.__name__}"
    else:
        name = getattr(func, "__name__", None) or str(func)
    schema = getattr(func, "_schema", None)
    if func in _METADATA_OPS:
        kind = _METADATA
    elif func in _FRESH_OPS:
        kind = _FRESH
    elif schema is None or any(arg.alias_info is not None and arg.alias_info.is_write for arg in schema.arguments):
        kind = _WRITES
    else:
        kind = _READS
    info = _OPS[id(func)] = (func, name, kind)
    return info


def _fold_allocator_peaks(device: torch.device) -> None:
    """Before resetting the allocator's peak, let every active tracker keep the peak it has seen."""
    for tracker in hooks.active():
        if tracker._allocator_device == device:
            tracker._fold_allocator_peak()


_ALLOCATOR_FUNCTIONS = (
    "synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated", "max_memory_reserved"
)


def _allocator_module(device: torch.device) -> Any:
    """The torch module (``torch.cuda``, ``torch.xpu``, ...) whose caching allocator keeps ``device``'s memory and
    its peaks, or None (CPU, meta, an accelerator without peak statistics such as MPS)."""
    if device.type in ("cpu", "meta"):
        return None
    try:
        module = torch.get_device_module(device)
    except RuntimeError:  # no torch.<device type> module
        return None
    return module if all(hasattr(module, name) for name in _ALLOCATOR_FUNCTIONS) else None


def _initialised_accelerator() -> tuple[Any, str]:
    """This build's accelerator: (its torch module, its device type) when its runtime is already initialised and
    its allocator keeps peaks; ``(None, "")`` otherwise (the tracker never initialises one itself)."""
    accelerator: torch.device | None = torch.device("cuda")
    if hasattr(torch, "accelerator"):  # torch >= 2.6; before it, CUDA is the one with allocator peaks
        accelerator = torch.accelerator.current_accelerator()  # the build's type: initialises nothing
    if accelerator is None:
        return None, ""
    module = _allocator_module(accelerator)
    if module is None or not module.is_available() or not getattr(module, "is_initialized", lambda: False)():
        return None, ""
    return module, accelerator.type


def _replay(
    events: list[tuple], start_records: Iterable[_Record], devices: tuple[str, ...],
    allocator: tuple[int, int, int | None] | None
) -> MemoryReport:
    index = _CATEGORY_INDEX
    totals = [0] * len(CATEGORIES)
    state: dict[int, list] = {}  # id(record) -> [category, holds, nbytes]
    for record in start_records:
        if record.device in devices:
            state[id(record)] = [record.birth_category, 0, record.start_nbytes]
            totals[index[record.effective(record.birth_category, 0)]] += record.start_nbytes
    timeline: list[TimelineEvent] = []
    peak = sum(totals)
    peak_at = 0
    for i, (kind, record, value, op, phase, module) in enumerate(events):
        if kind == _START:
            timeline.append(TimelineEvent(i, kind, op, phase, module, 0, None, tuple(totals)))
            continue
        if record.device not in devices:
            continue
        current = state.get(id(record))
        if current is not None:
            totals[index[record.effective(current[0], current[1])]] -= current[2]
        delta = 0
        if kind == _ALLOC:
            current = state[id(record)] = [record.birth_category, 0, value]
            delta = value
        elif current is None:
            continue  # an event for a storage born on another device or before a report's window
        elif kind == _FREE:
            delta = -current[2]
            del state[id(record)]
            current = None
        elif kind == _RESIZE:
            delta = value - current[2]
            current[2] = value
        elif kind == _HOLD:
            current[1] += value
        category = None
        if current is not None:
            category = record.effective(current[0], current[1])
            totals[index[category]] += current[2]
        total = sum(totals)
        timeline.append(TimelineEvent(i, kind, op, phase, module, delta, category, tuple(totals)))
        if total > peak:
            peak, peak_at = total, len(timeline) - 1
    peak_event = timeline[peak_at] if timeline else None
    return MemoryReport(
        peak_bytes=peak,
        peak_by_category=peak_event.by_category if peak_event else dict.fromkeys(CATEGORIES, 0),
        peak_phase=peak_event.phase if peak_event else "other",
        peak_module=peak_event.module if peak_event else None,
        peak_op=peak_event.op if peak_event else None,
        final_by_category=dict(zip(CATEGORIES, totals)),
        timeline=timeline,
        device=devices[0],
        allocator_peak_allocated_bytes=allocator[0] if allocator else None,
        allocator_peak_reserved_bytes=allocator[1] if allocator else None,
        allocator_start_allocated_bytes=allocator[2] if allocator else None,
    )

"""The optimizer step fused into backward: each bucket of parameters is updated as soon as its gradients are
complete, and its gradients are freed right away, so the full set of gradients never exists at once.

NOTE [ optimizer in backward ]
* Contract. The training loop is the standard one; memtrim only moves *when* the update happens.
  - An *open step* runs from ``zero_grad()`` to ``step()``. A backward pass inside an open step (and outside
    ``accumulate()``) updates the parameters it reaches, bucket by bucket, and frees their gradients.
  - Every other backward pass (before the first ``zero_grad()``, between ``step()`` and the next ``zero_grad()``,
    inside ``accumulate()``) accumulates into ``.grad`` exactly as in the standard loop: a GAN's generator loss
    reaching the discriminator, an adversarial attack's backward after ``step()``, micro-batches.
  - ``step()`` applies every gradient still waiting (written by ``torch.autograd.grad``, accumulated, left by
    a parameter that missed the backward, zero gradients kept by ``zero_grad(set_to_none=False)``), runs the
    step hooks, and closes the step.
  - Whatever memtrim cannot make bitwise equal raises ``OptimizerInBackwardError`` at the first moment it can
    tell: a second gradient for a parameter already updated in this step (two losses, an attack's backward in
    the open step, a later micro-batch inside ``accumulate()``), a second ``step()`` without ``zero_grad()``,
    ``zero_grad()`` discarding a step that was already applied, an exception inside a backward that had already
    updated parameters, the user's own ``clip_grad_norm_`` on freed gradients, a GradScaler
    driving a wrapper that was not told about it, two open wrappers on one parameter, one wrapper used from two
    threads at once; and, at ``step()``, anything the standard ``step()`` would have used differently than the
    update inside backward did: a hyperparameter changed since (an ``lr`` set by hand, ``sched.step()`` before
    ``opt.step()``; compared per group, every key but 'params', tensors by version) or a parameter written in
    place since its update (manual weight decay; compared by ``_version``). A skipped ``step()`` (a non-finite
    loss) is reported at the next ``zero_grad()``.
* Source of truth: the wrapped ``torch.optim`` optimizer. A bucket is stepped by calling that optimizer's own
  ``step`` with ``param_groups`` temporarily narrowed to the bucket (each narrowed group is a shallow copy of
  the real group, so hyperparameters, including a scheduler's latest learning rate, are read at that moment;
  ``state`` is shared). The update of a parameter depends only on its gradient and state, so this is bitwise
  equal to one ``step()`` over all parameters, with the same foreach/fused implementation. An optimizer that keeps
  state of its own would advance it once per call instead of once per step (``_watch``/``_settle``): a group's
  entries (tensors by version, generators by state) are refused where the group is stepped twice in a step (several
  buckets, or ``accumulate()``); the whole optimizer's state (entries of groups a call was not given, a tensor or
  generator several groups hold, and for classes outside torch.optim and memtrim their own numbers and generators
  and the global generators) where the step is several calls and it changes twice in a step or again after the
  first step (a flag set up once is fine; a per-step counter read by every group raises at the second step); and a
  foreign class's writes to parameters outside the bucket, at once.
* When: ``register_post_accumulate_grad_hook`` marks a parameter ready; a bucket steps when its last expected
  parameter is ready (memtrim's hook is moved behind the user's own at each ``zero_grad()``, so a user's hook
  that edits ``.grad`` runs first; one registered inside the open step makes its bucket wait for the end of
  backward); at the end of the backward pass (an autograd engine callback) any bucket with some ready
  parameters steps too. Under DDP the gradients are taken from DDP's comm hook after the all-reduce instead (a
  post-accumulate hook there would see the local gradient and ranks would drift). Under FSDP2 the hooks fire on
  the sharded, reduce-scattered gradient. Hooks hold the wrapper weakly: a wrapper nobody references stops.
* Peak memory: an update inside backward runs while the activations that backward still needs are alive, so
  its temporaries (AdamW: about twice the bucket's bytes) add to the memory of that moment, while the gradients
  already freed subtract from it: at any moment, memory = the standard loop's at that moment - gradients freed
  + temporaries. ``peak="never_higher"`` (default) updates a complete bucket only if memory now + its
  temporaries stays under the most the standard loop surely holds in this step (parameters + optimizer state +
  every gradient, and what it held at each earlier moment of this backward: memory then + gradients freed by
  then); otherwise the bucket is held back and retried as backward frees memory, at the end of backward, and
  finally in ``step()`` (where the standard loop steps it too). Memory is read from the accelerator's allocator
  (``torch.cuda``, ``torch.xpu``, ...), or on CPU from an active memtrim tracker; on CPU without a tracker nothing
  can be read and buckets update as soon as complete. ``peak="lowest"`` always updates at once: the lowest peak
  for parameter-heavy models, a higher one for activation-heavy ones (benchmarks/optimizer_in_backward_peak.py).
* Global information (clipping by global norm, GradScaler's inf check) needs every gradient before any update:
  ``backward(loss)`` then runs two passes: the first computes the norms / inf flags and frees each gradient at
  once, the second (same graph, retained) updates. Cost: one extra backward pass. A backward that draws (a
  gradient-noise hook) draws the same numbers in both passes and ends where one pass would, or raises
  (NOTE [ a backward run twice ]), and the norms are summed as ``clip_grad_norm_(model.parameters())`` sums them: in the
  model's order, grouped by device and dtype (torch's own grouping), so the total is bitwise the usual loop's. The
  first pass reaches the wrapper's own parameters only (``backward(inputs=...)``): any other leaf (a parameter another
  optimizer trains, an input that requires grad) gets its gradient once, from the second. With ``model=``, a model
  parameter that requires grad outside the optimizer is refused under clipping (the usual clip would count it).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import random
import threading
import types
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, cast

import torch
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
from torch.utils.weak import WeakIdKeyDictionary

from ..._signatures import not_owned
from ...errors import InvalidInputError, MemtrimStateError, OptimizerInBackwardError
from ...measure import hooks as measure_hooks
from .._generators import TwoPassDraws, _global_generators, generator_bytes, unwatched
from .._modes import putting_buffers_back
from ..guards import register_own
from .held_elsewhere import gather_gradient, held_gradients, holder_of
from .wrapping import WrappedOptimizerView, needs_closure, sharded

__all__ = ["OptimizerInBackward", "OptimizerInBackwardError"]

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
_PEAK_MODES = ("never_higher", "lowest")
# Temporaries of one optimizer step, in bytes per byte of the parameters stepped (foreach Adam/AdamW allocate
# about two bucket-sized tensors; measured with memtrim.track, see benchmarks/optimizer_in_backward_peak.py).
_TEMPORARIES_PER_BYTE = 2

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> weakref to the wrapper of its open step
_OWNERSHIP = [0]  # bumped whenever _OWNERS changes: a wrapper whose claim still stands skips the walk at zero_grad()


def _memory_now(device: torch.device) -> int | None:
    """Bytes allocated on ``device`` now: the allocator's counter on an accelerator, the memtrim tracker watching
    this thread on CPU (or on an accelerator whose torch module keeps no counter). Not another thread's tracker: its
    count is of that thread's tensors, and reading it while that thread allocates raised or crashed (an adversarial
    pass: a tracker open in another thread also took the saving away)."""
    if device.type != "cpu":
        try:
            module = torch.get_device_module(device)
        except RuntimeError:  # a device with no torch module (meta): no allocator to read
            module = None
        memory_allocated = getattr(module, "memory_allocated", None)
        if memory_allocated is not None:
            return int(memory_allocated(device))
    trackers = measure_hooks.current()
    if trackers:
        return max(tracker.live_bytes(str(device)) for tracker in trackers)
    return None


class _Bucket:
    __slots__ = ("group", "params", "ready", "expected", "nbytes")

    def __init__(self, group: int, params: list[torch.Tensor]) -> None:
        self.group = group
        self.params = params
        self.ready: set[int] = set()  # indices into params
        self.expected = len(params)  # parameters that can receive a gradient through a hook in this step
        self.nbytes = sum(p.numel() * p.element_size() for p in params)


class _Watched:
    """What :meth:`OptimizerInBackward._watch` read before a call of the wrapped optimizer's step."""

    __slots__ = ("groups", "others", "own")

    def __init__(self) -> None:
        self.groups: list[dict[str, Any]] = []
        self.others: list[tuple[torch.Tensor, int]] = []
        self.own: dict[str, Any] = {}


class _Outcome:
    """What one backward pass did; outlives the pass so that a pass killed by an exception can be told apart."""

    __slots__ = ("ran", "updated")

    def __init__(self) -> None:
        self.ran = False
        self.updated = 0


class _EndOfBackward:
    """Queued as the autograd engine's final callback; freed with the graph task, run only if it succeeded."""

    __slots__ = ("wrapper", "outcome", "__weakref__")

    def __init__(self, wrapper: weakref.ref, outcome: _Outcome) -> None:
        self.wrapper = wrapper
        self.outcome = outcome

    def __call__(self) -> None:
        self.outcome.ran = True
        wrapper = self.wrapper()
        if wrapper is not None:
            with unwatched():
                wrapper._end_of_backward()


def _backward_gone(wrapper_ref: weakref.ref, outcome: _Outcome) -> None:
    wrapper = wrapper_ref()
    if wrapper is not None and not outcome.ran:
        wrapper._backward_aborted(outcome)


def _param_hook(wrapper_ref: weakref.ref) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:
            with unwatched():  # memtrim's own measuring and updating: not the backward's draws
                wrapper._on_param_ready(param)

    return hook


class _OutputHook:
    """Forward hook on the model: each output tensor counts the backward passes through its graph.

    A class, not a closure, so that ``torch.save(model)`` and ``copy.deepcopy(model)`` work while the wrapper is
    attached (a closure cannot be pickled): a saved or copied model gets an inert hook (the copy is not the model
    this wrapper trains; an EMA copy's forward is not one of its steps)."""

    __slots__ = ("wrapper_ref",)

    def __init__(self, wrapper_ref: weakref.ref | None) -> None:
        self.wrapper_ref = wrapper_ref

    def __reduce__(self) -> tuple[Any, tuple[None]]:
        return _OutputHook, (None,)

    # run as Python under torch.compile of the model (a graph break after the model's last op): traced, the grad hook
    # it registers was rebuilt with the wrapper where its weak reference was, and raised a TypeError in the first
    # backward; and the step's state it reads would be baked into the graph's guards
    @torch.compiler.disable
    def __call__(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.wrapper_ref is None:
            return
        wrapper_ref = self.wrapper_ref
        wrapper = wrapper_ref()
        if wrapper is None or wrapper._removed:
            return
        if (wrapper._open and wrapper._updated_in_backward and not wrapper._accumulating
                and not wrapper.__dict__.get("_in_step") and wrapper._thread == threading.get_ident()
                and torch._C._current_graph_task_id() == -1):  # (a checkpoint's recomputation runs in backward)
            # found by an adversarial pass: a GAN loop opening both steps first, then the discriminator's backward,
            # then the generator's loss through the discriminator, then both steps: the standard loop runs that
            # forward with the discriminator's old weights, this wrapper had already updated them. (Inside
            # accumulate(), the backward that follows says more: a micro-batch after the one that updated.)
            count = wrapper._updated_in_backward
            wrapper._close_step()  # reported once, as the other refusals: training can go on
            raise OptimizerInBackwardError(
                f"OptimizerInBackward: a forward of the model ran after a backward pass had already updated "
                f"{count} of its parameter(s) inside this training step, before step(): the "
                "standard loop would run it with the weights before the update: a second micro-batch (run every "
                "micro-batch's backward inside `with opt.accumulate():`, the update then waits for step()), a "
                "logging or evaluation forward between backward and step() (run it before the backward or after "
                "step()), or a GAN's generator loss through a discriminator whose own loss's backward ran first "
                "(optD.step() right after the discriminator's backward)."
            )
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in _tensors(output) if t.requires_grad]
        if not tensors:
            return
        seen: dict[str, int] = {}  # serial of the open step whose backward last went through this graph

        def grad_hook(grad: torch.Tensor) -> None:
            wrapper = wrapper_ref()
            if wrapper is None or wrapper._accumulating:
                return
            task = torch._C._current_graph_task_id()  # several outputs of one pass (logits and a hidden state
            # that feeds them) are one backward, not two; no public API tells which backward pass is running
            if (wrapper._open and seen.get("serial") == wrapper._serial and seen.get("task") != task
                    and wrapper._updated_in_backward):
                wrapper._close_step()
                raise OptimizerInBackwardError(
                    "OptimizerInBackward: expected one backward pass per training step through a graph, but a "
                    "second backward on the same (retained) graph started after the first had already updated "
                    "parameters inside it: the graph's saved parameters are no longer the ones it was built with "
                    "(torch would raise that a variable was modified by an inplace operation). Run the first "
                    "backward inside `with opt.accumulate():` (loss1.backward(retain_graph=True)), then the "
                    "second normally; the update then uses the sum of both gradients, as in the standard loop."
                )
            if wrapper._open:
                seen["serial"] = wrapper._serial
                seen["task"] = task

        register_own([(tensor.register_hook, grad_hook) for tensor in tensors])  # (at every forward)


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in _tensors(item)]
    return []


def _remove_handles(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


_REENTRANT = (
    "OptimizerInBackward.backward: clip_grad_norm= and scaler= run backward twice, the first pass over this "
    "optimizer's parameters only (backward(inputs=...)), which reentrant checkpointing (torch.utils.checkpoint(..., "
    "use_reentrant=True), HF's gradient_checkpointing_enable() with use_reentrant=True) refuses, or leaves out where "
    "no parameter of this optimizer lies before it (the gradients inside would go unmeasured). Expected "
    "non-reentrant checkpointing; found a reentrant region. To fix: checkpoint(..., use_reentrant=False), "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}), or "
    "memtrim.checkpoint_modules."
)


# what Lightning users call instead of what self.optimizers() returns (a copy of the wrapper, stepped with a closure)
_LIGHTNING_WAY_OUT = ("self.optimizers(use_pl_optimizer=False) (Lightning then counts no optimizer steps: bound the "
                      "run by max_epochs)")


class OptimizerInBackward(WrappedOptimizerView):
    """Wrap an optimizer so that it steps inside backward, bucket by bucket, freeing gradients as it goes.

    Why: gradients are as large as the parameters; stepping inside backward keeps at most about one bucket
    of them alive (LOMO, arXiv 2306.09782), without the per-parameter optimizers, lost schedulers, missing
    clipping and accumulation, and DDP drift of the usual recipes.

    The contract (NOTE [ optimizer in backward ]): a backward pass between ``zero_grad()`` and ``step()`` updates
    the parameters it reaches; any other backward pass accumulates into ``.grad`` as in the standard loop, and
    ``step()`` applies any gradient still waiting. The result is bitwise equal to the standard loop, or memtrim
    raises ``OptimizerInBackwardError`` saying what to change.

    Args:
        optimizer: an ordinary, already-built ``torch.optim`` optimizer whose update of a parameter depends only
            on that parameter's gradient and state (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad,
            Adadelta, ...). It stays the source of truth: param_groups, hyperparameters, state and step hooks.
        model: the model (or its ``DistributedDataParallel`` wrapper). Optional without distributed training;
            required under DDP (memtrim registers a comm hook on it). All optimized parameters must belong to it.
        clip_grad_norm: clip by global 2-norm, exactly as ``torch.nn.utils.clip_grad_norm_(model.parameters(),
            clip_grad_norm)`` (the model's order; without ``model``, the optimizer's parameters in order); needs
            ``backward(loss)`` (two passes).
        clip_grad_value: clamp each gradient to ``[-v, v]`` before its update (no extra pass).
        scaler: a ``torch.amp.GradScaler``; an inf/NaN anywhere skips the whole update and lowers the scale.
            Call ``opt.backward(scaler.scale(loss))``, then ``scaler.step(opt)`` and ``scaler.update()``
            (``scaler.unscale_(opt)`` between them is allowed and changes nothing).
        bucket_bytes: parameters of one param group are stepped together in buckets of about this many bytes
            (in reverse order, the order their gradients usually arrive); ``0`` steps each parameter alone.
        peak: ``"never_higher"`` (default): a complete bucket is updated inside backward only when memory
            measured now plus its update's temporaries stays under what the standard loop holds; otherwise later
            (end of backward, or ``step()``), so the step's peak is never above the standard loop's. Memory is
            read from the accelerator's allocator or, on CPU, an active memtrim tracker (without one: at once).
            ``"lowest"``: every bucket as soon as it is complete (may lift an activation-heavy model's peak).

    Raises:
        InvalidInputError: not an optimizer; a closure-based or global optimizer (LBFGS); parameters the model
            does not own; bad option values; distributed training without a DDP model or FSDP2 parameters.

    Example::

        opt = memtrim.OptimizerInBackward(torch.optim.AdamW(model.parameters(), lr=1e-3))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        for x, y in batches:
            opt.zero_grad()                   # opens the step
            loss_fn(model(x), y).backward()   # parameters are updated here, gradients freed
            opt.step()                        # applies anything still waiting, runs hooks, closes the step
            sched.step()

    See NOTE [ optimizer in backward ] in this file.
    """

    # GradScaler.step(opt) then hands the scale and the inf flag to step() instead of unscaling gradients that
    # were already applied and freed (and tells us a scaler is in use).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        scaler: Any = None,
        bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
        peak: str = "never_higher",
    ) -> None:
        _check_optimizer(optimizer)
        _check_options(clip_grad_norm, clip_grad_value, scaler, bucket_bytes, peak)
        # Optimizer.__init__ is not called: param_groups, state and defaults are the wrapped optimizer's own.
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        if clip_grad_norm is None and clip_grad_value is None:
            _check_fused_unscaling(optimizer, self.scaler)
        self.bucket_bytes = bucket_bytes
        self.peak = peak
        self._two_passes = clip_grad_norm is not None or self.scaler is not None
        self._ddp = _check_model(model, optimizer)
        self._optimizer_step_pre_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict[int, Callable] = OrderedDict()
        self._self_ref = weakref.ref(self)
        self._claimed: tuple[int, Any] = (-1, None)  # (_OWNERSHIP, groups signature) when its parameters were claimed
        self._handles: list[Any] = []
        self._hooked: set[int] = set()
        self._hook_ids: dict[int, int] = {}  # id(param) -> key of memtrim's hook in its post-accumulate-grad hooks
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)
        self._removed = False
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> (bucket, index)
        self._by_id: dict[int, torch.Tensor] = {}
        self._sparse_layout: dict[int, tuple[int, int]] = {}  # id(param) -> its last freed sparse gradient's dims
        self._steps_closed = 0  # training steps that updated something
        self._init_step_state()
        raw = getattr(type(optimizer).step, "__wrapped__", None)  # the step without hooks and profiler records
        self._raw_step = raw if raw is not None else type(optimizer).step
        install_clip_guard()
        _WRAPPERS.add(self)
        self._build_buckets()
        self._serial = 0  # counts zero_grad() calls: which open step a graph was built in
        # the order clip_grad_norm sums the norms in (the usual loop clips model.parameters())
        self._model = weakref.ref(model) if model is not None else None
        self._attach(model)

    def _init_step_state(self) -> None:
        """The bookkeeping of one training step and of the two-pass backward (NOTE [ optimizer in backward ])."""
        self._open = False
        self._inner_steps = 0  # calls of the wrapped optimizer's step in this training step
        self._group_calls: dict[int, int] = {}  # group index -> calls of the step over it in this training step
        self._whole_calls = 0  # calls in this training step that changed the whole optimizer's state
        self._thread: int | None = None
        self._stepped: set[int] = set()  # updated (or consumed by a skipped update) in this step
        self._updated_in_backward = 0
        self._pre_hooks_ran = False
        self._freed: set[int] = set()  # gradients freed that the standard loop would still hold
        self._zero_pending: set[int] = set()  # the standard loop holds a zero gradient here; we hold None
        self._accumulating = 0
        self._outcome: _Outcome | None = None
        self._token: weakref.ref | None = None
        self._pending_error: str | None = None
        self._measured = 0  # gradients the running measuring pass measured and freed
        self._lost: str | None = None  # why step() cannot do what the standard one would (a backward raised)
        self._freed_bytes = 0  # gradient bytes freed inside the current backward pass
        self._held: list[_Bucket] = []  # complete buckets held back to the end of backward (peak="never_higher")
        self._held_to_step: list[_Bucket] = []  # ... and, where even that would lift memory, to step()
        self._late: list[_Bucket] = []  # a user's grad hook runs after memtrim's: updated at the end of backward
        self._late_measure: list[torch.Tensor] = []  # ... measured at the end of the measuring pass
        # what the updates inside backward used, checked at step(): hyperparameters per group, parameter versions
        self._used_hyper: dict[int, dict[str, Any]] = {}  # group -> what its first update in backward used
        self._hyper_between: dict[int, dict[str, Any]] = {}  # group -> other values a later update of the step used
        # id(param) -> (param, its optimizer state's fingerprint once backward's updates are done)
        self._state_marks: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}
        # id(param) -> (id of its state object, the keys its update writes): NOTE [ keys a loop logs ] (an id: a
        # state loaded over it is not kept alive)
        self._own_keys: dict[int, tuple[int, frozenset[str]]] = {}
        self._made: list[torch.Tensor] = []  # parameters whose state this step's updates made (_order_new_states)
        self._versions: dict[int, tuple[torch.Tensor, int]] = {}
        self._ceiling: int | None = None  # the most the standard loop surely holds in this step (bytes)
        # global information
        self._pass: str | None = None  # None: single pass; "measure" / "update" inside backward(loss)
        self._norms: dict[int, torch.Tensor] = {}
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._scaler_found: torch.Tensor | None = None
        self._skipped = False  # a GradScaler found inf/NaN: this step's update is skipped, as scaler.step skips it
        self._coefficient: torch.Tensor | None = None
        self._callback_queued = False  # DDP only
        self._deferred = False  # accumulated gradients: step after backward instead of inside it

    def _attach(self, model: torch.nn.Module | None) -> None:
        """Hook the model (when given) and the parameters, or DDP's comm hook under DDP."""
        if model is not None:
            # a graph backwarded twice (retain_graph=True) after an update inside the first: say so before torch's
            # version-counter error does
            self._handles.append(model.register_forward_hook(_OutputHook(self._self_ref)))
        if self._ddp is not None:
            # weak references both ways: DDP's C++ reducer must not keep the wrapper (and itself) alive
            self._ddp.register_comm_hook(self._self_ref, _ddp_comm_hook)
            self._ddp = weakref.ref(self._ddp)
        else:
            _check_not_distributed(self.optimizer, self._two_passes)
            self._hook_new_params()

    # ------------------------------------------------------------------ the wrapped optimizer's view
    @property
    def state(self) -> Any:  # the wrapped optimizer's own
        """The wrapped optimizer's per-parameter ``state`` (assignable, as a plain optimizer's: a reset)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()``: interchangeable with plain training, both ways."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer: a ``state_dict()`` of plain training or of a wrapper alike."""
        self.optimizer.load_state_dict(state_dict)

    def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer, run before its ``state_dict()``; returns the handle."""
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer, run after its ``state_dict()``; returns the handle."""
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer, run before its ``load_state_dict()``; returns the handle."""
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> Any:
        """Register ``hook`` on the wrapped optimizer, run after its ``load_state_dict()``; returns the handle."""
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters are bucketed and hooked like the others. With
        ``model=``, a parameter the model does not own is refused (the group is not kept), as at construction."""
        self.optimizer.add_param_group(param_group)
        model = self._model() if self._model is not None else None
        if model is not None:
            try:
                _check_owned(model, self.optimizer)
            except InvalidInputError:
                self.optimizer.param_groups.pop()
                raise
        self._build_buckets()
        if self._ddp is None and not self._removed:
            self._hook_new_params()

    def __repr__(self) -> str:
        return f"OptimizerInBackward({self.optimizer!r}, buckets={len(self._buckets)})"

    # ------------------------------------------------------------------ the training loop
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Open a training step: backward passes from here to ``step()`` update the parameters they reach.

        Raises:
            OptimizerInBackwardError: the step being discarded was already applied inside backward (``step()``
                was not called, or the backward was not the training loss: run it inside ``accumulate()``); the
                last backward raised after updating parameters; another open wrapper updates these parameters.
        """
        self._refuse_copy("zero_grad")
        self._raise_pending("zero_grad")  # (a failed two-pass backward's batch skipped: _close_step forgets it)
        if self._open and self._updated_in_backward:
            count = self._updated_in_backward
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.zero_grad: expected step() to close the training step, but {count} "
                "parameter(s) were already updated inside a backward pass since the last zero_grad(), and "
                "zero_grad() would now discard that gradient (the standard loop would never apply it). Call "
                "opt.step() after the training loss's backward; run any other backward in the step (an "
                "adversarial attack's input gradient, a probe) inside `with opt.accumulate():` or with "
                "torch.autograd.grad(loss, inputs). Skipping a bad batch after backward (`if not "
                "torch.isfinite(loss): continue`) comes too late: the update was already applied inside backward. "
                "Check the loss before calling backward, or pass scaler= (a torch.amp.GradScaler skips every "
                "non-finite step) and call opt.backward(scaler.scale(loss))."
            )
        self._close_step()
        self._sync_groups()
        if set_to_none:
            self._freed.clear()
            self._zero_pending.clear()
        else:
            self._zero_pending = {k for k in self._freed | self._zero_pending if self._by_id[k].grad is None}
            self._freed.clear()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._removed:
            return
        self._claim_params()
        if self._ddp is None:
            self._hook_new_params()
            self._hooks_last()
        for bucket in self._buckets:
            bucket.expected = sum(1 for p in bucket.params if p.requires_grad and id(p) in self._hooked)
        self._open = True
        self._serial += 1
        self._thread = threading.get_ident()

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Apply every gradient still waiting, run the step hooks, and close the training step.

        Gradients that backward passes outside an open step (or inside ``accumulate()``) left in ``.grad``, or that
        were written by hand, are applied here by the wrapped optimizer, as in the standard loop.

        Raises:
            InvalidInputError: a closure is given (in-backward stepping cannot re-evaluate the loss).
            OptimizerInBackwardError: the step cannot be bitwise equal to the standard loop's (see the message).
        """
        self._refuse_copy("step")
        if closure is not None:
            raise InvalidInputError(
                "OptimizerInBackward.step: closures are not supported; the update happens inside backward. "
                "Lightning passes one (automatic optimization, and LightningOptimizer.step with manual optimization): "
                "use manual optimization with the wrapper itself, " + _LIGHTNING_WAY_OUT + "."
            )
        self._raise_pending("step")
        self._raise_lost("step")
        self._check_not_stepped_twice()
        self._check_unchanged()
        driven = "found_inf" in self.__dict__  # GradScaler.step(self) set grad_scale / found_inf
        self._check_scaler_known(driven)
        # a step a GradScaler skips runs no step hooks: the standard loop's scaler.step(opt) never calls opt.step()
        if not self._skipped:
            for hook in tuple(_global_hooks("_global_optimizer_pre_hooks")):
                hook(self, (), {})
        held, self._held_to_step = self._held_to_step, []
        for bucket in held:
            self._step_bucket(bucket)
        self._sync_groups()
        waiting = self._waiting_gradients()
        if waiting:
            self._warn_never_opened()
            self._apply_waiting(waiting, driven)
        self._tell_scaler()
        self._order_new_states()
        skipped = self._skipped
        self._in_step = True  # a step hook that runs the model (a validation forward) runs after the update, as torch's
        try:
            if not skipped:
                self._run_pre_hooks()
                for hook in tuple(self.optimizer._optimizer_step_post_hooks.values()):
                    hook(self.optimizer, (), {})
                for hook in tuple(self._optimizer_step_post_hooks.values()):
                    hook(self, (), {})
                self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check
        finally:  # the update is applied: a step hook that raises still closes the step (the next zero_grad() said
            self._in_step = False  # the step was never closed; found by an adversarial pass on 2026-11-29)
            self._close_step()
        if not skipped:
            for hook in tuple(_global_hooks("_global_optimizer_post_hooks")):
                hook(self, (), {})

    def _order_new_states(self) -> None:
        """The states this step's updates made, last in the optimizer's state and in its parameter order, as the
        standard ``step()`` makes them: those made inside backward came in backward's order, so ``state_dict()``
        listed them reversed (``torch.save`` wrote other bytes than the standard loop's) until 2026-12-03 (an
        adversarial pass). States the loop made itself (a key logged) stay where it made them."""
        made, self._made = self._made, []
        state = self.optimizer.state
        made = [p for p in made if p in state]
        if len(made) < 2:
            return
        entries = [(p, state.pop(p)) for p in sorted(made, key=lambda p: self._position.get(id(p), (math.inf, 0)))]
        state.update(entries)

    def _warn_never_opened(self) -> None:
        """A loop that never calls this wrapper's ``zero_grad()`` (HF's ``Trainer`` calls ``model.zero_grad()``)
        opens no step: every update runs here, after backward, as the plain optimizer's (bitwise), and saves nothing.
        Said once per wrapper."""
        if self._serial or self.__dict__.get("_warned_never_opened"):
            return
        self._warned_never_opened = True
        warnings.warn("OptimizerInBackward.step: no zero_grad() on this wrapper has opened a training step, so the "
                      "update ran here, after backward, as the wrapped optimizer's (the same training) and saved no "
                      "memory. Call opt.zero_grad() on the wrapper before each step's backward (a loop that calls "
                      "only model.zero_grad(), as HF's Trainer does, never opens one).", stacklevel=3)

    def _check_not_stepped_twice(self) -> None:
        """``step()`` after a closed step: the standard loop would apply gradients that were freed inside backward."""
        if self._open or self._removed:
            return
        gone = [self._by_id[k] for k in self._freed if self._by_id[k].grad is None]
        if gone:
            raise OptimizerInBackwardError(
                "OptimizerInBackward.step: expected zero_grad() between two step() calls, but step() ran again "
                f"after the previous one with no zero_grad() between; the standard loop would apply the "
                f"previous gradients once more ({len(gone)} parameter(s), the first of shape "
                f"{tuple(gone[0].shape)}), and they were applied and freed inside backward. Call step() once "
                "per training step (with a GradScaler: scaler.step(opt) only, not opt.step() as well)."
            )

    def _check_scaler_known(self, driven: bool) -> None:
        """A GradScaler steps this wrapper (``driven``) but the wrapper, not told, already applied scaled gradients."""
        if driven and self.scaler is None and self._updated_in_backward:
            self._close_step()
            raise OptimizerInBackwardError(
                "OptimizerInBackward.step: a GradScaler steps this optimizer, but the wrapper was built without "
                "it, so the scaled gradients were already applied inside backward (unscaled, unchecked). Build "
                "it with OptimizerInBackward(optimizer, scaler=scaler) and call opt.backward(scaler.scale(loss))."
            )

    def _waiting_gradients(self) -> list[torch.Tensor]:
        """The parameters ``step()`` itself updates (gradients not applied inside backward), in the optimizer's
        order; raises where the standard loop would have combined them with gradients already applied."""
        waiting = [
            p for group in self.optimizer.param_groups for p in group["params"]
            if id(p) not in self._stepped and (p.grad is not None or id(p) in self._zero_pending)
        ]
        stale = [p for p in waiting if id(p) in self._freed and p.grad is not None]
        if stale:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: expected each step's gradients to start from zero_grad(), but "
                f"{len(stale)} parameter(s) received a gradient after the previous step without zero_grad() "
                "between; the standard loop would add it to the previous step's gradient, which was applied and "
                "freed inside backward. Call opt.zero_grad() before each training step's backward (model.zero_grad() "
                "does not reach the wrapper, which opens a step at opt.zero_grad())."
            )
        rewritten = [p for group in self.optimizer.param_groups for p in group["params"]
                     if id(p) in self._stepped and p.grad is not None]
        if rewritten and self._updated_in_backward:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: expected the gradients of a step to come from its backward, but "
                f"{len(rewritten)} parameter(s) (the first of shape {tuple(rewritten[0].shape)}) that were already "
                "updated inside backward have a .grad again, written after it (gradient surgery such as PCGrad, an "
                "auxiliary gradient added by hand). The standard loop's step() would apply it; here the update "
                "already happened. To fix: run that step's backward inside `with opt.accumulate():`, edit .grad, "
                "then call opt.step(), which applies the gradients in .grad (no memory saved for that step)."
            )
        late = [p for p in waiting if p.grad is not None]  # not the zeros zero_grad(set_to_none=False) keeps
        if late and self._updated_in_backward and self.clip_grad_norm is not None:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: clip_grad_norm needs every gradient of a step at once, but "
                f"{len(late)} gradient(s) arrived after the update inside backward. Produce all of a step's "
                "gradients in the backward of opt.backward(loss) (earlier ones inside accumulate())."
            )
        return waiting

    def _tell_scaler(self) -> None:
        """Hand the scaler the inf/NaN flags found inside backward, where its ``update()`` reads them.

        GradScaler's private per-optimizer state: torch has no public way to report them. Its ``step``/``unscale_``
        check the ``.grad`` of the optimizer's parameters, which were applied and freed inside backward.
        """
        if self.scaler is not None and self._scaler_found is not None:
            found = self._scaler_found
            self.scaler._per_optimizer_states[id(self)]["found_inf_per_device"] = {found.device: found}

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Backward passes inside accumulate into ``.grad`` as in the standard loop (no update inside them).

        For earlier micro-batches, a second loss on the same graph, or an adversarial attack's backward inside
        an open step. The next backward outside it (or ``step()``) applies the accumulated gradients.

        Example::

            opt.zero_grad()
            for x, y in micro_batches[:-1]:
                with opt.accumulate():
                    loss_fn(model(x), y).backward()
            loss_fn(model(x_last), y_last).backward()   # updates with the accumulated gradients
            opt.step()
        """
        self._accumulating += 1
        try:
            yield
        finally:
            self._accumulating -= 1

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, in two passes when clipping by norm or a GradScaler needs every gradient first.

        Extra keyword arguments go to ``torch.Tensor.backward`` (``retain_graph`` is managed here).
        """
        self._refuse_copy("backward")
        if not isinstance(loss, torch.Tensor):
            raise InvalidInputError(f"OptimizerInBackward.backward: loss must be a tensor, got {type(loss).__name__}.")
        if not self._open or self._accumulating or not self._two_passes or self._removed:
            loss.backward(**kwargs)
            return
        if self._ddp is not None:
            loss.backward(**kwargs)  # DDP: one pass; the step follows DDP's all-reduce (see _ddp_comm_hook)
            return
        self._check_first_backward_of_the_step()
        self._raise_lost("backward")  # a retry after a failed two-pass backward: the step is lost already
        if self.clip_grad_norm is None and self.clip_grad_value is None:
            _check_fused_unscaling(self.optimizer, self.scaler)  # (a scaler's state loaded since construction)
        retain = kwargs.pop("retain_graph", False)
        if self._has_waiting_grads():
            # earlier micro-batches left gradients: they all exist anyway, so step after a single pass
            self._deferred = True
            try:
                loss.backward(retain_graph=retain, **kwargs)
            finally:
                self._deferred = False
            self._finish_deferred()
            return
        self._check_clip_covers_the_model()
        self._check_no_selective_checkpoint()
        self._check_graph(loss)
        self._pass = "measure"
        self._measured = 0
        _TWO_PASSES.wrapper = self
        # the measuring pass reaches this optimizer's parameters only: any other leaf (a parameter another
        # optimizer trains, an input that requires grad) gets its gradient once, from the updating pass
        given = kwargs.pop("inputs", None)
        own = [p for p in self._by_id.values() if p.requires_grad and (
            given is None or any(p is q for q in ([given] if isinstance(given, torch.Tensor) else given)))]
        try:
            # a backward that draws random numbers (a gradient-noise hook) draws the same in both passes: the norm is
            # measured on the gradient the update applies, and the generators end where one pass leaves them
            # (NOTE [ a backward run twice ])
            first = TwoPassDraws()
            with first, _forwards_undone(loss):
                if own:
                    try:
                        _run_backward(loss, retain_graph=True, inputs=own, **kwargs)
                    except RuntimeError as e:
                        if "reentrant" not in str(e):
                            raise
                        self._close_step()
                        raise OptimizerInBackwardError(_REENTRANT) from e
            first.conclude()
            self._conclude_measure()
            if self._skip_update():
                self._stepped.update(self._where)  # this step is consumed: nothing may arrive for it later
                return
            self._pass = "update"
            second = TwoPassDraws(first)
            try:
                with second:
                    _run_backward(loss, retain_graph=retain, inputs=given, **kwargs)
                second.check()
            except OptimizerInBackwardError as e:
                if e is second.error:  # raised among or after the updates: step() then says the step is lost
                    self._note_lost(e)
                raise
        except BaseException as e:
            if not isinstance(e, OptimizerInBackwardError):  # memtrim's own errors close the step themselves
                self._note_lost(e)
            raise
        finally:
            _TWO_PASSES.wrapper = None
            self._pass = None
            self._norms.clear()

    def _check_first_backward_of_the_step(self) -> None:
        """A second ``opt.backward`` in one step, on other parameters (two towers, two heads): the standard loop clips
        by (or checks for infs in) every gradient of the step at once, after both backward passes."""
        updated = self._updated_in_backward
        if updated or (self._skipped and self._stepped):
            self._close_step()
            done = f"updated {updated} parameter(s)" if updated else "skipped the update (an inf or NaN)"
            raise OptimizerInBackwardError(
                "OptimizerInBackward.backward: clip_grad_norm= and scaler= need every gradient of a step before any "
                "update (one global norm, one inf check), but an earlier opt.backward(loss) of this step already "
                f"{done}, and the standard loop would clip (or skip) both backward passes' gradients together. To "
                "fix: add the losses and call opt.backward once, or run the earlier backward passes inside `with "
                "opt.accumulate():`."
            )

    def _check_no_selective_checkpoint(self) -> None:
        """torch lets backward run through a selectively checkpointed region once; the two passes run it twice, and
        torch's error would come in the second, after the parameters behind the region had been updated."""
        from ..checkpoint._core import selective_parameters  # checkpoint imports recompute, not this module

        selective = selective_parameters()
        inside = [p for p in self._by_id.values() if id(p) in selective]
        if inside:
            self._close_step()
            raise OptimizerInBackwardError(
                "OptimizerInBackward.backward: clip_grad_norm= and scaler= run backward twice (a pass that measures "
                f"every gradient, then the one that updates), but {len(inside)} of this optimizer's parameters (the "
                f"first of shape {tuple(inside[0].shape)}) are in a module checkpointed with a policy (selective "
                "checkpointing), which torch lets backward run through once. Expected one pass through such a "
                "region; found two. To fix: checkpoint_modules(..., policy=None) (whole modules), or clip with "
                "torch.nn.utils.clip_grad_norm_ after loss.backward() and a plain optimizer.step()."
            )

    def _check_graph(self, loss: torch.Tensor) -> None:
        """Refused before the first of the two passes:

        * torch.compile's backward (a ``CompiledFunctionBackward`` node): the passes run backward twice through a
          retained graph, and it does not give the same gradients twice there: inductor reuses its saved buffers,
          and the second pass (the update) got other gradients, silently (torch's own check fires only in some
          graphs).
        * A reentrant checkpoint region (``CheckpointFunctionBackward``) that may hold this optimizer's parameters.
          Where the measuring pass (``backward(inputs=own)``) must go through it, torch refuses; where nothing of
          this optimizer's lies behind it in the outer graph (a frozen embedding before it whose output was made to
          require grad: PEFT's LoRA recipe, ``enable_input_require_grads``), the pass leaves it out, and the
          parameters inside went unmeasured: the clip's norm missed them, a scaler missed their infs (found by an
          adversarial pass). A region whose function belongs to a module holding none of them (frozen) runs."""
        # the nodes seen, held: torch 2.4 makes a new Python object for a node at each access, and one freed gave
        # its id to the next (this walk ended there after two nodes of a small model, and neither check fired)
        seen: dict[int, Any] = {}
        stack = [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen[id(node)] = node
            if type(node).__name__ == "CheckpointFunctionBackward" and self._may_hold_own(node):
                self._close_step()
                raise OptimizerInBackwardError(_REENTRANT)
            if type(node).__name__.startswith("CompiledFunction"):
                self._close_step()
                raise OptimizerInBackwardError(
                    "OptimizerInBackward.backward: clip_grad_norm= and scaler= run backward twice through the "
                    "retained graph (a pass that measures every gradient, then the one that updates), but the graph "
                    "runs torch.compile'd code, whose backward does not give the same gradients a second time "
                    "(inductor reuses the buffers it saved). Expected an eager graph; found a compiled one. To fix: "
                    "leave clip_grad_norm= and scaler= out (one pass), or clip with torch.nn.utils.clip_grad_norm_ "
                    "after loss.backward() and a plain optimizer.step()."
                )
            stack.extend(fn for fn, _ in node.next_functions)

    def _may_hold_own(self, node: Any) -> bool:
        """Whether the function a reentrant checkpoint region runs (``ctx.run_function``) may use this optimizer's
        trainable parameters: True unless it is a module's (a bound method or partial of one, as HF's layers pass)
        holding none of them."""
        fn = getattr(node, "run_function", None)
        while isinstance(fn, functools.partial):
            fn = fn.func
        module = getattr(fn, "__self__", fn)
        if not isinstance(module, torch.nn.Module):
            return True
        return any(p.requires_grad and id(p) in self._by_id for p in module.parameters())

    def _check_clip_covers_the_model(self) -> None:
        """``clip_grad_norm_(model.parameters())`` measures every gradient of the model; this wrapper measures (and
        scales) its own optimizer's only."""
        model = self._model() if self._model is not None else None
        if self.clip_grad_norm is None or model is None:
            return
        outside = [p for p in model.parameters() if p.requires_grad and id(p) not in self._by_id]
        if outside:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.backward: clip_grad_norm= clips as clip_grad_norm_(model.parameters()) does, but "
                f"{len(outside)} parameter(s) of the model (the first of shape {tuple(outside[0].shape)}) require grad "
                "and are not in this optimizer: their gradients would count in that norm and be scaled by it, and "
                "this wrapper cannot. Set requires_grad_(False) on parameters nobody trains, put every trained "
                "parameter in this one optimizer (param groups for their settings), or build the wrapper without "
                "model= (it then clips its own parameters only, as clip_grad_norm_(opt.param_groups' params))."
            )
        held = [p for p in model.parameters() if p.grad is not None and id(p) not in self._by_id]
        if held:  # a frozen parameter's old gradient: the usual clip counts it and scales it at every step
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.backward: clip_grad_norm= clips as clip_grad_norm_(model.parameters()) does, but "
                f"{len(held)} parameter(s) of the model outside this optimizer (the first of shape "
                f"{tuple(held[0].shape)}) still hold a .grad (left from before they were frozen): that norm counts it "
                "and scales it, and this wrapper cannot. Set their .grad to None (model.zero_grad() before building "
                "the wrapper), or build the wrapper without model=."
            )

    def remove(self) -> None:
        """Remove memtrim's hooks: the wrapped optimizer then works as usual (``step()`` applies ``.grad``)."""
        _remove_handles(self._handles)
        self._hooked.clear()
        self._hook_ids.clear()
        self._removed = True
        self._open = False
        for param in self._by_id.values():
            owner = _OWNERS.get(param)
            if owner is not None and owner() is self:
                del _OWNERS[param]
                _OWNERSHIP[0] += 1

    def register_step_pre_hook(self, hook: Callable) -> Any:
        """Run ``hook(opt, args, kwargs)`` once per step, before its first update (inside backward when the step
        is fused: gradients of later buckets do not exist yet; use clip_grad_norm=/clip_grad_value= for gradient
        work). Hooks registered on the wrapped optimizer run at the same moment, with that optimizer."""
        return super().register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable) -> Any:
        """Run ``hook(opt, args, kwargs)`` once per step, at the end of ``step()`` (every update done)."""
        return super().register_step_post_hook(hook)

    # ------------------------------------------------------------------ hooks
    def _ddp_hook(self, bucket: Any) -> torch.futures.Future:
        """DDP's all-reduce, unchanged; it also queues our step after DDP's own end-of-backward work.

        DDP keeps every gradient in its buckets, so stepping early would save no memory, and stepping in the
        future's callback would race DDP's reducer on another thread. DDP queues its finalisation (which waits
        for the all-reduces and writes the averaged gradients) when its last bucket is ready, after this hook
        ran; so the callback queued here queues the step once more, behind DDP's finalisation, still on the
        autograd thread.
        """
        if self._open and not self._accumulating and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_ddp_backward)
        return _allreduce_as_ddp(self._ddp().process_group, bucket)

    def _end_of_ddp_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp_finalize)

    def _after_ddp_finalize(self) -> None:
        self._callback_queued = False
        self._finish_deferred()

    def _on_param_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete (accumulated; reduce-scattered under FSDP2)."""
        grad = param.grad
        if grad is None or self._removed:
            return
        key = id(param)
        if key in self._zero_pending and self._pass != "measure":
            self._zero_pending.discard(key)
            if not grad.is_sparse:  # sparse: 0 + g concatenates g's entries to none, g itself
                with torch.no_grad():
                    grad.add_(0.0)  # the standard loop accumulated into a zero gradient: 0 + g (-0.0 becomes 0.0)
        if self._open and self._accumulating and key in self._stepped:
            self._close_step()  # reported once: the next zero_grad() starts clean
            raise OptimizerInBackwardError(
                "OptimizerInBackward.accumulate: expected accumulate() around the earlier backward passes of a "
                f"step, but a backward inside it reached a parameter of shape {tuple(param.shape)} that an earlier "
                "backward of this step had already updated (the standard loop would add this gradient to that "
                "update; here it would be silently dropped). Run every backward of the step but the last inside "
                "`with opt.accumulate():` and the last one outside it, or use torch.autograd.grad for a probe."
            )
        if not self._open or self._accumulating:
            return  # outside an open step: accumulate, as the standard loop does
        if torch.is_grad_enabled():  # (a backward runs with grad on exactly when create_graph=True)
            self._close_step()
            raise OptimizerInBackwardError(
                "OptimizerInBackward: expected gradients without a graph of their own, but the gradient of a "
                f"parameter of shape {tuple(param.shape)} has one: a backward with create_graph=True. The standard "
                "loop keeps such gradients in .grad for a penalty on them or a backward through them, and steps at "
                "opt.step(); here the update would run in this backward, before those, and .grad would be None. To "
                "fix: run that backward inside `with opt.accumulate():` (the update then runs at opt.step(), from "
                "what .grad holds by then), or take the gradients you penalise with torch.autograd.grad(..., "
                "create_graph=True)."
            )
        self._check_thread(param)
        if key in self._stepped:
            self._raise_second_gradient(param)
        if self._two_passes and self._pass is None and not self._deferred:
            self._close_step()
            other = getattr(_TWO_PASSES, "wrapper", None)
            if other is not None and other is not self:
                raise OptimizerInBackwardError(
                    "OptimizerInBackward: expected one wrapper with clip_grad_norm= or a GradScaler per backward, but "
                    "another wrapper's opt.backward(loss) reached parameters of this one, which also needs every "
                    "gradient first. Two wrappers cannot measure one global norm (the standard loop's "
                    "clip_grad_norm_(model.parameters()) over both optimizers' parameters). Put the parameters in "
                    "one optimizer (param groups for their settings) and one wrapper, or clip by value "
                    "(clip_grad_value=), or train without OptimizerInBackward. If that backward is another model's "
                    "loss reaching these parameters while this wrapper's step is open (a GAN's discriminator loss "
                    "through a fake not detached, after the generator's opt.zero_grad()), detach the fake, open this "
                    "step after that backward, or run it inside this wrapper's `with opt.accumulate():`."
                )
            raise OptimizerInBackwardError(
                "OptimizerInBackward: clip_grad_norm and a GradScaler need every gradient before any "
                "update; call opt.backward(loss) instead of loss.backward()."
            )
        where = self._where.get(key)
        if where is None:
            return  # not optimized by this optimizer
        self._this_backward()  # (syncs the groups: one taken out of them since zero_grad() is no longer this one's;
        where = self._where.get(key)  # its stale bucket raised a KeyError until 2026-12-03, an adversarial pass)
        if where is None:
            return
        late = self._hook_followed(param)  # a user's hook still to run edits .grad: wait for the end of backward
        if self._pass == "measure":
            if late:
                self._late_measure.append(param)
                return
            self._measure(param)
            self._free([param])  # the standard loop still holds it; the updating pass makes it again
            self._measured += 1
            return
        bucket, index = where
        bucket.ready.add(index)
        if late and not any(bucket is b for b in self._late):
            self._late.append(bucket)
        if not self._deferred and len(bucket.ready) >= bucket.expected:
            self._bucket_complete(bucket)

    def _raise_second_gradient(self, param: torch.Tensor) -> NoReturn:
        """A gradient for ``param`` after its update in this open step: the standard loop would add the two."""
        nested = self._token is not None and self._token() is not None  # the updating backward still runs
        self._close_step()  # reported once: the next zero_grad() starts clean
        if nested:
            raise OptimizerInBackwardError(
                "OptimizerInBackward: expected each parameter's gradient once per backward pass, but a backward "
                "nested inside the running one (reentrant torch.utils.checkpoint, use_reentrant=True, or an "
                "autograd.Function whose backward calls backward) sent a second gradient for a parameter of "
                f"shape {tuple(param.shape)} that the outer pass had already completed and updated: a weight "
                "used both inside and outside the checkpointed segment. The standard loop would have added "
                "the two. Use non-reentrant checkpointing: torch.utils.checkpoint.checkpoint(..., "
                "use_reentrant=False) (or memtrim's checkpointing)."
            )
        raise OptimizerInBackwardError(
            "OptimizerInBackward: expected one backward pass per training step to reach each parameter, but "
            f"a second backward in this step reached a parameter of shape {tuple(param.shape)} that was "
            "already updated inside the first one (the standard loop would have added the two gradients). "
            "Run the earlier backward passes (micro-batches, a first loss on a retained graph, an "
            "adversarial attack's input gradient) inside `with opt.accumulate():`, or call opt.step() and "
            "opt.zero_grad() between training steps."
        )

    def _bucket_complete(self, bucket: _Bucket) -> None:
        if any(bucket is held for held in (*self._held, *self._held_to_step, *self._late)):
            return
        if not self._may_step_now(bucket):
            self._held.append(bucket)  # its temporaries would lift this moment above the standard loop's peak
            return
        self._step_bucket(bucket)
        for held in list(self._held):  # what it freed (and what backward freed meanwhile) may cover one held
            if self._may_step_now(held):
                self._held.remove(held)
                self._step_bucket(held)

    def _may_step_now(self, bucket: _Bucket) -> bool:
        """Whether updating ``bucket`` now keeps memory at or below the standard loop's peak (see the NOTE)."""
        now = _memory_now(bucket.params[0].device)
        if now is None:
            return True  # memory cannot be seen here (CPU without a memtrim tracker): as soon as complete
        # the standard loop holds, at this moment, every gradient freed so far too; and later all of them
        if self._ceiling is None:
            self._ceiling = self._standard_floor()
        self._ceiling = max(self._ceiling, now + self._freed_bytes)
        over = now + _TEMPORARIES_PER_BYTE * bucket.nbytes - self._ceiling
        if over <= 0:
            return True
        return self.peak == "lowest"

    def _this_backward(self) -> None:
        """Queue the end-of-backward callback once per backward pass (and notice passes killed by exceptions)."""
        if self._token is not None and self._token() is not None:
            return
        _check_not_distributed(self.optimizer, self._two_passes)  # a process group started after this wrapper was built
        outcome = _Outcome()
        token = _EndOfBackward(self._self_ref, outcome)
        weakref.finalize(token, _backward_gone, self._self_ref, outcome)
        self._outcome = outcome
        self._token = weakref.ref(token)
        self._freed_bytes = 0
        self._ceiling = None
        torch.autograd.Variable._execution_engine.queue_callback(token)
        self._sync_groups()
        if self._ddp is None and any(p.requires_grad and id(p) not in self._hooked for p in self._by_id.values()):
            # unfrozen between zero_grad() and this backward: hooked now, so that a gradient still to come in this
            # pass is updated and freed in it too (one that already arrived waits for step(), as before)
            self._hook_new_params()
            for bucket in self._buckets:
                bucket.expected = sum(1 for p in bucket.params if p.requires_grad and id(p) in self._hooked)

    def _end_of_backward(self) -> None:
        self._token = None
        held, self._held = self._held, []
        self._late = []  # their buckets have ready parameters: stepped below
        late_measure, self._late_measure = self._late_measure, []
        for param in late_measure:
            if param.grad is not None:
                self._measure(param)
                self._free([param])
                self._measured += 1
        if self._pass == "measure" or self._deferred:
            return
        for bucket in held:
            if self._two_passes or self._may_step_now(bucket):
                self._step_bucket(bucket)
            else:  # even now (what backward leaves until it returns): at step(), as the standard loop would
                self._held_to_step.append(bucket)
        for bucket in self._buckets:
            if bucket.ready and not any(bucket is held for held in self._held_to_step):
                self._step_bucket(bucket)
        self._refresh_versions()

    def _refresh_versions(self) -> None:
        """Parameters that share a version counter (views of one flat buffer) each saw the later updates of the
        others: what step() compares with is the version once backward's updates are all done."""
        for key, (param, _) in self._versions.items():
            self._versions[key] = (param, param._version)
        if not _steps_per_parameter(self.optimizer):  # its state tensors may share a flat buffer too
            for key, (param, _) in self._state_marks.items():
                self._state_marks[key] = (param, _state_mark(self.optimizer, param))

    def _backward_aborted(self, outcome: _Outcome) -> None:
        """A backward pass raised: its partial gradients stay in ``.grad`` (as in the standard loop)."""
        self._token = None
        self._held = []
        self._held_to_step = []
        self._late = []
        self._late_measure = []
        for bucket in self._buckets:
            bucket.ready.clear()
        if outcome.updated:
            self._pending_error = (
                f"expected the backward pass to finish, but the last one raised an exception after {outcome.updated} "
                "parameter(s) had already been updated inside it; the standard loop, which skips that batch, would "
                "not have updated any, so training is no longer equal to it. Fix what raised; if a backward may "
                "fail (skipping out-of-memory batches), train without OptimizerInBackward. This error is reported "
                "once; training can go on from here."
            )

    def _note_lost(self, error: BaseException) -> None:
        """A two-pass ``backward`` raised. The standard loop's single pass would have stopped where the measuring
        pass stopped, its partial gradients left in ``.grad`` for a ``step()`` to apply (clipped by their own norm);
        the measuring pass freed the ones it measured, and the updating pass, where it raised, never ran in the
        standard loop at all. Skipping the batch (``zero_grad()``) is what both loops then do alike; ``step()``
        raises (:meth:`step`)."""
        if self._pass == "update":
            self._lost = (f"the updating pass of opt.backward(loss) raised ({type(error).__name__}: {error}) after the "
                          "measuring pass had finished, where the standard loop's single backward did not raise")
        elif self._measured:
            self._lost = (f"opt.backward(loss) raised ({type(error).__name__}: {error}) in its measuring pass, after "
                          f"{self._measured} gradient(s) had been measured and freed (the updating pass makes them "
                          "again); the standard loop keeps such partial gradients in .grad and its step() applies "
                          "them")

    def _raise_lost(self, where: str) -> None:
        lost, self._lost = self._lost, None
        if lost is not None:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.{where}: expected the step's backward to have finished, but {lost}. This step "
                "cannot be applied as the standard loop would. To fix: skip the batch after a failed backward "
                "(call opt.zero_grad() before the next backward, without step()), as for an out-of-memory batch; "
                "or train without clip_grad_norm=/scaler= (one pass). This error is reported once."
            )

    def _raise_pending(self, where: str) -> None:
        message, self._pending_error = self._pending_error, None
        if message is not None:
            self._close_step()
            raise OptimizerInBackwardError(f"OptimizerInBackward.{where}: {message}")

    def _check_thread(self, param: torch.Tensor) -> None:
        # CPU backward runs on the thread that called it (CUDA's on the engine's device threads: not checked)
        if self._thread is not None and threading.get_ident() != self._thread and param.device.type == "cpu":
            raise OptimizerInBackwardError(
                "OptimizerInBackward: expected backward passes of an open step on the thread that opened it "
                "with zero_grad(), but one ran on another thread. One wrapper cannot serve two threads at once "
                "(their gradients would mix); give each thread its own model and wrapper."
            )

    def _refuse_copy(self, where: str) -> None:
        """A copy of this wrapper made without ``copy`` (which ``__getstate__`` refuses): Lightning's
        ``LightningOptimizer`` and Fabric's ``fabric.setup(model, opt)`` build a new object of a subclass of the
        wrapper's class that reads the wrapper's attributes (through ``__getattr__`` in Lightning 2.6; a copy of its
        ``__dict__`` in earlier ones). It cannot work: the hooks in backward update the wrapper it was made from,
        whose state the copy does not share. It was refused as "another open OptimizerInBackward", or trained as the
        standard loop with nothing updated inside backward, saving no memory (found by an adversarial pass)."""
        origin = self._self_ref()
        if origin is self:
            return
        raise OptimizerInBackwardError(
            f"OptimizerInBackward.{where}: called on a copy of the wrapper ({type(self).__name__}), not on the "
            "OptimizerInBackward that was built: its hooks inside backward update the original, whose state the copy "
            "does not share. Lightning's LightningOptimizer and Fabric's setup(model, optimizer) make such a copy. "
            f"Call the wrapper you built: in a LightningModule with manual optimization, {_LIGHTNING_WAY_OUT}; with "
            "Fabric, fabric.setup_module(model) and the wrapper as it is."
        )

    def _claim_params(self) -> None:
        if self._claimed[0] == _OWNERSHIP[0] and self._claimed[1] is self._signature:
            return  # every parameter is still this wrapper's: no other wrapper claimed one since, nor did the groups
        for param in self._by_id.values():
            owner = _OWNERS.get(param)
            other = owner() if owner is not None else None
            if (other is not None and other is not self and other._open and not other._removed
                    and any(p is param for group in other.optimizer.param_groups for p in group["params"])):
                # (one that no longer lists it lets it go: a parameter moved from its optimizer to this one with
                # add_param_group, both wrappers open, was refused until 2026-12-03, by an adversarial pass)
                raise OptimizerInBackwardError(
                    f"OptimizerInBackward.zero_grad: expected one wrapper per parameter, but a parameter of shape "
                    f"{tuple(param.shape)} is also in another open OptimizerInBackward, and both would update it. "
                    "Call old_opt.remove() (or drop every reference to it) before building a new wrapper."
                )
            if owner is not self._self_ref:
                _OWNERS[param] = self._self_ref
                _OWNERSHIP[0] += 1
        self._claimed = (_OWNERSHIP[0], self._signature)

    def _run_pre_hooks(self) -> None:
        if self._pre_hooks_ran:
            return
        self._pre_hooks_ran = True
        for hook in tuple(self.optimizer._optimizer_step_pre_hooks.values()):
            hook(self.optimizer, (), {})
        for hook in tuple(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})

    # ------------------------------------------------------------------ stepping
    def _step_bucket(self, bucket: _Bucket) -> None:
        params = [bucket.params[i] for i in sorted(bucket.ready)]
        bucket.ready.clear()
        with unwatched():  # (also from the end-of-backward callback)
            self._step(params, in_backward=True)

    def _step(self, params: list[torch.Tensor], in_backward: bool) -> None:
        """Update ``params`` (their gradients are complete) with the wrapped optimizer.

        Inside backward the gradients are freed afterwards; in ``step()`` they stay, as in the standard loop.
        """
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        if self.scaler is not None:
            for param in params:  # GradScaler.unscale_ coalesces a float16 sparse gradient before unscaling it
                grad = param.grad
                if grad is not None and grad.is_sparse and grad.dtype is torch.float16:
                    param.grad = grad.coalesce()
        self._run_pre_hooks()
        grads = cast(list[torch.Tensor], [p.grad for p in params])  # filtered above
        if in_backward:
            measure_hooks.note_gradients(grads)
        if self._coefficient is not None or self.clip_grad_value is not None or (
            in_backward and self.scaler is not None
        ):
            with torch.no_grad():
                if in_backward and self.scaler is not None:
                    self._unscale(grads)
                if self._coefficient is not None:
                    for grad in grads:
                        grad.mul_(self._coefficient.to(grad.device))
                if self.clip_grad_value is not None:
                    for grad in grads:
                        grad.clamp_(min=-self.clip_grad_value, max=self.clip_grad_value)
        saved = self.optimizer.param_groups
        narrowed = [{**g, "params": []} for g in saved]
        for param in sorted(params, key=lambda p: self._position[id(p)]):  # the optimizer's own order
            narrowed[self._where[id(param)][0].group]["params"].append(param)
        watched = self._watch(params)
        before = self._before_update(params) if in_backward else None
        states = len(self.optimizer.state)
        self.optimizer.param_groups = narrowed
        try:
            self._raw_step(self.optimizer)
        finally:
            self.optimizer.param_groups = saved
        made = len(self.optimizer.state) - states
        if made > 0:  # the states this update made, last in the state (_order_new_states)
            self._made += [key for key in list(self.optimizer.state)[-made:] if isinstance(key, torch.Tensor)]
        self._settle(watched, narrowed, in_backward)
        for param in params:
            self._stepped.add(id(param))
        if in_backward:
            for param in params:
                self._versions[id(param)] = (param, param._version)
                mark = _state_mark(self.optimizer, param)
                self._state_marks[id(param)] = (param, mark)
                if before is not None:  # the keys this update wrote, and those earlier ones wrote
                    self._learn_own_keys(param, mark, *before)
            self._updated_in_backward += len(params)
            if self._outcome is not None:
                self._outcome.updated += len(params)
            for param in params:
                grad = cast(torch.Tensor, param.grad)
                if grad.is_sparse:  # a zero gradient kept for it later (set_to_none=False) is sparse too
                    self._sparse_layout[id(param)] = (grad.sparse_dim(), grad.dense_dim())
                self._freed_bytes += grad.numel() * grad.element_size()
                self._freed.add(id(param))
                param.grad = None

    def _before_update(self, params: list[torch.Tensor]) -> tuple[dict[int, Any], dict[int, Any]] | None:
        """For torch's and memtrim's optimizers, each parameter's state before an update inside backward: its mark
        where the keys its updates write are not known yet for the state as it stands (its first update, or a state
        loaded or reset since), else its keys alone (an update may add some: momentum set since, SGD's
        ``momentum_buffer``). NOTE [ keys a loop logs ]"""
        if not _steps_per_parameter(self.optimizer):
            return None
        state, own = self.optimizer.state, self._own_keys
        marks: dict[int, Any] = {}
        others: dict[int, Any] = {}
        for param in params:
            now, known = state.get(param), own.get(id(param))
            if known is not None and known[0] == id(now):  # the keys not known as its own, with their entries
                others[id(param)] = {key: _entry(v) for key, v in now.items() if key not in known[1]} if now else {}
            else:
                marks[id(param)] = _state_mark(self.optimizer, param)
        return marks, others

    def _learn_own_keys(self, param: torch.Tensor, after: tuple[Any, ...], marks: dict[int, Any],
                        others: dict[int, Any]) -> None:
        """The state keys ``param``'s updates write, from this update's mark before it, or its entries of keys not
        known as its own (``after``: its mark after it): those it added or changed, and those earlier updates wrote.
        A key an update starts writing later (amsgrad's ``max_exp_avg_sq`` once amsgrad is set, SGD's
        ``momentum_buffer`` once momentum is raised from 0) was accepted changed between backward and step() while a
        first update's keys alone counted, until 2026-12-03 (adversarial passes). NOTE [ keys a loop logs ]"""
        key = id(param)
        if key in marks:
            before = marks[key]
            earlier = dict(zip(before[4], before[3])) if before[1] is after[1] else {}
            learned = frozenset(name for name, entry in zip(after[4], after[3]) if earlier.get(name, _MISSING) != entry)
        else:
            own, other = self._own_keys[key][1], others[key]
            if not other and len(after[4]) == len(own):
                return  # its own keys alone, before and after: nothing to learn (the common case)
            learned = own.union(name for name, entry in zip(after[4], after[3])
                                if name not in own and other.get(name, _MISSING) != entry)
        self._own_keys[key] = (id(after[1]), learned)

    def _watch(self, params: list[torch.Tensor]) -> _Watched | None:
        """What a call of the wrapped optimizer's step may change besides its parameters' own state, read before it,
        for a class outside torch.optim and memtrim (None for those, which change none of it): the groups' entries
        (tensors by version, generators by state), its own numbers and generators, the global generators and, in its
        first two steps, the parameters outside the bucket (every parameter at every bucket is quadratic in their
        number; an optimizer that writes outside its bucket does so from its first step)."""
        if _steps_per_parameter(self.optimizer):  # torch's and memtrim's change none of it (the per-bucket path)
            return None
        watched = _Watched()
        watched.groups = [{k: _Snapshot(v) if isinstance(v, (torch.Tensor, torch.Generator)) else v
                           for k, v in g.items()} for g in self.optimizer.param_groups]
        chosen = {id(p) for p in params}
        watched.others = ([(p, p._version) for p in self._by_id.values() if id(p) not in chosen]
                          if self._steps_closed < 2 else [])
        watched.own = _own_state(self.optimizer)
        return watched

    def _settle(self, watched: _Watched | None, narrowed: list[dict[str, Any]], in_backward: bool) -> None:
        """After a call of the wrapped optimizer's step: write back the group entries it changed in the narrowed
        copies, and refuse what stepping bucket by bucket would advance more often than the standard step does."""
        self._inner_steps += 1
        if watched is None:  # torch's or memtrim's optimizer: its update of a parameter reads that parameter's state
            if in_backward:
                for g, used in enumerate(narrowed):
                    if used["params"]:
                        self._use_hyper(g, self.optimizer.param_groups[g])
            return
        per_group: list[str] = []  # entries of the groups this call stepped: fine once per group and step
        whole: list[str] = []  # state of the whole optimizer: fine once per training step
        # a tensor or generator held by several groups (one generator for all of them) is the whole optimizer's
        holders: collections.Counter = collections.Counter(
            id(v) for g in self.optimizer.param_groups for v in g.values() if isinstance(v, (torch.Tensor,
                                                                                            torch.Generator)))
        for g, (group, used, before) in enumerate(zip(self.optimizer.param_groups, narrowed, watched.groups)):
            # changed in the narrowed copy (written back to the group) or in the group itself (timm's Lookahead
            # counts in its base optimizer's groups), each compared with what it held: no write-back undoes the other
            direct = _changed_entries(before, group)
            written = _changed_entries(before, used) if used["params"] else []
            group.update((k, used[k]) for k in written if k in used)
            if used["params"]:
                self._group_calls[g] = self._group_calls.get(g, 0) + 1
                mine = {*direct, *written}
                shared = {k for k in mine if holders[id(group.get(k))] > 1}
                whole += [f"param_groups[{g}][{k!r}] (held by several groups)" for k in shared]
                if self._group_buckets[g] > 1 or self._group_calls[g] > 1:
                    per_group += [f"param_groups[{g}][{k!r}]" for k in mine - shared]
                if in_backward:
                    self._use_hyper(g, group)
            else:  # a group this call was not given, changed (timm's Adan counts every group at every call)
                whole += [f"param_groups[{g}][{k!r}] (a group it was not given)"
                          for k in {*direct, *_changed_entries(before, used)}]
        touched = sum(1 for p, version in watched.others if p._version != version)
        if touched:
            raise OptimizerInBackwardError(
                f"memtrim.OptimizerInBackward: {type(self.optimizer).__name__}.step() changed {touched} "
                "parameter(s) outside the bucket it was given (a wrapper that steps another optimizer's "
                "param_groups, such as timm's Lookahead, or a step that writes other parameters). Expected a "
                "step that updates only self.param_groups. Training is no longer the standard loop's: use "
                "loss.backward(); opt.step() with this optimizer."
            )
        whole += [name if name.startswith("the ") else f"its attribute {name!r}"
                  for name, value in _own_state(self.optimizer).items() if watched.own.get(name) != value]
        self._whole_calls += bool(whole)
        # several calls in a step read the whole optimizer's state in another order than the standard step's one
        # call: refused where it changes twice in a step, or in any step after the first (a flag set up once at the
        # first step, bitsandbytes' `initialized`, changes there only; a counter or a draw per step changes again)
        several = len(self._buckets) > 1 or self._inner_steps > 1
        if self._whole_calls > 1 or (whole and several and self._steps_closed > 0):
            raise OptimizerInBackwardError(
                f"memtrim.OptimizerInBackward: {type(self.optimizer).__name__}.step() changed "
                f"{', '.join(sorted(set(whole)))}: state of the whole optimizer (a counter, a random generator), "
                "which stepping bucket by bucket advances once per call, or reads in another order, where the "
                "standard loop advances it once per step before every group reads it. Expected an optimizer whose "
                "update of a parameter depends only on its gradient and state. "
                "Use one param group and one bucket (bucket_bytes larger than the parameters' bytes, no "
                "accumulate()), or loss.backward(); opt.step()."
            )
        if per_group:
            largest = max(sum(p.numel() * p.element_size() for p in g["params"]) for g in self.optimizer.param_groups)
            raise OptimizerInBackwardError(
                f"memtrim.OptimizerInBackward: {type(self.optimizer).__name__}.step() changed "
                f"{', '.join(sorted(set(per_group)))}: state of a param group (a step counter), which stepping a "
                "group in several buckets, or again after accumulate(), advances once per call where the standard "
                "loop advances it once per step. Expected an optimizer whose update of a parameter depends only on "
                f"its gradient and state. Use one bucket per group (bucket_bytes={largest} or more, the largest "
                "group's bytes; no accumulate()), or loss.backward(); opt.step()."
            )

    def _use_hyper(self, g: int, group: dict[str, Any]) -> None:
        """Remember the hyperparameters group ``g``'s first update inside backward used in this step: a later update
        of the group (a second backward before step()) records its own only where they differ, so step() sees the
        change (an lr set between two backwards of one step trained the first tower with the old one, silently, until
        2026-12-03: an adversarial pass)."""
        now = _hyperparameters(group, self._read_keys())
        first = self._used_hyper.setdefault(g, now)
        if first is not now and _hyper_changes(first, now, g):
            self._hyper_between.setdefault(g, now)

    def _read_keys(self) -> Any:
        """The group keys the wrapped optimizer's step reads: its ``defaults``' for torch's and memtrim's, else every
        key (None). NOTE [ keys a loop logs ]"""
        return self.optimizer.defaults if _steps_per_parameter(self.optimizer) else None

    def _check_unchanged(self) -> None:
        """At ``step()``: what the updates inside backward used must be what the standard ``step()`` would use."""
        changed = []
        for g, used in self._used_hyper.items():
            if g >= len(self.optimizer.param_groups):
                continue
            between = self._hyper_between.get(g)
            earlier = _hyper_changes(used, between, g) if between is not None else []
            # (a later backward of the step updated the group with other values)
            changed += [f"{change} (between two backward passes of the step)" for change in earlier]
            now = _hyperparameters(self.optimizer.param_groups[g], self._read_keys())
            changed += [change for change in _hyper_changes(used, now, g) if change not in earlier]
        if changed:
            self._close_step()
            raise OptimizerInBackwardError(
                "OptimizerInBackward.step: expected the hyperparameters to stay what the update inside backward "
                f"used, but between backward and step() {'; '.join(changed[:4])}{' ...' if len(changed) > 4 else ''}"
                ". The standard loop's step() would use the new values; memtrim already updated these "
                "parameters with the old ones. Set hyperparameters before loss.backward() (e.g. right after "
                "opt.zero_grad()), and call sched.step() after opt.step(), as torch's LR schedulers expect."
            )
        known = _steps_per_parameter(self.optimizer)
        moved = [param for param, mark in self._state_marks.values()
                 if not _same_state(mark, _state_mark(self.optimizer, param),
                                    self._own_keys.get(id(param), (None, None))[1] if known else None)]
        if moved:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: expected the optimizer's state to stay as the update inside backward left "
                f"it until step(), but the state of {len(moved)} parameter(s) (the first of shape "
                f"{tuple(moved[0].shape)}) changed after their update (opt.state cleared or edited, "
                "load_state_dict, a moment zeroed in place). The standard loop's step() would update them with the "
                "changed state; memtrim already updated them with the old one. Change the optimizer's state before "
                "loss.backward() (e.g. right after opt.zero_grad()) or after opt.step()."
            )
        modified = [param for param, version in self._versions.values() if param._version != version]
        if modified:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: expected the parameters to stay as the update inside backward left "
                f"them until step(), but {len(modified)} parameter(s) (the first of shape "
                f"{tuple(modified[0].shape)}) were written in place after their update (manual weight decay "
                "p.mul_(...), p.copy_(...), a clamp or projection). The standard loop's step() would update the "
                "modified values; memtrim updated them before the write. Do such writes before loss.backward() or "
                "after opt.step(); for weight decay use the optimizer's weight_decay (AdamW: decoupled)."
            )

    def _apply_waiting(self, waiting: list[torch.Tensor], driven: bool) -> None:
        """``step()``'s own updates: the standard step over the gradients still waiting."""
        zeros = [p for p in waiting if p.grad is None]  # zero_grad(set_to_none=False) kept a zero gradient
        if self._skipped:  # a GradScaler skipped this step inside backward: scaler.step(opt) updates nothing
            self._stepped.update(id(p) for p in waiting)
            self._free(zeros)
            return
        for param in zeros:
            param.grad = _zero_gradient(param, self._sparse_layout.get(id(param)))
            self._zero_pending.discard(id(param))
        grads = cast(list[torch.Tensor], [p.grad for p in waiting])
        if driven:  # GradScaler.step(self): it checked the waiting gradients for infs; we unscale them
            found = self.__dict__["found_inf"]
            if bool(found):
                self._raise_late_inf(len(waiting))
                self._skipped = True
                self._stepped.update(id(p) for p in waiting)
                self._free(zeros)
                return
            grad_scale = self.__dict__.get("grad_scale")
            if grad_scale is not None:
                inv_scale = grad_scale.double().reciprocal().float()
                with torch.no_grad():  # (a sparse gradient's values, as GradScaler.unscale_ unscales them)
                    values = [g._values() if g.is_sparse else g for g in grads]
                    for (device, _), tensors in _by_device_and_dtype(values).items():
                        dummy = torch.zeros(1, device=device)
                        torch._amp_foreach_non_finite_check_and_unscale_(tensors, dummy, inv_scale.to(device))
        elif self.scaler is not None:  # opt.step() called directly: unscale and check here
            self._unscale(grads, record=True)
            if self._skip_update():
                self._raise_late_inf(len(waiting))
                self._stepped.update(id(p) for p in waiting)
                self._free(zeros)
                return
        # (after updates inside backward only zero gradients wait, which add nothing to the norm it measured)
        if self.clip_grad_norm is not None and not self._updated_in_backward:
            for param in waiting:
                self._measure(param, unscale=False)
            self._conclude_measure()
            self._norms.clear()
        try:
            self._step(waiting, in_backward=False)
        finally:
            self._coefficient = None
        self._free(zeros)

    def _raise_late_inf(self, count: int) -> None:
        """An inf or NaN in gradients ``step()`` applies, after updates inside backward: the standard loop's scaler
        skips the whole step, these updates included."""
        updated = self._updated_in_backward
        if updated:
            self._close_step()
            raise OptimizerInBackwardError(
                f"OptimizerInBackward.step: the GradScaler found an inf or NaN in the {count} gradient(s) that arrived "
                "after the update inside backward (a backward inside accumulate() after opt.backward, a .grad written "
                f"by hand); the standard loop would skip the whole step, but {updated} parameter(s) were already "
                "updated. Produce all of a step's gradients before its opt.backward (earlier backward passes inside "
                "accumulate()), or add the losses."
            )

    def _free(self, params: list[torch.Tensor]) -> None:
        for param in params:
            param.grad = None
            self._freed.add(id(param))

    def _finish_deferred(self) -> None:
        """Step every waiting gradient of the open step at once (DDP; or accumulated gradients + two passes)."""
        for bucket in self._buckets:
            for index, param in enumerate(bucket.params):
                if param.grad is not None and id(param) not in self._stepped:
                    bucket.ready.add(index)
        if self._two_passes:
            for bucket in self._buckets:
                for index in bucket.ready:
                    self._measure(bucket.params[index])
            self._conclude_measure()
            self._norms.clear()
            if self._skip_update():
                for bucket in self._buckets:
                    self._free([bucket.params[index] for index in bucket.ready])
                    for index in bucket.ready:
                        self._stepped.add(id(bucket.params[index]))
                    bucket.ready.clear()
                return
        for bucket in self._buckets:
            if bucket.ready:
                self._step_bucket(bucket)
        self._refresh_versions()

    def _close_step(self) -> None:
        self._open = False
        self._steps_closed += self._inner_steps > 0
        self._inner_steps = 0
        self._whole_calls = 0
        self._group_calls.clear()
        self._stepped.clear()
        self._updated_in_backward = 0
        self._pre_hooks_ran = False
        self._coefficient = None
        self._scaler_found = None
        self._skipped = False
        self._lost = None
        self._found_inf.clear()  # a measuring pass that raised left what it found: not the next step's
        self._norms.clear()
        self._held = []
        self._held_to_step = []
        self._late = []
        self._late_measure = []
        self._used_hyper.clear()
        self._hyper_between.clear()
        self._made = []
        self._versions.clear()
        self._state_marks.clear()
        for bucket in self._buckets:
            bucket.ready.clear()

    def _standard_floor(self) -> int:
        """Bytes the standard loop surely holds at its step: parameters, optimizer state and every gradient."""
        total = 0
        for param in self._by_id.values():
            size = param.numel() * param.element_size()
            total += 2 * size if param.requires_grad else size
            for value in self.optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total

    def _hook_new_params(self) -> None:
        """Hook parameters that can receive gradients (frozen ones are hooked when unfrozen, at zero_grad)."""
        for param in self._by_id.values():
            if param.requires_grad and id(param) not in self._hooked:
                handle = param.register_post_accumulate_grad_hook(_param_hook(self._self_ref))
                self._handles.append(handle)
                self._hooked.add(id(param))
                self._hook_ids[id(param)] = handle.id

    def _hooks_last(self) -> None:
        """Move memtrim's post-accumulate-grad hook behind any the user registered since (they edit ``.grad``).

        autograd calls a parameter's hooks in the order of its hook dict (``PyDict_Next``: the plain dict order,
        which ``OrderedDict.move_to_end`` does not change), so the entry is popped and re-inserted. O(1) a
        parameter, and nothing at all for a parameter with memtrim's hook alone.
        """
        for key, hook_id in self._hook_ids.items():
            hooks = getattr(self._by_id.get(key), "_post_accumulate_grad_hooks", None)
            if hooks is not None and len(hooks) > 1 and hook_id in hooks and next(reversed(hooks)) != hook_id:
                hooks[hook_id] = hooks.pop(hook_id)

    def _hook_followed(self, param: torch.Tensor) -> bool:
        """Whether a user's hook registered after this step opened runs after memtrim's on ``param`` now (memtrim's
        own, such as a tracker's, only read the gradient and do not count)."""
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks is None or len(hooks) < 2:
            return False
        mine = self._hook_ids.get(id(param))
        for key in reversed(hooks):
            if key == mine:
                return False
            if not _memtrims_own(hooks[key]):
                return True
        return False

    # ------------------------------------------------------------------ global information
    def _has_waiting_grads(self) -> bool:
        return any(p.grad is not None and id(p) not in self._stepped for p in self._by_id.values())

    def _measure(self, param: torch.Tensor, unscale: bool = True) -> None:
        grad = param.grad
        assert grad is not None
        with torch.no_grad():
            if unscale and self.scaler is not None:
                grad = grad.clone()
                self._unscale([grad], record=True)
            if self.clip_grad_norm is not None:
                self._norms[id(param)] = _norm(grad)

    def _conclude_measure(self) -> None:
        if self.clip_grad_norm is None or self._found_any_inf():
            return
        for key in self._zero_pending:  # the standard loop holds a zero gradient there, which clip_grad_norm_ counts:
            param = self._by_id.get(key)  # a 0 in the vector it takes the norm of (its length sets the rounding)
            if key not in self._norms and param is not None and param.grad is None:
                self._norms[key] = param.new_zeros(())
        model = self._model() if self._model is not None else None
        ordered = model.parameters() if model is not None else (
            p for group in self.optimizer.param_groups for p in group["params"])
        order = [p for p in ordered if id(p) in self._norms]
        if not order:
            return
        # summed as clip_grad_norm_ sums them: grouped by device and dtype (torch's own grouping), in order within
        norms = [self._norms[id(order[i])] for _, (_, indices) in
                 _group_tensors_by_device_and_dtype([order], with_indices=True).items() for i in indices]
        device = order[0].device
        total = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in norms]), 2.0)
        self._coefficient = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)
        self.last_total_norm = total

    def _unscale(self, grads: list[torch.Tensor], record: bool = False) -> None:
        assert self.scaler is not None
        # a sparse gradient's values, as GradScaler.unscale_ unscales them (float16 ones coalesced first: _step)
        grads = [g._values() if g.is_sparse else g for g in grads]
        inv_scale = _scale_tensor(self.scaler).double().reciprocal().float()
        for (device, _), tensors in _by_device_and_dtype(grads).items():
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(device))
            if record:
                previous = self._found_inf.get(device)
                self._found_inf[device] = found if previous is None else previous + found

    def _found_any_inf(self) -> bool:
        return self.scaler is not None and any(bool(f.item()) for f in self._found_inf.values())

    def _skip_update(self) -> bool:
        """With a GradScaler: remember what was found (``step()`` tells the scaler), and whether to skip."""
        if self.scaler is None:
            return False
        device = _scale_tensor(self.scaler).device
        found = sum((f.to(device) for f in self._found_inf.values()), torch.zeros(1, device=device))
        self._found_inf.clear()
        self._scaler_found = found if self._scaler_found is None else self._scaler_found + found
        skip = bool(found.item())
        self._skipped = self._skipped or skip
        return skip

    def _groups_signature(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(map(id, group["params"])) for group in self.optimizer.param_groups)

    def _sync_groups(self) -> None:
        """Bucket and hook the parameters as ``param_groups`` lists them now: a group's list edited in place (a
        parameter appended to unfreeze it, which torch's optimizers allow) is seen at the next ``zero_grad()``,
        backward or ``step()``, as ``add_param_group`` is at once."""
        if self._removed or self._signature == self._groups_signature():
            return
        self._build_buckets()
        if self._ddp is None:
            self._hook_new_params()
        if self._open:
            self._claim_params()
            for bucket in self._buckets:
                bucket.expected = sum(1 for p in bucket.params if p.requires_grad and id(p) in self._hooked)

    def _build_buckets(self) -> None:
        self._signature = self._groups_signature()
        self._buckets.clear()
        self._where.clear()
        self._by_id.clear()
        for g, group in enumerate(self.optimizer.param_groups):
            current: list[torch.Tensor] = []
            size = 0
            for param in reversed(group["params"]):
                current.append(param)
                size += param.numel() * param.element_size()
                if size >= self.bucket_bytes:
                    self._buckets.append(_Bucket(g, current))
                    current, size = [], 0
            if current:
                self._buckets.append(_Bucket(g, current))
        self._position = {id(p): (g, i) for g, group in enumerate(self.optimizer.param_groups)
                          for i, p in enumerate(group["params"])}
        self._group_buckets = collections.Counter(bucket.group for bucket in self._buckets)
        for bucket in self._buckets:
            for index, param in enumerate(bucket.params):
                if id(param) in self._where:
                    raise InvalidInputError(
                        f"memtrim.OptimizerInBackward: a parameter (shape {tuple(param.shape)}) appears twice in the "
                        "optimizer's param_groups; give each parameter once (tied weights are one parameter: "
                        "model.parameters() lists it once)."
                    )
                self._where[id(param)] = (bucket, index)
                self._by_id[id(param)] = param

    @property
    def largest_bucket_bytes(self) -> int:
        """Bytes of gradients in the largest bucket: about the most gradient memory alive at once."""
        return max((b.nbytes for b in self._buckets), default=0)


_MISSING = object()


def _zero_gradient(param: torch.Tensor, sparse_layout: tuple[int, int] | None) -> torch.Tensor:
    """The zero gradient ``zero_grad(set_to_none=False)`` leaves: dense zeros, or (where the freed gradient was
    sparse: ``nn.Embedding(sparse=True)``) a sparse tensor with no entries, as ``zero_()`` leaves one."""
    if sparse_layout is None:
        return torch.zeros_like(param)
    sparse_dim, _ = sparse_layout
    indices = torch.empty(sparse_dim, 0, dtype=torch.long, device=param.device)
    values = torch.empty(0, *param.shape[sparse_dim:], dtype=param.dtype, device=param.device)
    # (inside the context, not check_invariants=True alone: torch 2.11 warns "Sparse invariant checks are implicitly
    # disabled" for that spelling, an error under -W error; found by a helper's run on torch 2.11, 2026-11-29)
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        return torch.sparse_coo_tensor(indices, values, param.shape)


def users_hook_on(param: torch.Tensor) -> bool:
    """Whether ``param`` has a post-accumulate-grad hook other than memtrim's own."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return hooks is not None and len(hooks) > 1 and any(not _memtrims_own(h) for h in hooks.values())


def _memtrims_own(hook: Any) -> bool:
    """A hook of memtrim's own (a tracker's, another wrapper's): it reads gradients, never edits them."""
    owner = getattr(hook, "__self__", None)
    module = type(owner).__module__ if owner is not None else getattr(hook, "__module__", None)
    return isinstance(module, str) and module.startswith("memtrim.")


def _changed_entries(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys (but 'params') whose value differs between two views of a param group: the same objects at once
    (the usual step), else compared by value as :func:`_hyperparameters` compares them."""
    return [k for k in before.keys() | now.keys() if k != "params" and before.get(k, _MISSING) is not now.get(
        k, _MISSING) and _fingerprint(before.get(k, _MISSING)) != _fingerprint(now.get(k, _MISSING))]


def _hyper_changes(used: dict[str, Any], now: dict[str, Any], g: int) -> list[str]:
    """What differs between two of group ``g``'s hyperparameter readings, said for a message."""
    return [f"group {g}'s {key!r} changed from {_show(used.get(key, _MISSING))} to {_show(now.get(key, _MISSING))}"
            for key in sorted(used.keys() | now.keys())
            if (used.get(key, _MISSING),) != (now.get(key, _MISSING),)]  # a tuple: `is` first (NaN)


def _state_mark(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> tuple[Any, ...]:
    """``param``'s optimizer state as it stands: the state container and object, and each entry (tensors by identity
    and version, no device sync; the entries kept alive beside it). A state cleared, loaded from a state_dict or
    changed in place between backward and step() was not seen, and step() trained on as if the update inside backward
    had used it, until 2026-12-03 (an adversarial pass: 0.029 off after a reset). Compared by :func:`_same_state`."""
    state = optimizer.state.get(param)
    if not state:
        return (optimizer.state, state, (), [], ())
    values = tuple(state.values())  # (kept alive beside the mark: the ids in it stay theirs)
    entries: list[Any]
    try:
        entries = [(id(v), v._version) for v in values]  # torch's optimizers: every entry a tensor
    except AttributeError:
        entries = [_entry(v) for v in values]
    return (optimizer.state, state, values, entries, tuple(state))


# NOTE [ keys a loop logs ]: torch's and memtrim's optimizers read only the state keys their own updates write (and
# the group keys in their ``defaults``), so a loop may log its own between backward and step()
# (``opt.state[p]["update_ratio"] = ...``, ``opt.param_groups[0]["last_loss"] = ...``): the updating inside backward
# did not read them, nor would the standard step(). Which keys an update writes is read off its first update in
# backward (again for a state loaded or reset since): those it added or changed. Refused, falsely, until
# 2026-12-03: a key added since the update from f0d5f80 on; then a key logged again at every step, a group key, and
# the empty state a read of ``opt.state[p]`` makes for SGD without momentum (an adversarial pass). Any other
# optimizer's step may read a logged key: there every change is refused.


def _entry(value: Any) -> Any:
    """A state entry's fingerprint: a tensor by identity and version, a plain value as itself, anything else by
    identity."""
    if isinstance(value, torch.Tensor):
        return (id(value), value._version)
    return value if type(value) in _PLAIN else id(value)


def _same_state(mark: tuple[Any, ...], now: tuple[Any, ...], own: frozenset[str] | None) -> bool:
    """Whether ``now`` is ``mark``'s state as the update inside backward left it; with ``own`` (the keys the update
    writes, known for torch's and memtrim's optimizers), as far as they go. A state made since where the update kept
    none (a read of ``opt.state[p]``, a defaultdict, for SGD without momentum) is no change if empty, nor for those
    optimizers if it holds no key of theirs. NOTE [ keys a loop logs ]"""
    if mark[0] is not now[0]:
        return False
    if mark[1] is not now[1]:
        return not mark[1] and (not now[1] or own is not None and own.isdisjoint(now[4]))
    if mark[4] == now[4] and mark[3] == now[3]:  # every entry as it was
        return True
    if own is None:
        return False
    at = {key: i for i, key in enumerate(now[4])}
    return all(key in at and now[3][at[key]] == entry for key, entry in zip(mark[4], mark[3]) if key in own)


def _hyperparameters(group: dict[str, Any], keys: Any = None) -> dict[str, Any]:
    """A param group's hyperparameters (every key but 'params', or those in ``keys``) in a form that compares by
    value, tensors by identity and version (an in-place change of a tensor learning rate shows; no device sync)."""
    return {key: value if type(value) in _PLAIN else _fingerprint(value) for key, value in group.items()
            if key != "params" and (keys is None or key in keys)}


class _TensorMark(tuple):
    __slots__ = ()


_PLAIN = frozenset({int, float, bool, str, type(None)})


class _Snapshot:
    """A tensor's or generator's fingerprint as it was when read (an in-place add to a step-count tensor, timm's
    Lamb's, or a draw from a generator changes the object in place)."""

    __slots__ = ("fingerprint",)

    def __init__(self, value: torch.Tensor | torch.Generator) -> None:
        self.fingerprint = _fingerprint(value)


def _fingerprint(value: Any) -> Any:
    if type(value) in _PLAIN:  # the usual hyperparameter, first: this runs for every group entry at every bucket
        return value
    if isinstance(value, _Snapshot):
        return value.fingerprint
    if isinstance(value, torch.Generator):  # by its state: a draw changes it in place
        return ("generator", id(value), generator_bytes(value))
    if isinstance(value, torch.Tensor):
        return _TensorMark((id(value), value._version, value))  # tuple ==: same object short-circuits
    if type(value) is tuple and all(type(v) in _PLAIN for v in value):
        return value  # (Adam's betas) as it is: it cannot change in place and compares by value
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _fingerprint(v)) for k, v in value.items()))
    return value


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(absent)"
    if isinstance(value, _TensorMark):
        return f"a tensor (version {value[1]})"
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], type):
        return repr(value[0](_show(v) if isinstance(v, _TensorMark) else v for v in value[1]))
    return repr(value)


def _scale_tensor(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """GradScaler's current scale as a tensor on its device (set by ``scaler.scale(loss)`` before backward).

    Its private attribute: the public ``get_scale()`` returns a Python float (``.item()``: a device sync for each
    bucket updated inside backward) and torch has no public accessor for the tensor, which GradScaler's own
    ``unscale_`` reads the same way.
    """
    return cast(torch.Tensor, scaler._scale)


def _by_device_and_dtype(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    out: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        out.setdefault((grad.device, grad.dtype), []).append(grad)
    return out


def _global_hooks(name: str) -> list[Callable]:
    """torch's process-wide optimizer step hooks (``register_optimizer_step_pre_hook``/``post_hook``)."""
    import torch.optim.optimizer as optimizer_module

    return list(getattr(optimizer_module, name, {}).values())


def _ddp_comm_hook(state, bucket):  # no annotations: DDP rejects any but its own
    wrapper = state()
    if wrapper is None:
        return _allreduce_as_ddp(None, bucket)  # None: the default group, as DDP's own
    return wrapper._ddp_hook(bucket)


def _allreduce_as_ddp(process_group: Any, bucket: Any) -> torch.futures.Future:
    """DDP's built-in averaging: each gradient times ``1 / world`` (its reducer's ``mul_out`` into the bucket), then
    a summing all-reduce. torch's ``allreduce_hook`` divides by the world size instead, which rounds otherwise where
    it is not a power of two (last bits at world size 3; found by an adversarial pass on 2026-11-29)."""
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size(group))
    work = dist.all_reduce(tensor, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """The 2-norm exactly as ``clip_grad_norm_`` computes it (foreach kernel where it would use one)."""
    if grad.device.type in ("cpu", "cuda") and not grad.is_sparse:
        try:
            return torch._foreach_norm([grad], 2.0)[0]
        except RuntimeError:  # pragma: no cover
            pass
    return torch.linalg.vector_norm(grad, 2.0)


# ---------------------------------------------------------------------------------------------- the clip guard
# torch.nn.utils' clipping on gradients that were applied and freed inside backward would silently clip nothing
# (clip_grad_norm_ returns 0.0). The guard raises instead; it looks only at parameters of an open step of a live
# wrapper and otherwise calls torch's function unchanged.
#
# Where it sits: torch's clipping functions are ``_no_grad`` wrappers, closures whose cell ``func`` holds the
# function itself. The guard goes into that cell, so every reference sees it: ``torch.nn.utils.clip_grad_norm_``,
# a ``from torch.nn.utils import clip_grad_norm_`` made before memtrim was imported, and clip_grad_norm_'s own
# calls of ``_get_total_norm``/``_clip_grads_with_norm_`` (torch >= 2.6, also public as ``get_total_norm`` and
# ``clip_grads_with_norm_``). Where a torch has no such cell, the module attributes are replaced instead (early
# imports by name are then not seen). ``get_total_norm`` receives gradients, not parameters: it raises when it
# gets none at all while an open step has freed gradients; a partial list (a bucket held back to step()) is not
# seen, but the clip_grads_with_norm_ that follows it is.

_WRAPPERS: weakref.WeakSet = weakref.WeakSet()  # every live wrapper (get_total_norm's check)
_TWO_PASSES = threading.local()  # the wrapper running opt.backward(loss)'s two passes on this thread, if any


def _run_backward(loss: torch.Tensor, *, retain_graph: bool, inputs: Any, gradient: torch.Tensor | None = None,
                  create_graph: bool = False, **other: Any) -> None:
    """``loss.backward(...)`` that runs inside the torch-function modes in force (:class:`TwoPassDraws`):
    ``Tensor.backward`` is a torch call itself, and a mode handling it is off until it returns, the whole backward
    included (the gradient-noise hook's draws went unseen). Anything ``Tensor.backward`` refuses goes to it, to raise
    its own error."""
    if other or (gradient is None and loss.numel() != 1):
        loss.backward(gradient, retain_graph, create_graph, inputs, **other)
        return
    if gradient is None:
        gradient = torch.ones_like(loss, memory_format=torch.preserve_format)
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    torch.autograd.graph._engine_run_backward((loss,), (gradient,), retain_graph, create_graph, tuple(inputs),
                                              allow_unreachable=True, accumulate_grad=True)


@contextlib.contextmanager
def _forwards_undone(loss: torch.Tensor) -> Iterator[None]:
    """Around the measuring pass (the backward of ``loss``): a module forward that runs inside it
    (torch.utils.checkpoint's recomputation, a hook that calls a module) runs again in the updating pass, and the
    standard loop runs it once. Each such module's buffers (a BatchNorm's running statistics, updated again by every
    recomputation) are copied before its first call here and put back at the end, so only the updating pass's call
    counts. Nothing is copied where no forward runs in backward (the usual case). The hook is global, so it looks
    only at forwards inside this pass's own graph task: another thread's forward (its own model training meanwhile)
    is none of its business (its BatchNorm updates were put back)."""
    from ..checkpoint._core import stand_in  # checkpoint imports recompute, not this module

    saved: dict[int, list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]]] = {}
    task: dict[str, int] = {}

    def started(grad_outputs: Any) -> None:
        task.setdefault("id", torch._C._current_graph_task_id())

    def before(module: torch.nn.Module, args: Any) -> None:
        if "id" not in task or torch._C._current_graph_task_id() != task["id"]:
            return
        if putting_buffers_back():  # ReversibleSequential's recomputation: it rewinds and restores them itself
            return
        if id(module) not in saved:
            # (the slot too: a forward may assign a new tensor, `self.ema = ...`; not a clone memtrim's checkpoint put
            # there for its recomputation, which drops what is written to it: putting it back would undo the
            # forward's own update)
            with torch.no_grad():
                saved[id(module)] = [(module._buffers, name, b, b.clone()) for name, b in module._buffers.items()
                                     if b is not None and not stand_in(b)]

    hooks: list[tuple[Callable[[Any], Any], Any]] = [(torch.nn.modules.module.register_module_forward_pre_hook, before)]
    if loss.grad_fn is not None:
        hooks.append((loss.grad_fn.register_prehook, started))
    handles = register_own(hooks)  # (at every step: no foreign hooks a converted model's norms must look for)
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        with torch.no_grad():
            for buffers in saved.values():
                for slots, name, buffer, value in buffers:
                    slots[name] = buffer
                    if buffer.shape != value.shape:
                        buffer.resize_(value.shape)
                    buffer.copy_(value)
_CLIP_DEPTH = threading.local()  # inside a guarded clip_grad_norm_: its own _get_total_norm call is not the user's
# torch.nn.utils.clip_grad name, the public name, the option to use instead, what the first argument holds
_CLIP_FUNCTIONS = (
    ("clip_grad_norm_", "clip_grad_norm_", "clip_grad_norm=max_norm", "parameters"),
    ("clip_grad_value_", "clip_grad_value_", "clip_grad_value=v", "parameters"),
    ("_clip_grads_with_norm_", "clip_grads_with_norm_", "clip_grad_norm=max_norm", "parameters"),
    ("_get_total_norm", "get_total_norm", "clip_grad_norm=max_norm", "tensors"),
)


def _how(option: str) -> str:
    """How OptimizerInBackward's own clipping ``option`` is used, for the clip refusals."""
    return (" (it clips each gradient as torch does, before its update, with loss.backward() as usual)"
            if option.startswith("clip_grad_value") else
            " (it clips exactly as torch does, before each update; the norm is then opt.last_total_norm) and call "
            "opt.backward(loss)")


def _clip_error(name: str, option: str) -> OptimizerInBackwardError:
    return OptimizerInBackwardError(
        f"torch.nn.utils.{name}: expected gradients to clip, but OptimizerInBackward already applied and "
        f"freed them inside backward, so it would clip nothing. Pass {option} to OptimizerInBackward{_how(option)}. A "
        "wrapper made already (memtrim.plan's apply makes one) is rebuilt with it by opt.remove(), then "
        f"memtrim.OptimizerInBackward(opt.optimizer, model=..., {option})."
    )


def _check_clip(parameters: Any, name: str, option: str) -> Any:
    if isinstance(parameters, torch.Tensor):
        params = [parameters]
    elif isinstance(parameters, types.GeneratorType):
        params = list(parameters)
        parameters = (p for p in params)  # keep torch's warning about an empty generator
    else:
        params = parameters = list(parameters)
    for param in params:
        owner = _OWNERS.get(param) if isinstance(param, torch.Tensor) else None
        wrapper = owner() if owner is not None else None
        if wrapper is not None and wrapper._open and param.grad is None and id(param) in wrapper._stepped:
            raise _clip_error(name, option)
    if not params and not getattr(_CLIP_DEPTH, "depth", 0):  # (clip_grad_norm_'s own call of clip_grads_with_norm_:
        _check_none_left_out(name, option)                     # checked)
    for param in params:
        gather_gradient(param)  # a gradient partly in its holder, partly on the parameter: all in the holder
    if any(holder_of(p) is not None for p in params):  # NOTE [ gradients held elsewhere ]: clip where they are
        moved = [p if (holder := holder_of(p)) is None else holder for p in params]
        if isinstance(parameters, torch.Tensor):
            return moved[0]
        return (p for p in moved) if isinstance(parameters, types.GeneratorType) else moved
    return parameters


def _updating_here() -> OptimizerInBackward | None:
    """The open wrapper on this thread that updated parameters inside this step's backward, if any."""
    thread = threading.get_ident()
    for wrapper in list(_WRAPPERS):
        if wrapper._open and wrapper._updated_in_backward and wrapper._thread == thread:
            return wrapper
    return None


def _check_none_left_out(name: str, option: str) -> None:
    """Refuse a clip that would leave out gradients an open step on this thread applied and freed in backward
    (OptimizerInBackward) or that wait in host memory for a step (CPUOffloadOptimizer). The usual way to get one: a
    list of the parameters that have a gradient, ``[p for p in model.parameters() if p.grad is not None]`` (fairseq's
    clip): those parameters' ``.grad`` is None, so the clip measured and scaled the others alone (an empty list: 0,
    nothing clipped; 2.3e-3 off plain after 5 steps; found by an adversarial pass). Refused: an empty list while there
    are such gradients. Not seen (README): a list of the others, which is what clipping part of a model on purpose
    looks like (a head another optimizer steps; the parameters of a bucket OptimizerInBackward holds back to
    ``step()``, which depends on memory: refusing those came and went with it), or another model's parameters (a GAN's
    other network, or a model built again in a notebook while the old wrapper, mid-step, is not collected yet). Called
    for an empty list."""
    wrapper = _updating_here()
    if wrapper is not None:
        raise OptimizerInBackwardError(
            f"torch.nn.utils.{name}: got an empty list while OptimizerInBackward applied and freed "
            f"{len(wrapper._stepped)} gradients inside this step's backward, so the clip would leave those out. "
            "A list of the parameters that have a gradient ([p for p in model.parameters() if p.grad is not "
            f"None]) gets this: their .grad is None once applied. Pass {option} to OptimizerInBackward"
            f"{_how(option)}. {_EMPTY_ON_PURPOSE}"
        )
    pairs = held_gradients()
    if pairs:
        raise InvalidInputError(
            f"torch.nn.utils.{name}: got an empty list while {len(pairs)} gradients wait in host memory for the next "
            "step (memtrim.CPUOffloadOptimizer moves each one there as soon as it is ready, and its parameter's .grad "
            "is None), so the clip would leave those out. A list of the parameters that have a gradient ([p for p in "
            "model.parameters() if p.grad is not None]) gets this. Pass the parameters themselves "
            "(clip_grad_norm_(model.parameters(), max_norm), which clips the host copies in their place) or filter "
            f"on p.requires_grad. {_EMPTY_ON_PURPOSE}"
        )


_EMPTY_ON_PURPOSE = ("An empty list on purpose (a frozen model's trainable parameters, a module without any) clips "
                     "nothing in the standard loop either: skip the call for it (if params: clip_grad_norm_(params, "
                     "max_norm)); the list cannot tell it from the one above.")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}" if n else f"no {what}s"


def _only_freed_after_step(parameters: Any) -> bool:
    """Whether ``parameters`` (a list or a tensor, as ``_check_clip`` returns it) hold no gradient at all because a
    wrapper freed them inside backward and its step is closed (after ``step()``, before the next ``zero_grad()``)."""
    if not isinstance(parameters, (list, torch.Tensor)):
        return False
    params = [parameters] if isinstance(parameters, torch.Tensor) else parameters
    if not params or any(not isinstance(p, torch.Tensor) or p.grad is not None for p in params):
        return False
    for param in params:
        owner = _OWNERS.get(param)
        wrapper = owner() if owner is not None else None
        if wrapper is not None and not wrapper._open and not wrapper._removed and id(param) in wrapper._freed:
            return True
    return False


def _check_total_norm(tensors: Any, name: str, option: str) -> Any:
    inside_clip_grad_norm: int = getattr(_CLIP_DEPTH, "depth", 0)
    if inside_clip_grad_norm or isinstance(tensors, torch.Tensor):
        return tensors
    tensors = list(tensors)  # as torch's own first line does
    if not tensors:
        _check_none_left_out(name, option)
    elif any(t is None for t in tensors) and _updating_here() is not None:  # ([p.grad for p in params], some applied
        raise _clip_error(name, option)                                      # and freed)
    held = {id(holder.grad) for _, holder in held_gradients()}
    if held and not any(id(t) in held for t in tensors):
        # (a list of the device gradients left: [p.grad for p in params if p.grad is not None] over a model whose body
        # CPUOffloadOptimizer steps and whose head a plain optimizer does gave the head's norm alone, and the clip
        # that followed clipped too little; found by an adversarial pass. Gradients a step used already do not
        # count: a GAN's discriminator measured after the generator's step() was refused before 2026-11-30)
        found = _count(len(tensors), "gradient")
        raise InvalidInputError(
            f"torch.nn.utils.{name}: got {found}, none in host memory, but gradients wait there "
            "(memtrim.CPUOffloadOptimizer moves each one there as soon as it is ready, and its parameter's .grad is "
            "None), so the norm would leave them out. Pass the parameters to clip_grad_norm_(model.parameters(), "
            "max_norm) (it clips the host copies in their place), or the host copies' gradients: [h.grad for h in "
            "opt.host_parameters()]. For the norm of a model none of whose gradients are offloaded, "
            "clip_grad_norm_(its parameters, float('inf')) returns it and changes nothing."
        )
    return tensors


def _guarded(inner: Callable, name: str, option: str, argument: str) -> Callable:
    check = _check_total_norm if argument == "tensors" else _check_clip
    counts = name == "clip_grad_norm_"

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (check(args[0], name, option), *args[1:])
        elif argument in kwargs:
            kwargs[argument] = check(kwargs[argument], name, option)
        if name == "clip_grad_value_":
            if args and isinstance(args[0], types.GeneratorType):
                args = (list(args[0]), *args[1:])
            elif isinstance(kwargs.get(argument), types.GeneratorType):
                kwargs[argument] = list(kwargs[argument])
            if _only_freed_after_step(args[0] if args else kwargs.get(argument)):
                return None  # after step(): the standard loop clips gradients that zero_grad() discards, a no-op
                # for training, as clip_grad_norm_ there; torch's own would fail on an empty list of gradients
        if not counts:
            return inner(*args, **kwargs)
        _CLIP_DEPTH.depth = getattr(_CLIP_DEPTH, "depth", 0) + 1
        try:
            return inner(*args, **kwargs)
        finally:
            _CLIP_DEPTH.depth -= 1

    guarded = functools.wraps(inner)(guarded)
    guarded._memtrim_guard = True  # type: ignore[attr-defined]
    return guarded


def install_clip_guard() -> None:
    """Put the guard into torch.nn.utils' clipping functions (once; see the comment above ``_WRAPPERS``). Called by
    this wrapper and by ``held_elsewhere.hold_gradient_elsewhere``: wherever torch's clipping would not find the
    gradients where it looks."""
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for attribute, name, option, argument in _CLIP_FUNCTIONS:
        public = getattr(clip_grad, attribute, None)
        if public is None or getattr(public, "_memtrim_guard", False):
            continue
        code, closure = getattr(public, "__code__", None), getattr(public, "__closure__", None)
        if code is not None and closure and "func" in code.co_freevars:  # torch's _no_grad wrapper
            cell = closure[code.co_freevars.index("func")]
            inner = cell.cell_contents
            if getattr(inner, "_memtrim_guard", False):
                continue
            if getattr(inner, "__name__", None) == public.__name__:
                cell.cell_contents = _guarded(inner, name, option, argument)
                continue
        guarded = _guarded(public, name, option, argument)  # another torch: replace the module attributes
        setattr(clip_grad, attribute, guarded)
        for module, exported in ((utils, name), (utils, attribute)):
            if getattr(module, exported, None) is public:
                setattr(module, exported, guarded)


def _check_options(
    clip_grad_norm: float | None, clip_grad_value: float | None, scaler: Any, bucket_bytes: int, peak: str
) -> None:
    """Validate ``OptimizerInBackward``'s keyword options (raises ``InvalidInputError``)."""
    for name, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
        if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise InvalidInputError(
                f"memtrim.OptimizerInBackward: {name} must be a positive number, got {value!r}."
            )
    if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: bucket_bytes must be an int >= 0, got {bucket_bytes!r}."
        )
    if peak not in _PEAK_MODES:
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: peak must be one of {_PEAK_MODES}, got {peak!r}."
        )
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}."
        )


def _check_fused_unscaling(optimizer: torch.optim.Optimizer, scaler: Any) -> None:
    """A fused optimizer (``fused=True``) stepped by ``scaler.step(opt)`` without ``unscale_`` divides its gradients
    by the scale inside its kernel; ``scaler.unscale_(opt)`` (and this wrapper, inside backward) multiplies them by the
    scale's reciprocal. The two agree bitwise while the scale is a power of two: always, where the initial scale and
    both factors are (GradScaler's defaults). Otherwise which one the standard loop does depends on an ``unscale_``
    call after backward, when the update is done: refused. So are float16 parameters: the kernel keeps its unscaled
    gradient in float32 where unscaling rounds it to float16 (most of a float16 gradient is subnormal once unscaled).
    (With clipping the standard loop unscales first.)"""
    if scaler is None or not getattr(optimizer, "_step_supports_amp_scaling", False):
        return
    values = {"scale": float(scaler.get_scale()), "growth_factor": float(scaler.get_growth_factor()),
              "backoff_factor": float(scaler.get_backoff_factor())}
    odd = [f"{k}={v!r}" for k, v in values.items() if not (math.isfinite(v) and v > 0 and math.frexp(v)[0] == 0.5)]
    if any(p.dtype is torch.float16 for group in optimizer.param_groups for p in group["params"]):
        odd.append("float16 parameters")
    if odd:
        raise InvalidInputError(
            "memtrim.OptimizerInBackward: expected a GradScaler whose scale stays a power of two with a fused "
            f"optimizer, and no float16 parameters, but found {', '.join(odd)}. scaler.step(opt) lets a fused "
            "optimizer divide by the scale in its kernel, in float32, scaler.unscale_(opt) multiplies by its "
            "reciprocal and rounds to the gradient's dtype, and which of the two the standard loop does depends on "
            "a call made after the update inside backward; they agree only for powers of two and float32 or "
            "bfloat16 gradients. To fix: a power-of-two init_scale, growth_factor and backoff_factor (GradScaler's "
            "defaults) with float32 or bfloat16 parameters, or fused=False."
        )


_GLOBAL_OPTIMIZERS = ("LBFGS",)


def _steps_per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is one of torch's or memtrim's, known to step only ``self.param_groups`` and keep its
    state per parameter (in ``state``) and per group."""
    module = type(optimizer).__module__
    return module.startswith(("torch.optim", "memtrim."))


def _own_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's own attributes a step could advance (besides ``state`` and ``param_groups``): numbers, and
    random generators by their state (timm's Kron draws from one of its own)."""
    cpu, cuda = _global_generators()  # (as bytes, no op: a planner's fake trace and a tracker see none)
    found: dict[str, Any] = {"the global random generator": cpu}
    if cuda:
        found["the CUDA random generators"] = cuda
    for name, value in vars(optimizer).items():
        if name in ("state", "param_groups", "defaults"):
            continue
        if type(value) in (int, float, bool):
            found[name] = value
        elif isinstance(value, random.Random):
            found[name] = value.getstate()
        elif isinstance(value, torch.Generator):
            found[name] = generator_bytes(value)
        elif isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
            found[name] = (value._version, value.item())
    return found


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, OptimizerInBackward):
        raise MemtrimStateError(
            "memtrim.OptimizerInBackward: this optimizer is already wrapped (its hooks step it inside backward). "
            "Use it as it is, or wrap the inner torch optimizer (opt.optimizer) once."
        )
    from ..optim_state import CPUOffloadOptimizer

    if isinstance(optimizer, CPUOffloadOptimizer):
        raise InvalidInputError(
            "memtrim.OptimizerInBackward: expected a torch optimizer over the model's parameters, got a "
            "memtrim.CPUOffloadOptimizer, which already moves each gradient to the host and steps there, on host "
            "copies: stepped inside backward it would update those copies while the gradients still arrive. Use one "
            "of the two: CPUOffloadOptimizer (offload_gradients=True, the default) keeps the optimizer state and "
            "the gradients off the device; OptimizerInBackward frees each gradient after an update on the device."
        )
    from ..optim_state._offload import live_offloader

    held = [p for g in getattr(optimizer, "param_groups", ()) for p in g["params"] if live_offloader(p) is not None]
    if held:
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: a parameter of shape {tuple(held[0].shape)} is in a CPUOffloadOptimizer "
            "that is still alive (held by an LR scheduler, a list, a variable): its gradient hooks would move the "
            "gradients to its host copies before this wrapper sees them. Call old_opt.remove() (or drop every "
            "reference to it) before building this one."
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: expected a built torch.optim.Optimizer, got {type(optimizer).__name__}. "
            "Build it first, e.g. OptimizerInBackward(torch.optim.AdamW(model.parameters()))."
        )
    name = type(optimizer).__name__
    if name in _GLOBAL_OPTIMIZERS or needs_closure(type(optimizer)):
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: {name} needs a closure or information from all parameters at once, "
            "so it cannot step one bucket inside backward. Use a per-parameter optimizer (SGD, Adam, AdamW, ...) "
            "or train without OptimizerInBackward."
        )


def _check_owned(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise where the optimizer holds a parameter ``model`` does not own."""
    stray = not_owned(model, optimizer)
    if stray:
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: the optimizer holds a parameter of shape {tuple(stray[0].shape)} that the "
            f"model ({type(model).__name__}) does not own. Build the optimizer from this model's parameters (after "
            "wrapping it in DDP, pass the DDP model), or build the wrapper without model= (it then clips its own "
            "parameters only)."
        )


def _check_model(model: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Return the DDP wrapper if ``model`` is one; check that the model owns every optimized parameter."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.OptimizerInBackward: model must be an nn.Module, got {type(model).__name__}.")
    _check_owned(model, optimizer)
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return None
    hooks = getattr(model, "_comm_hooks", None)
    if hooks:  # found by an adversarial pass: torch's bare "register_comm_hook ... can only be called once"
        name = getattr(hooks[0][0], "__name__", hooks[0][0])
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: the DDP model has a comm hook already ({name}), and DDP takes one: the "
            "wrapper's comm hook is where it receives each averaged gradient. Expected a "
            "DDP model without a comm hook; to fix: build the DDP model without register_comm_hook (gradient "
            "compression such as fp16_compress_hook or PowerSGD then is not applied), or train it with the "
            "standard loop."
        )
    return model


def _check_not_distributed(optimizer: torch.optim.Optimizer, two_passes: bool) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(sharded(p) for p in params):
        if two_passes:
            # found by an adversarial pass: FSDP2 reduce-scatters the sharded gradients from its own hooks, which the
            # measuring pass (backward(inputs=) the sharded parameters) never reached: every update ran unclipped,
            # and a GradScaler's inf went unseen (the parameters became NaN), silently
            raise InvalidInputError(
                "memtrim.OptimizerInBackward: clip_grad_norm= and scaler= are not supported under FSDP2: their "
                "first backward pass measures the gradients, and FSDP2 makes its sharded gradients outside that pass "
                "(the update would run unclipped, or with an inf unseen). Leave these options out (clip_grad_value= "
                "works), or train FSDP2 with the standard loop: loss.backward(), "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), optimizer.step()."
            )
        return  # FSDP2: hooks fire on the sharded, reduce-scattered gradient
    raise InvalidInputError(
        f"memtrim.OptimizerInBackward: torch.distributed runs {dist.get_world_size()} ranks but no "
        "DistributedDataParallel model was given. A post-accumulate-grad hook would step on the local gradient "
        "before the all-reduce and the ranks would silently drift. Wrap the model in DDP first, then pass it: "
        "OptimizerInBackward(optimizer, model=ddp_model)."
    )

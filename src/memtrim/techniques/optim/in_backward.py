"""The optimizer step fused into backward: each bucket of parameters is updated as soon as its gradients are
complete, and its gradients are freed right away, so the full set of gradients never exists at once.

NOTE [ optimizer in backward ]
* Source of truth: the wrapped ``torch.optim`` optimizer. A bucket is stepped by calling that optimizer's own
  ``step`` with ``param_groups`` temporarily narrowed to the bucket (each narrowed group is a shallow copy of
  the real group, so hyperparameters, including a scheduler's latest learning rate, are read at that moment;
  ``state`` is shared). The update of a parameter depends only on its gradient and state, so this is bitwise
  equal to one ``step()`` over all parameters, with the same foreach/fused implementation.
* When: ``register_post_accumulate_grad_hook`` marks a parameter ready; a bucket steps when its last
  parameter is ready; at the end of the backward pass (an autograd engine callback) any bucket with some ready
  parameters steps too (parameters unused in this step keep ``grad=None`` and are skipped, as by ``step()``).
  Under DDP the gradients are taken from DDP's comm hook after the all-reduce instead (a post-accumulate hook
  there would see the local gradient and ranks would drift). Under FSDP2 the hooks fire on the sharded,
  reduce-scattered gradient.
* Global information (clipping by global norm, GradScaler's inf check) needs every gradient before any update:
  ``backward(loss)`` then runs two passes: the first computes the norms / inf flags and frees each gradient at
  once, the second (same graph, retained) updates. Cost: one extra backward pass.
* Exactly once: a parameter stepped in this training step is not stepped again until ``step()`` or
  ``zero_grad()`` closes the step; a second backward without ``accumulate()`` raises instead.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ...errors import InvalidInputError, MemtrimError
from ...measure import _hooks

__all__ = ["OptimizerInBackward", "OptimizerInBackwardError"]

_DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


class OptimizerInBackwardError(MemtrimError, RuntimeError):
    """The training loop does something the in-backward step cannot do exactly."""


class _Bucket:
    __slots__ = ("group", "params", "ready")

    def __init__(self, group: int, params: list[torch.Tensor]) -> None:
        self.group = group
        self.params = params
        self.ready: set[int] = set()  # indices into params


class OptimizerInBackward(torch.optim.Optimizer):
    """Wrap an optimizer so that it steps inside backward, bucket by bucket, freeing gradients as it goes.

    Why: gradients are as large as the parameters; stepping inside backward keeps at most about one bucket
    of them alive (LOMO, arXiv 2306.09782), without the per-parameter optimizers, lost schedulers, missing
    clipping and accumulation, and DDP drift of the usual recipes.

    Args:
        optimizer: an ordinary, already-built ``torch.optim`` optimizer whose update of a parameter depends only
            on that parameter's gradient and state (SGD, Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad,
            Adadelta, ...). It stays the source of truth: param_groups, hyperparameters and state.
        model: the model (or its ``DistributedDataParallel`` wrapper). Optional without distributed training;
            required under DDP (memtrim registers a comm hook on it). All optimized parameters must belong to it.
        clip_grad_norm: clip by global 2-norm, exactly as ``torch.nn.utils.clip_grad_norm_`` over the
            optimizer's parameters in order; needs ``backward(loss)`` (two passes).
        clip_grad_value: clamp each gradient to ``[-v, v]`` before its update (no extra pass).
        scaler: a ``torch.amp.GradScaler``; an inf/NaN anywhere skips the whole update and lowers the scale.
            Call ``opt.backward(scaler.scale(loss))``, then ``scaler.step(opt)`` and ``scaler.update()``.
        bucket_bytes: parameters of one param group are stepped together in buckets of about this many bytes
            (in reverse order, the order their gradients usually arrive); ``0`` steps each parameter alone.

    Raises:
        InvalidInputError: not an optimizer; a closure-based or global optimizer (LBFGS); parameters the model
            does not own; bad option values; distributed training without a DDP model or FSDP2 parameters.

    Example::

        opt = memtrim.OptimizerInBackward(torch.optim.AdamW(model.parameters(), lr=1e-3))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        for x, y in batches:
            opt.zero_grad()
            loss_fn(model(x), y).backward()   # parameters are updated here
            opt.step()                        # closes the step (no work left)
            sched.step()

    See NOTE [ optimizer in backward ] in this file.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        model: torch.nn.Module | None = None,
        clip_grad_norm: float | None = None,
        clip_grad_value: float | None = None,
        scaler: Any = None,
        bucket_bytes: int = _DEFAULT_BUCKET_BYTES,
    ) -> None:
        _check_optimizer(optimizer)
        for name, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise InvalidInputError(
                    f"memtrim.OptimizerInBackward: {name} must be a positive number, got {value!r}."
                )
        if not isinstance(bucket_bytes, int) or bucket_bytes < 0:
            raise InvalidInputError(
                f"memtrim.OptimizerInBackward: bucket_bytes must be an int >= 0, got {bucket_bytes!r}."
            )
        if scaler is not None and not hasattr(scaler, "_per_optimizer_states"):
            raise InvalidInputError(
                f"memtrim.OptimizerInBackward: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}."
            )
        # Optimizer.__init__ is not called: param_groups, state and defaults are the wrapped optimizer's own.
        self.optimizer = optimizer
        self.clip_grad_norm = clip_grad_norm
        self.clip_grad_value = clip_grad_value
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.bucket_bytes = bucket_bytes
        self._two_passes = clip_grad_norm is not None or self.scaler is not None
        self._ddp = _check_model(model, optimizer)
        self._hooks: list[Any] = []
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[_Bucket, int]] = {}  # id(param) -> (bucket, index)
        self._stepped: set[int] = set()
        self._accumulating = 0
        self._pass: str | None = None  # None: single pass; "measure" / "update" inside backward(loss)
        self._norms: dict[int, torch.Tensor] = {}
        self._found_inf: dict[torch.device, torch.Tensor] = {}
        self._coefficient: torch.Tensor | None = None
        self._callback_queued = False
        self._deferred = False  # accumulated gradients: step after backward instead of inside it
        raw = getattr(type(optimizer).step, "__wrapped__", None)  # the step without hooks and profiler records
        self._raw_step = raw if raw is not None else type(optimizer).step
        self._build_buckets()
        if self._ddp is not None:
            # weak references both ways: DDP's C++ reducer must not keep the wrapper (and itself) alive
            self._ddp.register_comm_hook(weakref.ref(self), _ddp_comm_hook)
            self._ddp = weakref.ref(self._ddp)
        else:
            _check_not_distributed(optimizer)
            for bucket in self._buckets:
                for param in bucket.params:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._on_param_ready))

    # ------------------------------------------------------------------ the wrapped optimizer's view
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's ``state_dict()``: interchangeable with plain training, both ways."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self.remove()
        self._build_buckets()
        for bucket in self._buckets:
            for param in bucket.params:
                self._hooks.append(param.register_post_accumulate_grad_hook(self._on_param_ready))

    def __repr__(self) -> str:
        return f"OptimizerInBackward({self.optimizer!r}, buckets={len(self._buckets)})"

    def __getstate__(self) -> Any:
        raise MemtrimError("OptimizerInBackward cannot be pickled; save opt.state_dict() instead.")

    # ------------------------------------------------------------------ the training loop
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Close the training step (a no-op for gradients already freed) and clear any gradient left."""
        self._close_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """Close the training step. The updates already happened inside backward.

        Raises:
            InvalidInputError: a closure is given (in-backward stepping cannot re-evaluate the loss).
        """
        if closure is not None:
            raise InvalidInputError(
                "OptimizerInBackward.step: closures are not supported; the update happens inside backward."
            )
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # what LR schedulers check
        self._close_step()

    @contextlib.contextmanager
    def accumulate(self) -> Iterator[None]:
        """Micro-batches run inside accumulate gradients normally; the backward after it steps.

        Example::

            for x, y in micro_batches[:-1]:
                with opt.accumulate():
                    loss_fn(model(x), y).backward()
            loss_fn(model(x_last), y_last).backward()   # steps on the accumulated gradients
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
        if not isinstance(loss, torch.Tensor):
            raise InvalidInputError(f"OptimizerInBackward.backward: loss must be a tensor, got {type(loss).__name__}.")
        if self._accumulating or not self._needs_two_passes():
            loss.backward(**kwargs)
            return
        if self._ddp is not None:
            loss.backward(**kwargs)  # DDP: one pass; the step follows DDP's all-reduce (see _ddp_comm_hook)
            return
        retain = kwargs.pop("retain_graph", False)
        if self._has_accumulated_grads():
            # earlier micro-batches left gradients: they all exist anyway, so step after a single pass
            self._deferred = True
            try:
                loss.backward(retain_graph=retain, **kwargs)
            finally:
                self._deferred = False
            self._finish_deferred()
            return
        self._pass = "measure"
        try:
            loss.backward(retain_graph=True, **kwargs)
            self._conclude_measure()
            if self._skip_update():
                return
            self._pass = "update"
            loss.backward(retain_graph=retain, **kwargs)
        finally:
            self._pass = None
            self._norms.clear()

    def remove(self) -> None:
        """Remove memtrim's hooks (the wrapped optimizer then works as usual)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ hooks
    def _ddp_hook(self, bucket: Any) -> torch.futures.Future:
        """DDP's all-reduce, unchanged; it also queues our step after DDP's own end-of-backward work.

        DDP keeps every gradient in its buckets, so stepping early would save no memory, and stepping in the
        future's callback would race DDP's reducer on another thread. DDP queues its finalisation (which waits
        for the all-reduces and writes the averaged gradients) when its last bucket is ready, after this hook
        ran; so the callback queued here queues the step once more, behind DDP's finalisation, still on the
        autograd thread.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if not self._accumulating and not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_ddp_backward)
        return allreduce_hook(self._ddp().process_group, bucket)  # type: ignore[union-attr,misc]

    def _end_of_ddp_backward(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._after_ddp_finalize)

    def _after_ddp_finalize(self) -> None:
        self._callback_queued = False
        self._finish_deferred()

    def _on_param_ready(self, param: torch.Tensor) -> None:
        """``param``'s gradient is complete (accumulated; reduce-scattered under FSDP2)."""
        if self._accumulating or param.grad is None:
            return
        if self._pass is None and self._two_passes and not self._deferred:
            self._check_single_pass()
        if not self._callback_queued:
            self._queue_end_of_backward()
        if self._pass == "measure":
            self._measure(param)
            param.grad = None
            return
        key = id(param)
        if key in self._stepped:
            self._check_once([param])
        where = self._where.get(key)
        if where is None:
            return  # not optimized by this optimizer
        bucket, index = where
        bucket.ready.add(index)
        if not self._deferred and len(bucket.ready) == len(bucket.params):
            self._step_bucket(bucket)

    def _check_single_pass(self) -> None:
        if self._needs_two_passes() and self._pass is None and not self._deferred:
            raise OptimizerInBackwardError(
                "OptimizerInBackward: clip_grad_norm and a GradScaler need every gradient before any "
                "update; call opt.backward(loss) instead of loss.backward()."
            )

    def _check_once(self, params: list[torch.Tensor]) -> None:
        if any(id(p) in self._stepped for p in params):
            raise OptimizerInBackwardError(
                "OptimizerInBackward: a parameter received a second gradient after it was updated in this "
                "step. Run the earlier micro-batches inside `with opt.accumulate():`, or call opt.step() / "
                "opt.zero_grad() between training steps."
            )

    def _queue_end_of_backward(self) -> None:
        _check_not_distributed(self.optimizer)  # a process group started after this wrapper was built
        self._callback_queued = True
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        if self._pass == "measure" or self._deferred:
            return
        for bucket in self._buckets:
            if bucket.ready:
                self._step_bucket(bucket)

    # ------------------------------------------------------------------ stepping
    def _step_bucket(self, bucket: _Bucket) -> None:
        params = [bucket.params[i] for i in sorted(bucket.ready)]
        bucket.ready.clear()
        self._step(params)

    def _step(self, params: list[torch.Tensor]) -> None:
        """Update ``params`` (their gradients are complete) with the wrapped optimizer, then free the gradients."""
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if _hooks._active:
            _hooks.note_gradients(grads)
        if self.scaler is not None or self._coefficient is not None or self.clip_grad_value is not None:
            with torch.no_grad():
                if self.scaler is not None:
                    self._unscale(grads)
                if self._coefficient is not None:
                    for grad in grads:
                        grad.mul_(self._coefficient.to(grad.device))
                if self.clip_grad_value is not None:
                    for grad in grads:
                        grad.clamp_(min=-self.clip_grad_value, max=self.clip_grad_value)
        saved = self.optimizer.param_groups
        narrowed = [{**g, "params": []} for g in saved]
        for param in params:
            narrowed[self._where[id(param)][0].group]["params"].append(param)
        self.optimizer.param_groups = narrowed
        try:
            self._raw_step(self.optimizer)
        finally:
            self.optimizer.param_groups = saved
        for group, used in zip(saved, narrowed):  # a hyperparameter the optimizer itself changed in its group
            if used["params"] and (len(used) != len(group) or any(
                group[k] is not v for k, v in used.items() if k != "params" and k in group
            )):
                group.update((k, v) for k, v in used.items() if k != "params")
        for param in params:
            self._stepped.add(id(param))
            param.grad = None

    def _finish_deferred(self) -> None:
        for bucket in self._buckets:
            for index, param in enumerate(bucket.params):
                if param.grad is not None and id(param) not in self._stepped:
                    bucket.ready.add(index)
        if self._needs_two_passes():
            for bucket in self._buckets:
                for index in bucket.ready:
                    self._measure(bucket.params[index])
            self._conclude_measure()
            self._norms.clear()
            if self._skip_update():
                for bucket in self._buckets:
                    bucket.ready.clear()
                self.optimizer.zero_grad(set_to_none=True)
                return
        for bucket in self._buckets:
            if bucket.ready:
                self._step_bucket(bucket)

    def _close_step(self) -> None:
        self._stepped.clear()
        self._coefficient = None
        for bucket in self._buckets:
            bucket.ready.clear()

    # ------------------------------------------------------------------ global information
    def _needs_two_passes(self) -> bool:
        return self._two_passes

    def _has_accumulated_grads(self) -> bool:
        return any(p.grad is not None for b in self._buckets for p in b.params)

    def _measure(self, param: torch.Tensor) -> None:
        grad = param.grad
        assert grad is not None
        with torch.no_grad():
            if self.scaler is not None:
                grad = grad.clone()
                self._unscale([grad], record=True)
            if self.clip_grad_norm is not None:
                self._norms[id(param)] = _norm(grad)

    def _conclude_measure(self) -> None:
        if self.clip_grad_norm is None or self._skip_update():
            return
        order = [p for group in self.optimizer.param_groups for p in group["params"] if id(p) in self._norms]
        if not order:
            return
        device = order[0].device
        norms = torch.stack([self._norms[id(p)].to(device) for p in order])
        total = torch.linalg.vector_norm(norms, 2.0)
        self._coefficient = torch.clamp(self.clip_grad_norm / (total + 1e-6), max=1.0)
        self.last_total_norm = total

    def _unscale(self, grads: list[torch.Tensor], record: bool = False) -> None:
        scaler = self.scaler
        inv_scale = scaler._scale.double().reciprocal().float()
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for grad in grads:
            by_device.setdefault(grad.device, []).append(grad)
        for device, tensors in by_device.items():
            found = torch.zeros(1, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv_scale.to(device))
            if record:
                previous = self._found_inf.get(device)
                self._found_inf[device] = found if previous is None else previous + found

    def _skip_update(self) -> bool:
        """With a GradScaler: tell it what was found, and whether this step's update is skipped."""
        if self.scaler is None:
            return False
        from torch.amp.grad_scaler import OptState

        device = self.scaler._scale.device
        found = sum((f.to(device) for f in self._found_inf.values()), torch.zeros(1, device=device))
        self._found_inf.clear()
        self.scaler._per_optimizer_states[id(self)] = {
            "stage": OptState.UNSCALED,
            "found_inf_per_device": {device: found},
        }
        return bool(found.item())

    def _build_buckets(self) -> None:
        self._buckets.clear()
        self._where.clear()
        for g, group in enumerate(self.optimizer.param_groups):
            current: list[torch.Tensor] = []
            size = 0
            for param in reversed([p for p in group["params"] if p.requires_grad]):
                current.append(param)
                size += param.numel() * param.element_size()
                if size >= self.bucket_bytes:
                    self._buckets.append(_Bucket(g, current))
                    current, size = [], 0
            if current:
                self._buckets.append(_Bucket(g, current))
        for bucket in self._buckets:
            for index, param in enumerate(bucket.params):
                if id(param) in self._where:
                    raise InvalidInputError(
                        "memtrim.OptimizerInBackward: a parameter appears twice in the optimizer's param_groups."
                    )
                self._where[id(param)] = (bucket, index)

    @property
    def largest_bucket_bytes(self) -> int:
        """Bytes of gradients in the largest bucket: about the most gradient memory alive at once."""
        return max((sum(p.numel() * p.element_size() for p in b.params) for b in self._buckets), default=0)


def _ddp_comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations other than its own
    wrapper = state()
    if wrapper is None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        return allreduce_hook(None, bucket)
    return wrapper._ddp_hook(bucket)


def _norm(grad: torch.Tensor) -> torch.Tensor:
    """The 2-norm exactly as ``clip_grad_norm_`` computes it (foreach kernel where it would use one)."""
    if grad.device.type in ("cpu", "cuda") and not grad.is_sparse:
        try:
            return torch._foreach_norm([grad], 2.0)[0]
        except RuntimeError:  # pragma: no cover
            pass
    return torch.linalg.vector_norm(grad, 2.0)


_GLOBAL_OPTIMIZERS = ("LBFGS",)


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, OptimizerInBackward):
        raise InvalidInputError("memtrim.OptimizerInBackward: this optimizer is already wrapped.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: expected a built torch.optim.Optimizer, got {type(optimizer).__name__}. "
            "Build it first, e.g. OptimizerInBackward(torch.optim.AdamW(model.parameters()))."
        )
    name = type(optimizer).__name__
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if name in _GLOBAL_OPTIMIZERS or (closure is not None and closure.default is inspect.Parameter.empty):
        raise InvalidInputError(
            f"memtrim.OptimizerInBackward: {name} needs a closure or information from all parameters at once, "
            "so it cannot step one bucket inside backward. Use a per-parameter optimizer (SGD, Adam, AdamW, ...) "
            "or train without OptimizerInBackward."
        )


def _check_model(model: Any, optimizer: torch.optim.Optimizer) -> Any:
    """Return the DDP wrapper if ``model`` is one; check that the model owns every optimized parameter."""
    if model is None:
        return None
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.OptimizerInBackward: model must be an nn.Module, got {type(model).__name__}.")
    owned = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in owned:
                raise InvalidInputError(
                    f"memtrim.OptimizerInBackward: the optimizer holds a parameter of shape {tuple(param.shape)} "
                    f"that the model ({type(model).__name__}) does not own. Build the optimizer from this model's "
                    "parameters (after wrapping it in DDP, pass the DDP model)."
                )
    from torch.nn.parallel import DistributedDataParallel

    return model if isinstance(model, DistributedDataParallel) else None


def _check_not_distributed(optimizer: torch.optim.Optimizer) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if params and all(type(p.data).__name__ == "DTensor" for p in params):
        return  # FSDP2: hooks fire on the sharded, reduce-scattered gradient
    raise InvalidInputError(
        f"memtrim.OptimizerInBackward: torch.distributed runs {dist.get_world_size()} ranks but no "
        "DistributedDataParallel model was given. A post-accumulate-grad hook would step on the local gradient "
        "before the all-reduce and the ranks would silently drift. Wrap the model in DDP first, then pass it: "
        "OptimizerInBackward(optimizer, model=ddp_model)."
    )

"""Optimizer state (and gradients) in host memory: ``CPUOffloadOptimizer``.

NOTE [ offloaded optimizer state ]
The wrapped ``torch.optim`` optimizer is built over host copies of the parameters, so its state (AdamW's two
moments: twice the parameters) never exists on the device. With ``offload_gradients=True`` each parameter's gradient
is copied into its host copy's ``.grad`` as soon as autograd has accumulated it (a post-accumulate-grad hook) and the
device gradient is freed, so the full set of gradients never exists on the device either. ``step()`` runs the
optimizer on the host and copies every updated host parameter back into its device parameter (in place: references
to the device parameters stay valid). The host copies are made in the parameters' dtype: the update is the
optimizer's arithmetic on the host's kernels. Where host and device are one (a CPU model), that is the same
arithmetic as the standard loop, bitwise (tests); on a GPU it is the CPU kernel's rounding (``numerics="tolerance"``).
``param_groups``, ``state`` and ``state_dict`` are the host optimizer's, so LR schedulers work on this object.
Gradient accumulation works (hooks add into the host gradient). ``torch.nn.utils.clip_grad_norm_`` (and
``clip_grad_value_``) on the device parameters clips their host copies' gradients in their place, and
``model.zero_grad()`` clears them, as in the standard loop (NOTE [ gradients held elsewhere ] in
memtrim/techniques/optim/held_elsewhere.py); so for every parameter, also one frozen when the wrapper was built (its
gradient reaches the host when ``param_groups`` is read or at ``step()``, and in backward from the next ``step()``
or ``zero_grad()`` on, when the parameter gets its hook) and with ``offload_gradients=False``. On CUDA the first
gradient of a step is copied to the host asynchronously: every reader of the host gradients (``step()``,
``param_groups``, the clip, ``zero_grad``) waits for the copies first.

The device parameters may change outside the optimizer between steps, as they may in the standard loop:
``model.load_state_dict(...)`` after building the optimizer (a resumed run), ``torch.nn.init``, a clamp under
``torch.no_grad()``. ``step()`` sees it in the parameter's version counter (or its storage, for ``p.data = t``) and
copies the parameter to its host copy before stepping; without that the step updated the stale host copy and wrote
it back over the change. An in-place change through ``p.data`` (``p.data.clamp_(...)``) bumps no counter torch
keeps and is not seen: write it under ``torch.no_grad()`` on ``p`` itself. A parameter whose dtype or shape changed
(``model.to(torch.bfloat16)`` after building the optimizer) raises: build the optimizer after converting the model.

With ``offload_gradients=False`` the gradients wait on the device, but code that reads them through
``opt.param_groups`` (``GradScaler.unscale_(opt)``, ``clip_grad_norm_`` over the groups' params, a grad-norm log)
reads the host copies: reading ``param_groups`` moves the waiting gradients there first. Without it the scaler
found no gradient (torch's "No inf checks were recorded" assertion) and such a clip clipped nothing.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from typing import Any, cast

import torch
from torch.nn.parameter import is_lazy
from torch.utils.weak import WeakIdKeyDictionary

from ...errors import InvalidInputError, MemtrimStateError
from ..guards import holds_values
from ..optim.held_elsewhere import (
    add_to_holder,
    hold_gradient_elsewhere,
    registered_holder,
    used_by_a_step,
    wait_for_copies,
)
from ..optim.in_backward import users_hook_on
from ..optim.wrapping import WrappedOptimizerView, needs_closure, refuse_sharded

_API = "memtrim.CPUOffloadOptimizer"


def _distributed_world() -> int:
    """The world size of torch.distributed's default group, 1 where there is none."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _offload_across_ranks_error(world: int, error: type[Exception]) -> Exception:
    # found by an adversarial pass on 2026-11-29: under DDP with find_unused_parameters=True or static_graph=True,
    # each rank stepped on its own gradient (the ranks drifted apart, no error); with DDP's defaults a message
    # blamed gradient surgery
    return error(
        f"{_API}: offload_gradients=True under torch.distributed (world size {world}): each gradient moves to the "
        "host as soon as backward accumulates it, before DistributedDataParallel averages it across the ranks, so "
        "each rank would step on its own gradient. Pass offload_gradients=False (the optimizer state stays on the "
        "host; DDP averages the gradients on the device, and the step is the standard one)."
    )


class _StateByDeviceParameter(MutableMapping):
    """A host optimizer's ``state`` seen through the device parameters: each key is a device parameter, each value
    its host copy's state itself (not a copy), and writes go to the host optimizer's dict."""

    def __init__(self, inner: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.inner = inner
        self.pairs = pairs
        # keyed by the device parameters, and by the host copies themselves (the params param_groups lists)
        self.hosts = {id(p): h for p, h in pairs} | {id(h): h for _, h in pairs}

    def _host(self, param: Any) -> torch.Tensor:
        host = self.hosts.get(id(param))
        if host is None:
            raise KeyError(f"a tensor of shape {tuple(getattr(param, 'shape', ()))} that is neither a parameter of "
                           "this optimizer nor its host copy")
        return host

    def __getitem__(self, param: Any) -> Any:
        return self.inner[self._host(param)]  # the host optimizer's defaultdict: {} for a parameter without state

    def __setitem__(self, param: Any, value: Any) -> None:
        self.inner[self._host(param)] = value

    def __delitem__(self, param: Any) -> None:
        del self.inner[self._host(param)]

    def get(self, param: Any, default: Any = None) -> Any:
        """The state of ``param``, or ``default`` (nothing inserted, as ``dict.get`` on torch's defaultdict)."""
        host = self.hosts.get(id(param))
        return default if host is None else self.inner.get(host, default)

    def __contains__(self, param: object) -> bool:
        host = self.hosts.get(id(param))
        return host is not None and host in self.inner

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([p for p, h in self.pairs if h in self.inner])

    def __len__(self) -> int:
        return sum(1 for _, h in self.pairs if h in self.inner)


class CPUOffloadOptimizer(WrappedOptimizerView):
    """Keep an optimizer's state (and, by default, the gradients) in host memory; step there.

    Args:
        params: the device parameters, or parameter groups (dicts with ``"params"`` and per-group options).
        optimizer_class: a ``torch.optim`` optimizer class (default ``torch.optim.AdamW``).
        offload_gradients: move each gradient to the host as soon as it is ready and free it on the device.
        host: where the state lives (default ``"cpu"``; pinned when the parameters are on CUDA).
        **kwargs: the optimizer's options (``lr``, ``weight_decay``, ...).

    Raises:
        InvalidInputError: no parameters, a non-tensor parameter, or an optimizer class that is not a
            ``torch.optim.Optimizer`` subclass.

    Example::

        opt = memtrim.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4)
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        offload_gradients: bool = True,
        host: str | torch.device = "cpu",
        **kwargs: Any,
    ) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise InvalidInputError(
                f"{_API}: optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, got "
                f"{_described(optimizer_class)}."
            )
        if issubclass(optimizer_class, WrappedOptimizerView):  # its params would be host copies of host copies
            raise InvalidInputError(
                f"{_API}: optimizer_class must be an optimizer that steps the parameters it is given, got memtrim's "
                f"{optimizer_class.__name__}, a wrapper (wrapped in this one, the model's parameters never move). "
                "Pass the optimizer class it wraps (torch.optim.AdamW, ...)."
            )
        if needs_closure(optimizer_class):
            raise InvalidInputError(
                f"{_API}: {optimizer_class.__name__}'s step needs a closure, which runs the model's forward and "
                "backward again, while this optimizer steps host copies of the parameters. Expected an optimizer "
                "whose step takes no closure (AdamW, SGD, ...); to fix: train with the plain "
                f"{optimizer_class.__name__}."
            )
        if isinstance(params, torch.Tensor):
            raise InvalidInputError(
                f"{_API}: params must be an iterable of tensors or parameter groups (e.g. model.parameters()), got a "
                "single tensor; pass [tensor]."
            )
        groups = list(params)
        if not groups:
            raise InvalidInputError(f"{_API}: got no parameters.")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        try:
            self.host = torch.device(host)
        except (RuntimeError, TypeError, ValueError) as e:
            raise InvalidInputError(f"{_API}: cannot read the host device {host!r} ({e}).") from e
        if offload_gradients and _distributed_world() > 1:
            raise _offload_across_ranks_error(_distributed_world(), InvalidInputError)
        self.offload_gradients = offload_gradients
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device parameter, host copy)
        self._synced: dict[int, _Synced] = {}  # id(device parameter) -> it as copied
        self._host_synced: dict[int, int] = {}  # id(device parameter) -> its host copy's version when copied back
        self._handles: list[Any] = []
        self._hooked: set[int] = set()  # ids of the device parameters with a gradient hook
        self._deferred: set[int] = set()  # ids whose gradient waits on the device (a user's hook reads it)
        self._parts_back: dict[int, Any] = {}  # id(device parameter) -> its one-shot _PartBack hook's handle
        self.optimizer = self._rolled_back_on_error(lambda: optimizer_class([self._host_group(g) for g in groups],
                                                                             **kwargs))
        # a wrapper dropped without remove() lets go of the gradients it held elsewhere: clip_grad_norm_ and
        # zero_grad found its host copies still registered, summed them in and moved a plain optimizer's gradients
        # there (it then stepped nothing; found by an adversarial pass on 2026-11-29)
        weakref.finalize(self, _let_go, self._pairs)
        self._guarding = _StepGuardUse()
        weakref.finalize(self, self._guarding.release)
        # Optimizer.__init__ is not called: param_groups, state and defaults are the host optimizer's own (their
        # params are the host copies; state is keyed by the device parameters)
        self._hooks_first()  # (behind hooks the user registered before building it: moved before them)
        self._optimizer_step_pre_hooks = self.optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = self.optimizer._optimizer_step_post_hooks
        for table in ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                      "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            if hasattr(self.optimizer, table):  # (state_dict and load_state_dict are the host optimizer's)
                setattr(self, table, getattr(self.optimizer, table))

    def _host_group(self, group: dict[str, Any]) -> dict[str, Any]:
        """``group`` over host copies of its parameters (``(name, tensor)`` pairs keep their names), with the
        gradient hooks set."""
        if not isinstance(group, dict) or "params" not in group:
            raise InvalidInputError(f"{_API}: a parameter group must be a dict with 'params', got {group!r}.")
        items = group["params"]
        items = [items] if isinstance(items, torch.Tensor) else list(items)
        host_params: list[Any] = []
        for item in items:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                host_params.append((item[0], self._host_copy(item[1])))
            else:
                host_params.append(self._host_copy(item))
        return {**group, "params": host_params}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group: its parameters get host copies (and gradient hooks) like the first ones."""
        self._rolled_back_on_error(lambda: self.optimizer.add_param_group(self._host_group(param_group)))

    def _rolled_back_on_error(self, fn: Callable[[], Any]) -> Any:
        """``fn()``; where it raises, the host copies and gradient hooks it made are undone."""
        pairs, handles = len(self._pairs), len(self._handles)
        try:
            return fn()
        except BaseException:
            for handle in self._handles[handles:]:
                handle.remove()
            for device_param, _ in self._pairs[pairs:]:
                hold_gradient_elsewhere(device_param, None)
                self._hooked.discard(id(device_param))
            del self._handles[handles:], self._pairs[pairs:]
            raise

    def _host_copy(self, param: torch.Tensor) -> torch.Tensor:
        if not isinstance(param, torch.Tensor):
            raise InvalidInputError(f"{_API}: parameters must be tensors, got {type(param).__name__}.")
        if is_lazy(param):  # (torch's ValueError from empty_like came out of here; found by an adversarial pass)
            raise InvalidInputError(
                f"{_API}: a parameter is an uninitialized lazy parameter (nn.LazyLinear, ...), which has no values to "
                "copy to the host yet. Expected materialised parameters; to fix: run one forward of the model (which "
                "materialises them) before building the optimizer.")
        refuse_sharded([param], _API)
        other = live_offloader(param)
        if other is not None and other is not self:
            raise InvalidInputError(
                f"{_API}: a parameter of shape {tuple(param.shape)} is also in another CPUOffloadOptimizer that is "
                "still alive (held by an LR scheduler, a list, a variable): its gradient hooks would keep moving the "
                "gradients to its own host copies, and this optimizer would step nothing. Call old_opt.remove() "
                "(or drop every reference to it) before building a new one."
            )
        if any(param is p for p, _ in self._pairs):  # a few hundred parameters in a 7B model: a scan is fine
            raise InvalidInputError(
                f"{_API}: a parameter appears twice (shape {tuple(param.shape)}); give each parameter once (tied "
                "weights are one parameter: model.parameters() lists it once)."
            )
        if param.requires_grad and not param.is_leaf:
            raise InvalidInputError(
                f"{_API}: parameters must be leaf tensors (an nn.Parameter); got a tensor computed from others "
                f"(shape {tuple(param.shape)})."
            )
        if self.host.type == "meta" and holds_values(param):
            raise InvalidInputError(
                f"{_API}: host='meta' is how memtrim.plan predicts offloading on fake parameters; real parameters "
                f"(here one of shape {tuple(param.shape)}) would be stepped on meta copies that hold no values, and "
                "nothing would come back: the model trained nothing, silently (found by an adversarial pass). Expected "
                "host='cpu' (the default)."
            )
        pin = param.device.type == "cuda" and self.host.type == "cpu"
        # the parameter's own strides (channels_last, a transposed weight), as autograd gives its gradient: a fused
        # kernel walks a parameter, its gradient and its state in memory order, so a contiguous copy paired elements
        # wrongly (fused AdamW 0.073 off plain after 4 steps; found by an adversarial pass), and a reduction over it
        # (Adafactor's) summed in another order
        host = torch.empty_like(param, device=self.host, pin_memory=pin)
        if self.host.type != "meta":  # a prediction (fake parameters): nothing to copy, no storage to follow
            host.copy_(param.detach())
            self._synced[id(param)] = _Synced(param)
        host.requires_grad_(param.requires_grad)
        self._pairs.append((param, host))
        _OFFLOADERS[param] = weakref.ref(self)
        if self.offload_gradients and param.requires_grad:
            self._hook(param, host)
        # every gradient ends on the host (at step() where no hook moved it): torch's clipping and
        # model.zero_grad() reach it there
        hold_gradient_elsewhere(param, host)
        return host

    def _hook(self, param: torch.Tensor, host: torch.Tensor) -> None:
        self._handles.append(param.register_post_accumulate_grad_hook(_GradToHost(weakref.ref(self), host)))
        self._hooked.add(id(param))

    def _hooks_first(self) -> None:
        """Put memtrim's gradient hook before the user's on each parameter: where a user's hook reads ``.grad``,
        memtrim's then brings back the part an earlier micro-batch moved to the host (a read of ``param_groups``
        between micro-batches moves it) before the user's hook runs (autograd calls the hooks in the dict's order;
        the handles stay valid, they remove by key)."""
        for param, _ in self._pairs:
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            if hooks is None or len(hooks) < 2:
                continue
            mine = [k for k, h in hooks.items() if isinstance(h, _GradToHost) and h.owner() is self]
            if mine and next(iter(hooks)) != mine[0]:
                rest = [(k, h) for k, h in hooks.items() if k not in mine]
                for k, _ in rest:
                    del hooks[k]
                hooks.update(rest)

    def _hook_unfrozen(self) -> None:
        """Gradient hooks for the parameters frozen when the wrapper was built and trained since (their gradients
        reach the host in backward from now on, as the others' do)."""
        if not self.offload_gradients or self.host.type == "meta" or getattr(self, "_removed", False):
            return
        for device_param, host_param in self._pairs:
            if device_param.requires_grad and id(device_param) not in self._hooked:
                host_param.requires_grad_(True)
                self._hook(device_param, host_param)

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """The host optimizer's (a fused one's): a ``GradScaler`` then hands ``grad_scale`` and ``found_inf`` to
        :meth:`step`, which passes them on, so that the fused kernel unscales as in the standard loop (dividing by the
        scale; ``unscale_`` multiplies by its reciprocal)."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The host optimizer's ``param_groups`` (read and set through to it); their params are the host copies, so
        gradients still on the device move to them first (NOTE [ offloaded optimizer state ]): all of them with
        ``offload_gradients=False``, those of parameters unfrozen since the last step otherwise."""
        self._gradients_to_host(mid_step=True)
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    # NOTE [ a gradient with a graph stays on the device ]
    # A backward with create_graph=True leaves gradients with a graph, which the standard loop reads after backward
    # (a penalty on p.grad, a backward through it): they wait on the device, through later micro-batches of the step
    # too, until step() or a param_groups read moves them (read param_groups after the penalty: before it, the
    # penalty finds .grad None, as the README says).
    @torch.no_grad()
    def _gradients_to_host(self, mid_step: bool = False) -> None:
        """Every gradient waiting on the device to its host copy. ``mid_step`` (a ``param_groups`` read, which may
        come between micro-batches): a parameter without memtrim's gradient hook (``offload_gradients=False``, or
        unfrozen since the last step) gets a one-shot hook that brings the moved part back to the device at its next
        gradient, so the micro-batches still sum in the standard loop's order, (g1 + g2) + g3: summed on the device
        from g2 on and added to the host's g1 at step(), it was g1 + (g2 + g3), a rounding apart (found by an
        adversarial pass on 2026-11-29)."""
        for device_param, host_param in getattr(self, "_pairs", ()):
            if device_param.grad is not None:
                _check_unchanged_layout(device_param, host_param)
                add_to_holder(host_param, device_param.grad)
                device_param.grad = None
                if mid_step and id(device_param) not in self._hooked and id(device_param) not in self._parts_back:
                    hook = _PartBack(weakref.ref(self), host_param)
                    handle = device_param.register_post_accumulate_grad_hook(hook)
                    # before a user's hook, which reads .grad (deleted and added again: autograd calls them in the
                    # dict's own order, which OrderedDict.move_to_end does not change; found by an adversarial pass)
                    hooks = device_param._post_accumulate_grad_hooks
                    rest = [(k, h) for k, h in hooks.items() if k != handle.id]
                    for k, _ in rest:
                        del hooks[k]
                    hooks.update(rest)
                    self._parts_back[id(device_param)] = handle
        wait_for_copies()  # the callers read the host gradients next: the copies (these, and the hooks') have landed

    def _drop_parts_back(self) -> None:
        """Remove the one-shot hooks :meth:`_gradients_to_host` set that did not fire (no backward came after)."""
        for handle in self._parts_back.values():
            handle.remove()
        self._parts_back.clear()

    @property
    def state(self) -> Any:  # the host optimizer's, keyed by device params
        """The host optimizer's state, keyed by the device parameters (as a plain optimizer's is). Writes reach it:
        ``opt.state[p] = {}``, ``del opt.state[p]`` and ``opt.state.clear()`` reset a parameter's state, and so does
        assigning ``opt.state = defaultdict(dict)``."""
        return _StateByDeviceParameter(self.optimizer.state, self._pairs)

    @state.setter
    def state(self, value: Any) -> None:
        state = _StateByDeviceParameter(defaultdict(dict), self._pairs)
        for param, per_param in dict(value).items():
            state[param] = per_param
        self.optimizer.state = state.inner

    def host_parameters(self) -> list[torch.Tensor]:
        """The host copies, in the order of the device parameters (their ``.grad`` after an offloaded backward)."""
        return [h for _, h in self._pairs]

    def device_parameters(self) -> list[torch.Tensor]:
        """The parameters it trains (the model's), in the order of their host copies."""
        return [p for p, _ in self._pairs]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Move any gradient still on the device to the host, step the host optimizer, copy the parameters back."""
        if closure is not None:
            raise InvalidInputError(f"{_API}.step: closures are not supported (the step runs on host copies).")
        if any(p.device.type == "cuda" for p, _ in self._pairs):
            # the last step's copies back to the device (which read the host copies this step writes) and the
            # gradients' copies to the host (which it reads) have finished
            torch.cuda.synchronize()
        for device_param, host_param in self._pairs:
            _check_unchanged_layout(device_param, host_param)
        self._check_no_model_parameter_in_the_groups()
        self._to_host()
        self._check_no_gradient_written_after_backward()
        self._gradients_to_host()
        # a GradScaler stepping a fused optimizer sets these on this object (GradScaler.step): the host one reads them
        scaling = {k: self.__dict__[k] for k in ("grad_scale", "found_inf") if k in self.__dict__}
        for name, value in scaling.items():
            setattr(self.optimizer, name, value.to(self.host) if isinstance(value, torch.Tensor) else value)
        self._place_step_hooks()
        try:
            self.optimizer.step()  # (runs the step hooks: NOTE [ step hooks see the model's parameters ])
        finally:
            for name in scaling:
                self.optimizer.__dict__.pop(name, None)
        used_by_a_step(host for _, host in self._pairs)  # (a clip of other parameters no longer misses them)
        if self.host.type != "meta":  # a host copy a user's post-hook wrote (through param_groups) reaches the model
            for device_param, host_param in self._pairs:
                if host_param._version != self._host_synced.get(id(device_param)):
                    self._copy_back(device_param, host_param)
        self._hook_unfrozen()
        self._hooks_first()
        self._deferred.clear()
        self._drop_parts_back()

    # NOTE [ step hooks see the model's parameters ]
    # Step hooks (the user's on this optimizer or the host one, and torch's global ones) run inside the host
    # optimizer's step(). As in the standard loop, a post-hook must find the model's parameters stepped (an EMA, a
    # clamp, a checkpoint): memtrim's copy back is the first post-hook (placed at each step: hooks registered since,
    # or dropped by pickling, are put in order), and a host copy a later post-hook writes (through
    # ``param_groups``) is copied back after them. A pre-hook runs after the parameters went to the host: it writes
    # the host copies (``param_groups``) for the step to see them (a write to the model's parameters there is not
    # seen: a registered last pre-hook that copied them made torch's hook loop fail where a user's pre-hook removes
    # itself).
    def _place_step_hooks(self) -> None:
        hooks = cast("OrderedDict[int, Any]", self.optimizer._optimizer_step_post_hooks)
        mine = [k for k, h in hooks.items() if isinstance(h, _StepSync) and h.owner() is self]
        if not mine:
            self.optimizer.register_step_post_hook(_StepSync(weakref.ref(self)))
            mine = [next(reversed(hooks))]
        hooks.move_to_end(mine[0], last=False)

    def _to_host(self) -> None:
        """Parameters changed on the device outside the optimizer (NOTE [ offloaded optimizer state ]) to the host."""
        if self.host.type == "meta":  # a prediction keeps the state on meta: nothing to copy
            return
        for device_param, host_param in self._pairs:
            if not self._synced[id(device_param)].holds(device_param):
                host_param.copy_(device_param)
                self._synced[id(device_param)] = _Synced(device_param)

    def _to_device(self) -> None:
        """The stepped host copies back to the model's parameters; a model parameter written since the step began
        (a step pre-hook's projection or clamp, which the step did not see) is refused first."""
        if self.host.type == "meta":
            return
        for device_param, _ in self._pairs:
            if not self._synced[id(device_param)].holds(device_param):
                raise MemtrimStateError(
                    f"{_API}.step: expected the model's parameters unchanged while the host optimizer steps, but one "
                    f"of shape {tuple(device_param.shape)} was written after the step began (a step pre-hook: a "
                    "projection, a clamp). The step ran on the host copies, so the write would be lost (the standard "
                    "loop steps from it). To fix: in a pre-hook, write the host copies, the parameters the hook's "
                    "optimizer.param_groups hold; or write the model's parameters before calling step()."
                )
        for device_param, host_param in self._pairs:
            self._copy_back(device_param, host_param)

    def _copy_back(self, device_param: torch.Tensor, host_param: torch.Tensor) -> None:
        device_param.copy_(host_param, non_blocking=True)
        self._synced[id(device_param)] = _Synced(device_param)
        self._host_synced[id(device_param)] = host_param._version

    def _check_no_model_parameter_in_the_groups(self) -> None:
        """A parameter this optimizer has a host copy of, appended to ``param_groups`` itself (found by an
        adversarial pass on 2026-11-29: torch steps a parameter listed twice twice; here its gradient had gone to
        the host copy, so the appended entry was skipped, silently)."""
        paired = {id(p) for p, _ in self._pairs}
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                if id(param) in paired:
                    raise InvalidInputError(
                        f"{_API}.step: param_groups lists a model parameter of shape {tuple(param.shape)} that this "
                        "optimizer already steps through its host copy (param_groups holds the host copies): torch "
                        "would step a parameter listed twice twice; here the second entry would find no gradient. "
                        "Give each parameter once; to add new parameters use opt.add_param_group({'params': [...]})."
                    )

    def _check_no_gradient_written_after_backward(self) -> None:
        """A gradient on a parameter whose hook already moved backward's gradient to the host was written there by
        hand after backward (``p.grad = projected``): the standard loop's step would use what was written, which may
        replace or build on the gradient backward made; here code reading ``p.grad`` after backward found None."""
        for device_param, host_param in self._pairs:
            if (device_param.grad is not None and host_param.grad is not None and id(device_param) in self._hooked
                    and id(device_param) not in self._deferred):
                raise MemtrimStateError(
                    f"{_API}.step: expected the gradients of a step to come from backward, but a parameter of shape "
                    f"{tuple(device_param.shape)} has a .grad written after backward had moved its gradient to the "
                    "host (gradient surgery: p.grad = ...). Code that reads p.grad after backward finds None here, "
                    "so what it wrote cannot be what the standard loop's step would use. To fix: build the wrapper "
                    "with offload_gradients=False (gradients stay on the parameters until step()), or edit the host "
                    "gradients (opt.host_parameters()[i].grad)."
                )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients on the host and on the device."""
        wait_for_copies()  # no copy may land in a gradient after it was cleared
        self._hook_unfrozen()
        self._hooks_first()
        self._deferred.clear()
        self._drop_parts_back()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for device_param, _ in self._pairs:
            if device_param.grad is not None:
                if set_to_none:
                    device_param.grad = None
                else:  # as torch's zero_grad: a gradient with a graph (create_graph=True) is detached first
                    if device_param.grad.grad_fn is not None:
                        device_param.grad.detach_()
                    else:
                        device_param.grad.requires_grad_(False)
                    device_param.grad.zero_()
        # (a host gradient zeroed in place moved its version: it holds nothing to wait for a step; found by an
        # adversarial pass, a GAN's discriminator norm refused at each step after zero_grad(set_to_none=False))
        used_by_a_step(host for _, host in self._pairs)

    def state_dict(self) -> dict[str, Any]:
        """The host optimizer's state_dict (loadable into the plain optimizer of the same class)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state_dict of the plain optimizer (or of this one) into the host optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def remove(self) -> None:
        """Remove the gradient hooks (the device parameters keep their values). Gradients waiting on the host go back
        to their parameters: a step of another optimizer after ``remove()`` in the middle of a step (a plain one
        taking over) steps the whole gradient, as the standard loop would (the host part was lost: 0.139 off, found
        by an adversarial pass on 2026-11-29)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._hooked.clear()
        self._drop_parts_back()
        self._removed = True  # no hooks again at a later step() or zero_grad()
        self._guarding.release()
        wait_for_copies()
        for device_param, host_param in self._pairs:
            hold_gradient_elsewhere(device_param, None)
            held = host_param.grad
            if held is None or self.host.type == "meta":
                continue
            with torch.no_grad():
                if device_param.grad is None:
                    device_param.grad = held.to(device_param.device, copy=True)
                else:
                    device_param.grad.add_(held.to(device_param.device))  # (two parts: either order, the same bits)
            host_param.grad = None


def _let_go(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A dropped CPUOffloadOptimizer's device parameters hold their own gradients again (no longer its host copies)."""
    for device_param, host_param in pairs:
        if registered_holder(device_param) is host_param:
            hold_gradient_elsewhere(device_param, None)


_OFFLOADERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # device parameter -> weakref to its CPUOffloadOptimizer


_STEP_GUARD: list[Any] = []  # the handle of the global step pre-hook while a CPUOffloadOptimizer is live
_STEP_GUARD_USERS = [0]  # how many CPUOffloadOptimizers are live (built, neither removed nor collected)


class _StepGuardUse:
    """One CPUOffloadOptimizer's use of the global optimizer step pre-hook: another optimizer stepping a parameter
    whose gradients a live CPUOffloadOptimizer's hooks take (an old one still held by an LR scheduler after a
    resume) would find them gone and step nothing, silently. The hook is installed while one is live and removed
    with the last (at ``remove()`` or when collected): a global hook left behind made ``torch.compile`` of any
    other optimizer's step break its graph at it (found by an adversarial pass on 2026-12-02)."""

    __slots__ = ("released",)

    def __init__(self) -> None:
        self.released = False
        _STEP_GUARD_USERS[0] += 1
        if not _STEP_GUARD:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _STEP_GUARD.append(register_optimizer_step_pre_hook(_refuse_a_second_optimizer))

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        _STEP_GUARD_USERS[0] -= 1
        if _STEP_GUARD_USERS[0] == 0 and _STEP_GUARD:
            _STEP_GUARD.pop().remove()


def _refuse_a_second_optimizer(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not _OFFLOADERS:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            owner = live_offloader(param)
            if owner is not None and owner.optimizer is not optimizer:
                raise MemtrimStateError(
                    f"{_API}: {type(optimizer).__name__}.step() steps a parameter of shape {tuple(param.shape)} "
                    "whose gradients a CPUOffloadOptimizer that is still alive (held by an LR scheduler, a list, a "
                    "variable) moves to its own host copies: this optimizer finds them gone and would step nothing. "
                    "Call old_opt.remove() (or drop every reference to it) before training with another optimizer."
                )


def live_offloader(param: Any) -> CPUOffloadOptimizer | None:
    """The CPUOffloadOptimizer whose gradient hooks are on ``param`` and still run (alive, not removed), if any."""
    ref = _OFFLOADERS.get(param) if isinstance(param, torch.Tensor) else None
    owner = ref() if ref is not None else None
    if owner is None or getattr(owner, "_removed", False) or id(param) not in owner._hooked:
        return None
    return owner


def _described(value: Any) -> str:
    if isinstance(value, torch.optim.Optimizer):
        return f"a {type(value).__name__} instance (pass the class and its options instead)"
    return repr(value)


class _Synced:
    """A parameter as last copied: its version counter (written in place), its address and its storage (given new
    data, ``p.data = t``). The storage is held weakly (a strong reference would keep the replaced data alive) and
    compared by identity: two ``p.data = ...`` in a row often land the second at the address the first freed, which
    was the one recorded, and the step ran on the stale host copy, silently (found by an adversarial pass on
    2026-12-02)."""

    __slots__ = ("version", "address", "storage")

    def __init__(self, param: torch.Tensor) -> None:
        self.version, self.address, self.storage = param._version, param.data_ptr(), _storage_ref(param)

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is unchanged since."""
        if param._version != self.version or param.data_ptr() != self.address:
            return False
        return self.storage is None or self.storage() is _storage(param)


def _storage(param: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return param.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without one
        return None


def _storage_ref(param: torch.Tensor) -> weakref.ref | None:
    storage = _storage(param)
    return None if storage is None else weakref.ref(storage)


def _check_unchanged_layout(device_param: torch.Tensor, host_param: torch.Tensor) -> None:
    if (device_param.dtype, device_param.shape) != (host_param.dtype, host_param.shape):
        raise MemtrimStateError(
            f"{_API}: a parameter changed from {host_param.dtype} {tuple(host_param.shape)} to {device_param.dtype} "
            f"{tuple(device_param.shape)} after the optimizer was built (model.to(dtype) or a new p.data?); its host "
            "copy and state are of the old one. Build the optimizer after converting the model."
        )
    if device_param.stride() != host_param.stride() and \
            torch.empty_like(device_param, device="meta").stride() != host_param.stride():
        # (a parameter whose strides no tensor of its own keeps, a slice with gaps, has a contiguous copy)
        raise MemtrimStateError(
            f"{_API}: a parameter of shape {tuple(device_param.shape)} changed its memory layout from strides "
            f"{host_param.stride()} to {device_param.stride()} after the optimizer was built "
            "(model.to(memory_format=torch.channels_last)?); its host copy and state keep the old one, and a fused "
            "step would pair its elements with the gradient's wrongly. Build the optimizer after converting the model."
        )


class _StepSync:
    """memtrim's first step post-hook on the host optimizer: the copy back (NOTE [ step hooks see the model's
    parameters ])."""

    __slots__ = ("owner",)

    def __init__(self, owner: weakref.ref) -> None:
        self.owner = owner

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        owner = self.owner()
        if owner is not None:
            owner._to_device()


class _HostCopyHook:
    """A post-accumulate-grad hook of a device parameter, between it and its host copy (its wrapper weakly held)."""

    __slots__ = ("owner", "host_param")

    def __init__(self, owner: weakref.ref, host_param: torch.Tensor) -> None:
        self.owner = owner
        self.host_param = host_param


class _PartBack(_HostCopyHook):
    """A one-shot post-accumulate-grad hook (:meth:`CPUOffloadOptimizer._gradients_to_host`): the part of the
    gradient a ``param_groups`` read moved to the host comes back into the parameter's new gradient, which then
    accumulates the later micro-batches on the device as in the standard loop."""

    __slots__ = ()

    def __call__(self, param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is None:
            return
        handle = owner._parts_back.pop(id(param), None)
        if handle is not None:
            handle.remove()
        held = self.host_param.grad
        if held is None or param.grad is None:
            return
        wait_for_copies()
        with torch.no_grad():
            param.grad.add_(held.to(param.device))  # (g2 + g1 is g1 + g2, bit for bit)
        self.host_param.grad = None


class _GradToHost(_HostCopyHook):
    """A post-accumulate-grad hook: the gradient goes to the host copy and is freed on the device."""

    __slots__ = ()

    def __call__(self, param: torch.Tensor) -> None:
        owner = self.owner()
        if owner is None or param.grad is None:
            return
        if _distributed_world() > 1:  # the process group started after this optimizer was built
            raise _offload_across_ranks_error(_distributed_world(), MemtrimStateError)
        # a user's hook reads .grad (before ours or after): under accumulation it must find the sum of the
        # micro-batches; a gradient with a graph (grad on in backward: create_graph=True) is read after backward (a
        # penalty on it, a backward through it), also after later micro-batches of the step (NOTE [ a gradient
        # with a graph stays on the device ]). So the gradient waits on the device (moved at step() or
        # param_groups); an earlier micro-batch's part, moved before, comes back to it
        if users_hook_on(param) or torch.is_grad_enabled() or id(param) in owner._deferred:
            owner._deferred.add(id(param))
            held = self.host_param.grad
            if held is not None:
                wait_for_copies()
                with torch.no_grad():
                    param.grad.add_(held.to(param.device))
                self.host_param.grad = None
            return
        _check_unchanged_layout(param, self.host_param)
        with torch.no_grad():
            add_to_holder(self.host_param, param.grad)
        param.grad = None

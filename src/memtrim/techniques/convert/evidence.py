"""What :func:`memtrim.convert` decides on: a traced model (:class:`ModelTrace`).

NOTE [ convert's evidence ]
One interface, two ways to fill it:

* **Traced** (``example_inputs`` given): one training-mode forward on clones of the example inputs, under a
  ``TorchDispatchMode`` (every aten op: name, the storages it reads, writes in place and returns, its non-tensor
  arguments), module pre/post hooks (every *call site*: module path and call index, so a module the forward calls
  three times has three sites) and ``saved_tensors_hooks`` (every tensor autograd keeps: its storage and the call
  sites running when it was saved). The same collector runs on fake or meta tensors (it reads no values).
* **fx** (no example inputs): ``torch.fx.symbolic_trace``'s graph, where the model traces. Call sites are the
  ``call_module`` nodes, a storage is one node's output, readers are its users. Nothing says what autograd keeps
  (``saves_known`` is False), so rules that need holders skip, and nothing is measured.

Storages are keyed by ``id(untyped_storage())`` (the trace keeps them alive, so ids stay unique). Views share
their base's key; that is what "the same tensor" means for memory. Tracing draws no random numbers from the
user's generators and leaves buffers (BatchNorm's running statistics) as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.nn.parameter import is_lazy
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import InvalidInputError
from ...measure.hooks import tensors_in
from .._generators import seeded
from .._modes import set_training_flags, training_flags

__all__ = [
    "CallSite", "Holder", "ModelTrace", "Op", "Storage", "VIEW_OPS", "buffers_kept", "collect", "fresh_inputs",
    "fx_evidence", "split_inputs",
]

# ops that move no data of their own (a view, a copy into the same layout, an alias): rules look through them
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "contiguous", "clone", "as_strided", "split", "unbind", "lift_fresh",
    "_reshape_alias", "flatten", "view_as", "expand_as", "lift_fresh_copy", "split_with_sizes",
})
"""Aten op names that move no data of their own: :meth:`ModelTrace.ops_in` leaves them out of a call's compute ops."""


@dataclass
class Op:
    """One aten op of the forward (overload packet name, ``relu_`` and ``relu`` kept apart)."""

    index: int
    name: str
    time: int
    stack: tuple[int, ...]  # call sites running, outermost first
    inputs: tuple[int, ...]  # storage keys of its tensor arguments, in order
    outputs: tuple[int, ...]
    writes: tuple[int, ...]  # storages it changes in place
    scalars: tuple[Any, ...] = ()  # its non-tensor positional arguments (an eps, a dim list)
    random: bool = False  # it drew from a generator (an op aten tags ``nondeterministic_seeded``, which did draw)

    @property
    def site(self) -> int | None:
        """The innermost call site running it (None: the top-level code of the model's forward)."""
        return self.stack[-1] if self.stack else None


@dataclass
class CallSite:
    """One call of one module: ``path`` (its first name in ``named_modules``) and ``call`` (0 for the first call)."""

    index: int
    path: str
    call: int
    module: nn.Module
    parent: int | None
    start: int
    end: int = -1
    first_op: int = 0
    last_op: int = 0  # ops[first_op:last_op] ran inside it (nested calls included)
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    shared: bool = False  # the module has more than one call site
    replaced: tuple[str, ...] = ()  # its own tensors the call assigned anew from their values (``self.count += 1``)
    input_shapes: tuple[tuple[int, ...], ...] = ()  # the shapes of its tensor arguments, in order
    input_dtypes: tuple[torch.dtype, ...] = ()  # and their dtypes

    @property
    def label(self) -> str:
        """``path`` for a module called once, ``path#k`` for its k-th call (from 0) otherwise."""
        return f"{self.path}#{self.call}" if self.shared else self.path


@dataclass(frozen=True)
class Holder:
    """A save for backward: the call sites running when autograd saved the storage (innermost last)."""

    stack: tuple[int, ...]
    time: int

    @property
    def site(self) -> int | None:
        """The innermost call site running when autograd saved the storage (None: the model's top-level code)."""
        return self.stack[-1] if self.stack else None


@dataclass
class Storage:
    """One storage: its bytes, what it is, the op that made it, and every save for backward of it."""

    key: int
    nbytes: int
    kind: str  # "parameter", "buffer", "input" or "activation"
    producer: int | None = None  # index of the op that first returned it
    holders: list[Holder] = field(default_factory=list)


class ModelTrace:
    """The evidence interface (NOTE [ convert's evidence ]): call sites, ops, storages and their holders.

    Attributes:
        kind: ``"traced"`` (a forward on example inputs) or ``"fx"`` (a torch.fx graph: no holders, no values).
        saves_known: whether ``Storage.holders`` says what autograd keeps.
    """

    kind = "traced"
    saves_known = True

    def __init__(self, names: dict[int, str]) -> None:
        self.names = names  # id(module) -> its first name
        self.sites: list[CallSite] = []
        self.ops: list[Op] = []
        self.storages: dict[int, Storage] = {}
        self.by_path: dict[str, list[CallSite]] = {}
        self._keep: list[Any] = []  # storages stay alive, so their ids stay unique
        self.collectives: list[str] = []  # torch.distributed ops the forward ran (c10d.allreduce_, ...)

    # ------------------------------------------------------------------ filling
    def storage_key(self, t: torch.Tensor, kind: str = "activation") -> int:
        """The key of ``t``'s storage, recorded as a :class:`Storage` of ``kind`` the first time it is seen."""
        storage = t.untyped_storage()
        key = id(storage)
        if key not in self.storages:
            self._keep.append(storage)
            self.storages[key] = Storage(key, storage.nbytes(), kind)
        return key

    # ------------------------------------------------------------------ queries
    def sites_of(self, path: str) -> list[CallSite]:
        """The call sites of the module named ``path`` (one per call, in call order)."""
        return self.by_path.get(path, [])

    def site_name(self, index: int | None) -> str:
        """The module path of call site ``index`` ("" for None: the model's top-level code)."""
        return "" if index is None else self.sites[index].path

    def stack_names(self, stack: Sequence[int]) -> tuple[str, ...]:
        """The module paths of the call sites in ``stack``, outermost first."""
        return tuple(self.sites[i].path for i in stack)

    def leaf(self, site: CallSite) -> bool:
        """Whether no other call ran inside ``site``."""
        return site.index not in self._once("parents", len(self.sites), lambda: {s.parent for s in self.sites})

    def _once(self, name: str, size: Any, make: Callable[[], Any]) -> Any:
        """``make()``, made once per ``size`` of the trace (queried once it is complete): rules ask about every call
        site, and scanning every call, op or storage for each made convert's time grow with the square of the
        model's depth."""
        found = self.__dict__.get(f"_once_{name}")
        if found is None or found[0] != size:
            found = self.__dict__[f"_once_{name}"] = (size, make())
        return found[1]

    def writers(self) -> list[Op]:
        """The ops that write a storage in place, in order."""
        return self._once("writers", len(self.ops), lambda: [op for op in self.ops if op.writes])

    def reads_after(self, keys: Iterable[int], after: int) -> list[Op]:
        """The ops that read any of the storages ``keys`` after time ``after``, in order."""
        def make() -> dict[int, list[int]]:
            found: dict[int, list[int]] = {}
            for i, op in enumerate(self.ops):
                for key in set(op.inputs):
                    found.setdefault(key, []).append(i)
            return found

        index = self._once("readers", len(self.ops), make)
        return [self.ops[i] for i in sorted({i for k in keys for i in index.get(k, ())}) if self.ops[i].time > after]

    def held_inside(self, site: CallSite) -> list[int]:
        """The storages saved at least once while ``site`` ran."""
        def make() -> dict[int, list[int]]:
            inside: dict[int, list[int]] = {}
            for key, record in self.storages.items():
                for index in {i for h in record.holders for i in h.stack}:
                    inside.setdefault(index, []).append(key)
            return inside

        return self._once("held_inside", (len(self.sites), len(self.storages)), make).get(site.index, [])

    def ops_in(self, site: CallSite, *, compute_only: bool = True) -> list[Op]:
        """The ops that ran inside ``site`` (nested calls included), views and copies left out by default."""
        ops = self.ops[site.first_op:site.last_op]
        return [o for o in ops if o.name not in VIEW_OPS and o.name != "_to_copy"] if compute_only else ops

    def readers(self, key: int, after: int) -> Iterator[Op]:
        """The ops that read storage ``key`` after time ``after``."""
        return iter(self.reads_after((key,), after))

    def holders_outside(self, key: int, site: CallSite) -> list[Holder]:
        """The saves of storage ``key`` made outside ``site`` (and outside its ancestors' own code)."""
        return [h for h in self.storages[key].holders if site.index not in h.stack]

    def written_after(self, path: str) -> str | None:
        """Where ``path``'s output is changed in place after its forward returned (the innermost module, "" for the
        top-level forward), or None if it never is."""
        for site in self.sites_of(path):
            writer = self.written_after_call(site)
            if writer is not None:
                return writer
        return None

    def written_after_call(self, site: CallSite, keys: tuple[int, ...] | None = None) -> str | None:
        """Where call ``site``'s output (or the storages ``keys``) is changed in place after it returned (as
        :meth:`written_after`), or None."""
        written = set(site.outputs if keys is None else keys)
        for op in self.writers():
            if op.time > site.end and set(op.writes) & written:
                return self.site_name(op.site)
        return None

    def inputs_written_after(self, path: str) -> str | None:
        """Where a tensor a call of ``path`` took as an argument is changed in place after the call (as
        :meth:`written_after`), or None."""
        for site in self.sites_of(path):
            writer = self.written_after_call(site, site.inputs)
            if writer is not None:
                return writer
        return None

    def keepers(self, path: str) -> list[str]:
        """The innermost modules in whose forward autograd saved ``path``'s output (its own ancestors' code
        excluded: no module there whose saved-tensor hooks could reach it)."""
        found: set[str] = set()
        for site in self.sites_of(path):
            for key in site.outputs:
                for h in self.storages[key].holders:
                    name = self.site_name(h.site)
                    if h.time > site.end and h.stack and not _is_self_or_ancestor(name, path):
                        found.add(name)
        return sorted(found)

    def pair_after(self, path: str) -> tuple[str, str] | None:
        """``(consumer, reason)``: the one module that reads ``path``'s output (reason "" if that is all that reads
        it), or None when there is no evidence (the output is never read)."""
        sites = self.sites_of(path)
        if not sites:
            return None
        if len(sites) != 1:
            first = self._pair_at(path, sites[0])
            if first is not None and first[1] and "times per forward" not in first[1]:  # (why at its first call)
                return first[0], f"{first[1]} (at the first of its {len(sites)} calls per forward)"
            return path, f"{path} runs {len(sites)} times per forward; its calls cannot be fused one by one"
        return self._pair_at(path, sites[0])

    def _pair_at(self, path: str, site: CallSite) -> tuple[str, str] | None:
        """:meth:`pair_after` for one call ``site`` of ``path``."""
        outputs = set(site.outputs)
        reads = [(o.time, self.stack_names(o.stack)) for o in self.reads_after(outputs, site.end)]
        if not reads:
            return None
        first_stack = reads[0][1]
        consumer = first_stack[-1] if first_stack else ""
        if _is_self_or_ancestor(consumer, path):
            return "", f"{path}'s output is used by its parent's own code, not by a module"
        consumer_sites = self.sites_of(consumer)
        if len(consumer_sites) != 1:
            return consumer, f"{consumer} runs {len(consumer_sites)} times per forward"
        c = consumer_sites[0]
        if set(c.outputs) & outputs:  # an in-place consumer: later reads are of its own output
            reads = [(t, st) for t, st in reads if t <= c.end]
        for _, stack in reads:
            if consumer not in stack:
                reader = stack[-1] if stack else "the top-level forward"
                return consumer, f"{path}'s output is also read outside {consumer} (in {reader or 'a parent module'})"
        return consumer, ""


def _is_self_or_ancestor(entry: str, name: str) -> bool:
    return entry == "" or entry == name or name.startswith(entry + ".")


# ---------------------------------------------------------------------- the traced collector
class _Recorder(TorchDispatchMode):
    def __init__(self, trace: ModelTrace, state: _State) -> None:
        super().__init__()
        self.trace, self.state = trace, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        before = _generator_states((args, kwargs)) if seeded else None
        # (the output too, after: a factory's, fake in a plan's trace, says what the arguments cannot)
        out = func(*args, **kwargs)
        # an op aten says may draw did draw: it took an explicit generator, or a default generator moved (an
        # attention kernel tagged for its dropout does not draw with dropout_p=0)
        drew = seeded and (before is None or before != _generator_states((args, kwargs, out)))
        trace, state = self.trace, self.state
        state.clock += 1
        inputs = tuple(trace.storage_key(t) for t in tensors_in((args, kwargs)))
        outputs = tuple(trace.storage_key(t) for t in tensors_in(out))
        writes: list[int] = []
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    writes += [trace.storage_key(t) for t in tensors_in(value)]
        scalars = tuple(a for a in args if isinstance(a, (int, float, bool, list, tuple)) and not tensors_in(a))
        index = len(trace.ops)
        for key in outputs:
            record = trace.storages[key]
            if record.producer is None and record.kind == "activation":
                record.producer = index
        if func.namespace in _COLLECTIVES:
            trace.collectives.append(f"{func.namespace}.{func.overloadpacket.__name__}")
        trace.ops.append(Op(index, func.overloadpacket.__name__, state.clock, tuple(state.stack), inputs, outputs,
                            tuple(writes), scalars, drew))
        return out


_COLLECTIVES = ("c10d", "_c10d_functional", "c10d_functional")  # the namespaces of torch.distributed's ops


def _generator_states(arguments: Any) -> list[bytes] | None:
    """The default generators' states (the CPU's, and every started CUDA device's: a factory call has no tensor
    saying its device), or None where they cannot tell: an explicit ``torch.Generator`` is passed (it draws from that
    one), or a tensor is fake or on ``meta`` (a plan's trace: nothing draws there, and the op counts as drawing, as
    it would)."""
    found: list[Any] = []
    torch.utils._pytree.tree_map(found.append, arguments)
    tensors = [a for a in found if isinstance(a, torch.Tensor)]
    if any(isinstance(a, torch.Generator) for a in found) or any(
            t.device.type == "meta" or hasattr(t, "fake_mode") for t in tensors):
        return None
    with torch._C._DisableTorchDispatch():  # (read as bytes: no op of a mode below sees the state tensors)
        states = [bytes(torch.get_rng_state().numpy())]
        if torch.cuda.is_initialized():
            states += [bytes(torch.cuda.get_rng_state(i).numpy()) for i in range(torch.cuda.device_count())]
    return states


class _State:
    """The traced forward in flight: a clock, the call sites running (outermost first), and the hooks that record
    call sites (module pre/post hooks) and saves for backward (a saved-tensor pack hook) into ``trace``."""

    def __init__(self, trace: ModelTrace) -> None:
        self.trace = trace
        self.clock = 0
        self.stack: list[int] = []
        self.open_sites: list[CallSite] = []
        self.counts: dict[str, int] = {}  # module path -> calls so far
        self.owned: list[dict[str, torch.Tensor]] = []  # per open call site: its module's own tensors at its start

    def pre(self, module: nn.Module, inputs: tuple, kw: dict) -> None:
        """Forward pre-hook: a call site opens."""
        trace = self.trace
        self.clock += 1
        path = trace.names[id(module)]
        site = CallSite(len(trace.sites), path, self.counts.get(path, 0), module,
                        self.stack[-1] if self.stack else None, self.clock, first_op=len(trace.ops),
                        inputs=tuple(trace.storage_key(t) for t in tensors_in((inputs, kw))))
        site.input_shapes = tuple(tuple(t.shape) for t in tensors_in((inputs, kw)))
        site.input_dtypes = tuple(t.dtype for t in tensors_in((inputs, kw)))
        self.counts[path] = site.call + 1
        trace.sites.append(site)
        trace.by_path.setdefault(path, []).append(site)
        self.stack.append(site.index)
        self.open_sites.append(site)
        self.owned.append(_own_tensors(module))

    def post(self, module: nn.Module, inputs: tuple, kw: dict, output: Any) -> None:
        """Forward hook: the innermost open call site closes."""
        self.clock += 1
        site = self.open_sites.pop()
        self.stack.pop()
        before, now = self.owned.pop(), _own_tensors(module)
        site.end, site.last_op = self.clock, len(self.trace.ops)
        # assigned anew from what it held (a counter, an average): a second run would update it again; a cache made
        # afresh at each call (``self.wt = self.weight.t()``) is made alike again
        read = {k for op in self.trace.ops[site.first_op:site.last_op] for k in op.inputs}
        site.replaced = tuple(sorted(name for name, old in before.items() if now.get(name) is not old
                                     and self.trace.storage_key(old) in read))
        site.outputs = tuple(self.trace.storage_key(t) for t in tensors_in(output))

    def saved(self, tensor: torch.Tensor) -> torch.Tensor:
        """Pack hook: autograd keeps ``tensor``, held by the call sites running now."""
        key = self.trace.storage_key(tensor)
        self.trace.storages[key].holders.append(Holder(tuple(self.stack), self.clock))
        return tensor.detach()


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each tensor ``module`` holds itself (parameters, buffers, plain tensor attributes), by name."""
    found = {name: t for name, t in (*module._parameters.items(), *module._buffers.items()) if t is not None}
    found.update((name, t) for name, t in module.__dict__.items() if isinstance(t, torch.Tensor))
    return found


def split_inputs(example_inputs: Any, example_kwargs: dict[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the model from a tensor, a tuple of arguments or a dict of keyword arguments."""
    if isinstance(example_inputs, dict):
        args: tuple[Any, ...] = ()
        kwargs = dict(example_inputs)
    elif isinstance(example_inputs, tuple):
        args, kwargs = example_inputs, {}
    elif example_inputs is None:
        args, kwargs = (), {}
    else:
        args, kwargs = (example_inputs,), {}
    if example_kwargs:
        kwargs.update(example_kwargs)
    return args, kwargs


def fresh_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Detached clones of the example tensors (a model may change its inputs in place)."""
    def fresh(a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a.detach().clone()
        if isinstance(a, (list, tuple)):
            return type(a)(fresh(x) for x in a) if type(a) in (list, tuple) else a
        if isinstance(a, dict):
            return {k: fresh(v) for k, v in a.items()}
        return a

    return tuple(fresh(a) for a in args), {k: fresh(v) for k, v in kwargs.items()}


class _ParametersWritten(TorchDispatchMode):
    """Copy-on-write of parameter values: the first in-place write to a parameter's storage clones it first (a
    forward that updates parameters, e.g. a momentum encoder's ``pk.data.mul_(m).add_(pq.data, alpha=1 - m)``).
    Parameters nobody writes are never copied. The clone runs with dispatch off: no tracker or recorder sees it."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.storages = [p.untyped_storage() for p in params]  # kept alive: their ids stay theirs
        self.data = {id(st): p.data for st, p in zip(self.storages, params)}
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # storage id -> (the data, its clone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                for t in tensors_in(args[i] if i < len(args) else kwargs.get(arg.name)):
                    key = id(t.untyped_storage())
                    if key in self.data and key not in self.saved:
                        with torch._C._DisableTorchDispatch():
                            self.saved[key] = (self.data[key], self.data[key].clone())
        return func(*args, **kwargs)

    def restore(self) -> None:
        for data, saved in self.saved.values():
            data.copy_(saved)


_ABSENT = object()
_SLOTS = ("_parameters", "_buffers", "_modules")  # put back by buffers_kept itself, entry by entry


def _attributes(obj: Any) -> dict[str, Any]:
    """``obj``'s attributes (a module's but its parameter, buffer and submodule tables), by name."""
    return {k: v for k, v in vars(obj).items() if k not in _SLOTS}


def _settings_objects(model: nn.Module) -> list[Any]:
    """The modules of ``model`` (but lazy ones, which their forward materialises) and the plain objects they hold
    (an HF ``config``, shared by many modules): what a forward may note values in."""
    found: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, LazyModuleMixin):
            continue
        found[id(module)] = module
        for value in vars(module).values():
            if (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type))
                    and not callable(value)):
                found.setdefault(id(value), value)
    return list(found.values())


class buffers_kept:  # noqa: N801 - a context manager read like a function
    """Snapshot ``model``'s buffers and restore them on exit, with every module's training mode (a frozen BatchNorm
    in a training model, dropout kept on in an evaluating one: ``model.train(mode)`` alone set them all). Parameters
    (and buffers) are restored too where the forward changes them: written in place (copied on the first write, see
    :class:`_ParametersWritten`), their ``.data`` replaced, or the module attribute reassigned. So are the other
    attributes a forward sets on its modules and their settings objects, each to the object it held (ones it added are
    removed): HF's dynamic RoPE notes the length its ``inv_freq`` buffer was grown for, ``max_seq_len_cached``; a
    dynamic-NTK rotary keeps its cache in plain tensor attributes; a classification head notes the ``problem_type``
    its first labels imply. Restoring a buffer without the value that describes it would leave a state neither model
    reaches. Objects changed in place (a list appended to) are not restored."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.training = self.model.training
        self.modes = training_flags(self.model.modules())
        self.buffers = [(b, b.clone()) for b in self.model.buffers()]
        # (lazy parameters are left alone: the forward materialises them, as it would without convert)
        self.slots = [(slots, name, t, t.data) for m in self.model.modules()
                      for slots in (m._parameters, m._buffers) for name, t in slots.items()
                      if t is not None and not is_lazy(t)]
        self.written = _ParametersWritten([p for p in self.model.parameters() if not is_lazy(p)])
        self.attributes = [(obj, _attributes(obj)) for obj in _settings_objects(self.model)]
        # the hook tables' entries too: a forward that registers a hook at its first call (setting torch's
        # _is_full_backward_hook, or a flag of its own, which are put back) must find none, as the model had
        self.hooks = [(table, list(table.items())) for m in self.model.modules() for k, table in vars(m).items()
                      if "_hooks" in k and isinstance(table, dict)]
        self.written.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.written.__exit__(*exc)
        with torch.no_grad():
            for slots, name, t, data in self.slots:
                slots[name] = t  # type: ignore[assignment]  # reassigned in forward (``self.queue = torch.cat(...)``)
                if t.untyped_storage()._cdata != data.untyped_storage()._cdata:
                    t.data = data  # ``.data`` replaced in forward (MoCo's ``pk.data = pk.data * m + ...``)
            self.written.restore()
            for b, saved in self.buffers:
                if b.shape != saved.shape:  # resized in forward (a quantization observer's min_val starts empty)
                    b.resize_(saved.shape)
                b.copy_(saved)
        for table, entries in self.hooks:
            if list(table.items()) != entries:
                table.clear()
                table.update(entries)
        for obj, values in self.attributes:
            state = vars(obj)
            for name in [k for k in _attributes(obj) if k not in values]:
                del state[name]  # set by the forward where there was none
            for name, value in values.items():
                if state.get(name, _ABSENT) is not value:
                    state[name] = value  # the object it held (a tensor cache, a length, a config's problem_type)
        self.model.train(self.training)  # a module's own train() runs, as it did before (it may do more)
        set_training_flags(self.modes)


def collect(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            api: str = "memtrim.convert") -> ModelTrace:
    """Trace one training-mode forward of ``model(*args, **kwargs)`` (NOTE [ convert's evidence ]); ``api`` names the
    caller in errors.

    Raises:
        InvalidInputError: the model fails on the example inputs.
    """
    trace = ModelTrace({id(m): n for n, m in model.named_modules()})
    state = _State(trace)
    for p in model.parameters():
        trace.storage_key(p, "parameter")
    for b in model.buffers():
        trace.storage_key(b, "buffer")
    args, kwargs = fresh_inputs(args, kwargs)
    for t in tensors_in((args, kwargs)):
        trace.storage_key(t, "input")
    handles = [m.register_forward_pre_hook(state.pre, prepend=True, with_kwargs=True) for m in model.modules()]
    handles += [m.register_forward_hook(state.post, with_kwargs=True, always_call=True) for m in model.modules()]
    try:
        with buffers_kept(model), seeded(model, args, kwargs):  # (the seeds of every forward convert runs)
            model.train()
            with torch.enable_grad(), _Recorder(trace, state), \
                    torch.autograd.graph.saved_tensors_hooks(state.saved, lambda t: t):
                model(*args, **kwargs)
    except Exception as e:
        hint = (
            f"{api.removeprefix('memtrim.')} traces a training-mode forward (what autograd keeps there), where "
            "BatchNorm needs more than one value per channel: pass example_inputs with a batch of at least 2"
            if "Expected more than 1 value per channel" in str(e) else
            f"{api.removeprefix('memtrim.')} traces the forward under saved-tensor hooks (to see what autograd keeps), "
            "and this torch refuses a torch.func transform there, which the model's forward runs (transformers' "
            "eager-attention mask calls vmap on torch 2.4; torch 2.11 takes it): use attn_implementation='sdpa', or a "
            "newer torch" if "don't yet support saved tensor hooks" in str(e) else
            ("A dict is passed as keyword arguments, model(**example_inputs): a forward that takes the dict as one "
             "argument needs example_inputs=(batch,). " if kwargs and not args else "")
            + "Pass a tensor, a tuple of arguments (model(*example_inputs)) or a dict of keyword arguments "
            "(model(**example_inputs))" if isinstance(e, TypeError) else
            # (not how the inputs were passed: the model's own error on them, a dtype its kernels lack; an adversarial
            # pass found the hint above quoted for a dict, under a float64 MoE's grouped-mm error)
            "Expected example inputs the model runs a training-mode forward on, as it is: the error is the model's own "
            "(run model(**example_inputs) in train mode to see it)"
        )
        raise InvalidInputError(
            f"{api}: the model failed on example_inputs ({type(e).__name__}: {e}). {hint}."
        ) from e
    finally:
        for h in handles:
            h.remove()
    for sites in trace.by_path.values():
        for s in sites:
            s.shared = len(sites) > 1
    return trace


# ---------------------------------------------------------------------- the fx graph behind the same interface
class FxTrace(ModelTrace):
    """Evidence from ``torch.fx.symbolic_trace``: module calls and who uses their outputs; no saves, no values."""

    kind = "fx"
    saves_known = False

    def __init__(self, names: dict[int, str], graph: Any, modules: dict[str, nn.Module]) -> None:
        super().__init__(names)
        self._users: dict[int, list[Any]] = {}
        for node in graph.nodes:
            if node.op == "call_module" and node.target in modules:
                path = node.target
                site = CallSite(len(self.sites), path, len(self.by_path.get(path, [])), modules[path], None,
                                len(self.sites), len(self.sites), outputs=(id(node),))
                self.sites.append(site)
                self.by_path.setdefault(path, []).append(site)
                self._users[site.index] = list(node.users)

    def keepers(self, path: str) -> list[str]:
        """The modules that take ``path``'s output as an input (any of them may keep it)."""
        return sorted({u.target for s in self.sites_of(path) for u in self._users[s.index] if u.op == "call_module"})

    def written_after(self, path: str) -> str | None:
        """Always None: fx sees no in-place writes of values (a backward check catches them instead)."""
        return None  # fx sees no in-place writes of values: a backward check catches them instead

    def inputs_written_after(self, path: str) -> str | None:
        """Always None, as :meth:`written_after`."""
        return None

    def pair_after(self, path: str) -> tuple[str, str] | None:
        """As :meth:`ModelTrace.pair_after`, from the graph's users of ``path``'s output."""
        sites = self.sites_of(path)
        if not sites:
            return None
        if len(sites) != 1:
            return path, f"{path} runs {len(sites)} times per forward; its calls cannot be fused one by one"
        users = self._users[sites[0].index]
        if len(users) != 1 or users[0].op != "call_module":
            return "", f"{path}'s output is used by {len(users)} operations, not by one module alone"
        consumer = users[0].target
        if len(self.sites_of(consumer)) != 1:
            return consumer, f"{consumer} runs {len(self.sites_of(consumer))} times per forward"
        return consumer, ""


def fx_evidence(model: nn.Module) -> FxTrace | None:
    """The fx evidence for ``model``, or None where it does not trace (control flow on values, unsupported ops). The
    trace runs the model's Python, which may write its buffers (timm's ``BatchNormAct2d`` counts
    ``num_batches_tracked`` in its own forward; found by an adversarial pass, every such count was 1 after convert):
    they are put back, as around convert's other forwards."""
    try:
        with buffers_kept(model):
            graph = torch.fx.symbolic_trace(model).graph
    except Exception:
        return None
    return FxTrace({id(m): n for n, m in model.named_modules()}, graph, dict(model.named_modules()))

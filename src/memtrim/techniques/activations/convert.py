"""``memtrim.convert``: swap in activations and norms that keep less, only where provably the same function and
nothing else uses the replaced tensor, and report what each change saved.

NOTE [ how convert decides ]
* Single modules (always the same function, whatever surrounds them): LeakyReLU (slope >= 0), ELU, CELU, SELU,
  Hardtanh, ReLU6, Hardsigmoid, Softplus, Sigmoid, Tanh become their ``memtrim.nn`` forms, which keep their
  output instead of their input; LayerNorm and RMSNorm become forms that keep their output.
* Pairs need evidence that the first module's output goes to the second module and nowhere else:
  BatchNorm -> LeakyReLU / ELU becomes ``BatchNormAct`` (+ ``nn.Identity``); BatchNorm -> ReLU becomes
  ``BatchNormReLU`` (+ ``nn.Identity``), with saved-tensor hooks on the modules reading the ReLU output so they
  keep a recipe instead (NOTE [ BatchNorm + ReLU, recomputed ]); GELU / SiLU / Mish / Hardswish ->
  Linear becomes ``nn.Identity`` + ``ActLinear``. The evidence is a traced forward on ``example_inputs``: every op
  is recorded with the storages it reads and the module whose forward runs it, so "the BatchNorm's output is read
  by the LeakyReLU and by nothing else" is checked, not assumed. Without example inputs the ``torch.fx`` graph
  gives the same evidence (a module call whose only user is the next module call) where the model traces;
  otherwise pairs are skipped.
* Modules are converted in place by changing their class to the memtrim subclass (same parameters, buffers,
  hooks and state_dict keys), so an optimizer built before ``convert`` keeps working.
* Savings are measured, not estimated: the activation bytes autograd keeps after a forward on the example
  inputs, measured by the tracker before and after each change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ...errors import InvalidInputError
from ...measure import format_bytes, track
from ...measure.tracker import tensors_in
from . import modules as lean
from .bn_relu import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d, install_recompute_hooks
from .norm_act import BatchNormAct1d, BatchNormAct2d, BatchNormAct3d
from .transformer import ActLinear, LayerNorm, RMSNorm

__all__ = ["Change", "ConversionReport", "Skipped", "convert"]


@dataclass(frozen=True)
class Change:
    """One module (or pair) converted, with the activation bytes it saved on the example inputs."""

    modules: tuple[str, ...]
    before: str
    after: str
    bytes_saved: int | None


@dataclass(frozen=True)
class Skipped:
    """A candidate left alone, and why."""

    modules: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert` changed and skipped; activation bytes kept after a forward, before and after."""

    changes: list[Change]
    skipped: list[Skipped]
    activation_bytes_before: int | None
    activation_bytes_after: int | None
    notes: list[str] = field(default_factory=list)

    @property
    def bytes_saved(self) -> int | None:
        if self.activation_bytes_before is None or self.activation_bytes_after is None:
            return None
        return self.activation_bytes_before - self.activation_bytes_after

    def __str__(self) -> str:
        lines = ["memtrim.convert"]
        if self.activation_bytes_before is not None:
            saved = self.bytes_saved or 0
            share = saved / self.activation_bytes_before if self.activation_bytes_before else 0.0
            lines.append(f"activations kept after forward: {self.activation_bytes_before:,} B -> "
                         f"{self.activation_bytes_after:,} B ({share:.0%} fewer)")
        for c in self.changes:
            saved = "" if c.bytes_saved is None else f": saves {c.bytes_saved:,} B ({format_bytes(c.bytes_saved)})"
            lines.append(f"  changed {' + '.join(c.modules)}: {c.before} -> {c.after}{saved}")
        for s in self.skipped:
            lines.append(f"  skipped {' + '.join(s.modules)}: {s.reason}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


_SINGLE: dict[type, type] = {
    nn.LeakyReLU: lean.LeakyReLU, nn.ELU: lean.ELU, nn.CELU: lean.CELU, nn.SELU: lean.SELU,
    nn.Hardtanh: lean.Hardtanh, nn.ReLU6: lean.ReLU6, nn.Hardsigmoid: lean.Hardsigmoid,
    nn.Softplus: lean.Softplus, nn.Sigmoid: lean.Sigmoid, nn.Tanh: lean.Tanh, nn.LayerNorm: LayerNorm,
}
if hasattr(nn, "RMSNorm"):
    _SINGLE[nn.RMSNorm] = RMSNorm
_BN_ACT = {nn.BatchNorm1d: BatchNormAct1d, nn.BatchNorm2d: BatchNormAct2d, nn.BatchNorm3d: BatchNormAct3d}
_BN_RELU = {nn.BatchNorm1d: BatchNormReLU1d, nn.BatchNorm2d: BatchNormReLU2d, nn.BatchNorm3d: BatchNormReLU3d}
_ACT_LINEAR = {nn.GELU: None, nn.SiLU: "silu", nn.Mish: "mish", nn.Hardswish: "hardswish"}


def convert(
    model: nn.Module,
    *,
    example_inputs: tuple[Any, ...] | torch.Tensor | None = None,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> tuple[nn.Module, ConversionReport]:
    """Convert ``model`` in place to modules that keep less for backward; return it with a report.

    Why: most of a model's activation memory is what autograd keeps between forward and backward; replacing the
    modules that keep their input when their output is kept anyway (and fusing pairs) keeps less, computing the
    same function. Everything is proven per model: pairs only on traced evidence, and ``memtrim.verify`` checks
    training stays equal (see tests).

    Args:
        model: any ``nn.Module``; converted in place (parameters, buffers and state_dict keys unchanged).
        example_inputs: a tensor or tuple of arguments for ``model(*example_inputs)``; the evidence for pairs
            (else the torch.fx graph, where the model traces) and what each change's saving is measured on.
        module_filter: ``module_filter(name, module)`` returning False leaves that module alone.

    Returns:
        ``(model, ConversionReport)``.

    Raises:
        InvalidInputError: ``model`` is not a module, or the example inputs fail to run through it.

    See NOTE [ how convert decides ] in memtrim/techniques/activations/convert.py.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"memtrim.convert: model must be an nn.Module, got {type(model).__name__}.")
    args: tuple[Any, ...] | None = None
    if example_inputs is not None:
        args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    parents = _parents(model)
    skipped: list[Skipped] = []
    changes: list[tuple[tuple[str, ...], str, str, Callable[[], None]]] = []
    trace: Any = _trace(model, args) if args is not None else _fx_graph(model)
    modules = dict(model.named_modules())
    claimed: set[str] = set()

    def allowed(name: str, module: nn.Module) -> bool:
        if module_filter is not None and not module_filter(name, module):
            skipped.append(Skipped((name,), "excluded by module_filter"))
            return False
        return True

    # pairs first: they claim their modules
    for name, module in modules.items():
        kind = "bn" if type(module) in _BN_ACT else "act" if type(module) in _ACT_LINEAR else None
        if kind is None or name in claimed:
            continue
        if trace is None:
            what = "BatchNorm + activation" if kind == "bn" else "activation + Linear"
            skipped.append(Skipped((name,), f"{what} pairs need example_inputs (or a model torch.fx can trace) to "
                                            "prove the first module's output goes to the second alone"))
            continue
        found = trace.pair_after(name) if isinstance(trace, _FxGraph) else _pair_after(name, trace, modules)
        if found is None:
            continue
        nxt_name, why = found
        nxt = modules.get(nxt_name)
        if why or nxt is None:
            skipped.append(Skipped((name, nxt_name) if nxt_name else (name,), why))
            continue
        if kind == "bn":
            if type(nxt) is nn.ReLU:
                if allowed(name, module) and allowed(nxt_name, nxt):
                    readers = [modules[r] for r in trace.keepers(nxt_name) if r in modules]
                    changes.append(((name, nxt_name), f"{type(module).__name__} + ReLU",
                                    f"memtrim.nn.{_BN_RELU[type(module)].__name__}",
                                    _fuse_bn_relu(module, parents[nxt_name], readers)))
                    claimed.update((name, nxt_name))
                continue
            spec = _bn_activation(nxt)
            if spec is None:
                skipped.append(Skipped((name, nxt_name), f"BatchNorm is followed by {type(nxt).__name__}, not "
                                                         "ReLU, LeakyReLU (slope > 0) or ELU"))
                continue
            if allowed(name, module) and allowed(nxt_name, nxt):
                changes.append(((name, nxt_name), f"{type(module).__name__} + {type(nxt).__name__}",
                                f"memtrim.nn.{_BN_ACT[type(module)].__name__}",
                                _fuse_bn(module, parents[nxt_name], spec)))
                claimed.update((name, nxt_name))
        else:
            if type(nxt) is not nn.Linear:
                skipped.append(Skipped((name, nxt_name), f"{type(module).__name__} feeds {type(nxt).__name__}, "
                                                         "not a Linear"))
                continue
            activation = _act_name(module)
            if activation is None:
                skipped.append(Skipped((name, nxt_name), "GELU with an unsupported approximation"))
                continue
            if allowed(name, module) and allowed(nxt_name, nxt):
                changes.append(((name, nxt_name), f"{type(module).__name__} + Linear", "memtrim.nn.ActLinear",
                                _fuse_act_linear(nxt, parents[name], activation)))
                claimed.update((name, nxt_name))
    for name, module in modules.items():
        if type(module) is nn.ReLU and trace is not None:
            found = trace.pair_after(name) if isinstance(trace, _FxGraph) else _pair_after(name, trace, modules)
            if found is not None and not found[1] and type(modules.get(found[0])) is nn.Linear:
                skipped.append(Skipped((name, found[0]), "ReLU keeps its output, which the Linear keeps anyway: "
                                                         "nothing to save"))
    for name, module in model.named_modules():
        target = _SINGLE.get(type(module))
        if target is None or name in claimed:
            continue
        if isinstance(module, nn.LeakyReLU) and module.negative_slope < 0:
            skipped.append(Skipped((name,), "LeakyReLU with a negative slope: the output does not determine the "
                                            "gradient"))
            continue
        if isinstance(module, (nn.ELU, nn.CELU)) and module.alpha <= 0:
            skipped.append(Skipped((name,), "alpha <= 0: the output does not determine the gradient"))
            continue
        if allowed(name, module):
            changes.append(((name,), type(module).__name__, f"memtrim.nn.{target.__name__}",
                            _swap_class(module, target)))

    before = _activation_bytes(model, args) if args is not None else None
    done: list[Change] = []
    current = before
    for modules, old, new, apply in changes:
        apply()
        after = _activation_bytes(model, args) if args is not None else None
        done.append(Change(modules, old, new, None if after is None or current is None else current - after))
        current = after
    notes = []
    if args is None:
        notes.append("no example_inputs: pairs " + ("proven from the torch.fx graph" if trace is not None else
                                                     "skipped (the model does not trace with torch.fx)")
                     + "; savings not measured")
    return model, ConversionReport(done, skipped, before, current, notes)


# ---------------------------------------------------------------------- evidence: a traced forward
class _Trace:
    """A forward on the example inputs: every op's reads (storage, module stack), every tensor autograd saved
    (storage, module stack) and every module call."""

    def __init__(self) -> None:
        self.clock = 0
        self.reads: list[tuple[int, int, tuple[str, ...]]] = []  # (time, id(storage), module stack)
        self.saves: list[tuple[int, int, tuple[str, ...]]] = []  # (time, id(storage), module stack)
        self.calls: dict[str, list[tuple[int, int, set[int]]]] = {}  # name -> (start, end, output storage ids)
        self.keep: list[Any] = []  # storages stay alive, so their ids stay unique


    def keepers(self, name: str) -> list[str]:
        """The innermost modules in whose forward autograd saved ``name``'s output (its own ancestors' code
        excluded: it is not a module whose saved tensors hooks could reach). Modules that only read it (an
        addition, a shortcut) are left out: hooks there would cost time and save nothing."""
        found: set[str] = set()
        for _, end, outputs in self.calls.get(name, []):
            for time, storage, stack in self.saves:
                if storage in outputs and time > end and stack and not _is_self_or_ancestor(stack[-1], name):
                    found.add(stack[-1])
        return sorted(found)


class _Recorder(TorchDispatchMode):
    def __init__(self, trace: _Trace, stack: list[str]) -> None:
        super().__init__()
        self.trace, self.stack = trace, stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        trace = self.trace
        trace.clock += 1
        for t in tensors_in((args, kwargs)):
            storage = t.untyped_storage()
            trace.keep.append(storage)
            trace.reads.append((trace.clock, id(storage), tuple(self.stack)))
        return func(*args, **kwargs)


def _trace(model: nn.Module, args: tuple[Any, ...]) -> _Trace:
    names = {id(m): n for n, m in model.named_modules()}
    stack: list[str] = []
    trace = _Trace()
    starts: list[int] = []

    def pre(module: nn.Module, inputs: tuple) -> None:
        trace.clock += 1
        stack.append(names[id(module)])
        starts.append(trace.clock)

    def post(module: nn.Module, inputs: tuple, output: Any) -> None:
        trace.clock += 1
        name = stack.pop()
        outputs = {id(t.untyped_storage()) for t in tensors_in(output)}
        trace.keep.extend(t.untyped_storage() for t in tensors_in(output))
        trace.calls.setdefault(name, []).append((starts.pop(), trace.clock, outputs))

    def saved(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        trace.keep.append(storage)
        trace.saves.append((trace.clock, id(storage), tuple(stack)))
        return tensor.detach()

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]
    was_training = model.training
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        model.train()
        with torch.enable_grad(), _Recorder(trace, stack), torch.autograd.graph.saved_tensors_hooks(saved, lambda t: t):
            model(*[a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args])
    except Exception as e:
        raise InvalidInputError(
            f"memtrim.convert: the model failed on example_inputs ({type(e).__name__}: {e}). Pass arguments that "
            "model(*example_inputs) accepts."
        ) from e
    finally:
        for h in handles:
            h.remove()
        model.load_state_dict(state)  # tracing must not move BatchNorm's running statistics
        model.train(was_training)
    return trace


class _FxGraph:
    """Evidence from ``torch.fx.symbolic_trace``: which module call uses another's output, and nothing else."""

    def __init__(self, graph: Any) -> None:
        self.nodes: dict[str, list[Any]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                self.nodes.setdefault(node.target, []).append(node)

    def keepers(self, name: str) -> list[str]:
        """The modules that take ``name``'s output as an input (any of them may keep it)."""
        return sorted({u.target for node in self.nodes.get(name, []) for u in node.users if u.op == "call_module"})

    def pair_after(self, name: str) -> tuple[str, str] | None:
        calls = self.nodes.get(name, [])
        if not calls:
            return None
        if len(calls) != 1:
            return name, f"{name} runs {len(calls)} times per forward; its calls cannot be fused one by one"
        users = list(calls[0].users)
        if len(users) != 1 or users[0].op != "call_module":
            return "", f"{name}'s output is used by {len(users)} operations, not by one module alone"
        consumer = users[0].target
        if len(self.nodes.get(consumer, [])) != 1:
            return consumer, f"{consumer} runs {len(self.nodes.get(consumer, []))} times per forward"
        return consumer, ""


def _fx_graph(model: nn.Module) -> _FxGraph | None:
    try:
        return _FxGraph(torch.fx.symbolic_trace(model).graph)
    except Exception:  # control flow on values, unsupported ops: no fx evidence
        return None


def _is_self_or_ancestor(entry: str, name: str) -> bool:
    return entry == "" or entry == name or name.startswith(entry + ".")


def _pair_after(name: str, trace: _Trace | None, modules: dict[str, nn.Module]) -> tuple[str, str] | None:
    """``(consumer, reason)``: the one module that reads ``name``'s output (reason "" if that is all that reads
    it), or None when there is no evidence (no trace, or the output is never read)."""
    if trace is None or name not in trace.calls:
        return None
    calls = trace.calls[name]
    if len(calls) != 1:
        return name, f"{name} runs {len(calls)} times per forward; its calls cannot be fused one by one"
    _, end, outputs = calls[0]
    reads = [(time, stack) for time, storage, stack in trace.reads if storage in outputs and time > end]
    if not reads:
        return None
    first_time, first_stack = reads[0]
    consumer = first_stack[-1] if first_stack else ""
    if _is_self_or_ancestor(consumer, name):
        return "", f"{name}'s output is used by its parent's own code, not by a module"
    consumer_calls = trace.calls.get(consumer, [])
    if len(consumer_calls) != 1:
        return consumer, f"{consumer} runs {len(consumer_calls)} times per forward"
    c_start, c_end, c_outputs = consumer_calls[0]
    if c_outputs & outputs:  # an in-place consumer: later reads are of its own output
        reads = [(t, st) for t, st in reads if t <= c_end]
    for _, stack in reads:
        if consumer not in stack:
            reader = stack[-1] if stack else "the top-level forward"
            return consumer, f"{name}'s output is also read outside {consumer} (in {reader or 'a parent module'})"
    return consumer, ""


def _parents(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    found = {}
    for parent_name, parent in model.named_modules():
        for child_name, _ in parent.named_children():
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            found[full] = (parent, child_name)
    return found


# ---------------------------------------------------------------------- the changes
def _swap_class(module: nn.Module, target: type) -> Callable[[], None]:
    def apply() -> None:
        module.__class__ = target
        if target in (lean.ReLU, lean.LeakyReLU, lean.Hardtanh, lean.ReLU6, lean.Hardsigmoid):
            module.save = "output"  # type: ignore[attr-defined]
        if target in (LayerNorm, RMSNorm):
            module.gamma_threshold = 1e-3  # type: ignore[attr-defined]

    return apply


def _bn_activation(act: nn.Module) -> tuple[str, float] | None:
    if type(act) is nn.LeakyReLU and act.negative_slope > 0:
        return "leaky_relu", act.negative_slope
    if type(act) is nn.ELU and act.alpha > 0:
        return "elu", act.alpha
    return None


def _fuse_bn(bn: nn.Module, where: tuple[nn.Module, str], spec: tuple[str, float]) -> Callable[[], None]:
    def apply() -> None:
        bn.__class__ = _BN_ACT[type(bn)]
        bn.activation = spec[0]  # type: ignore[assignment]
        bn.negative_slope = spec[1] if spec[0] == "leaky_relu" else 0.01  # type: ignore[assignment]
        bn.alpha = spec[1] if spec[0] == "elu" else 1.0  # type: ignore[assignment]
        bn.gamma_threshold = 1e-3  # type: ignore[assignment]
        parent, child = where
        setattr(parent, child, nn.Identity())

    return apply


def _fuse_bn_relu(bn: nn.Module, where: tuple[nn.Module, str], readers: list[nn.Module]) -> Callable[[], None]:
    def apply() -> None:
        bn.__class__ = _BN_RELU[type(bn)]
        parent, child = where
        setattr(parent, child, nn.Identity())
        for reader in readers:  # the modules that would keep the ReLU output keep a recipe instead
            install_recompute_hooks(reader)

    return apply


def _act_name(act: nn.Module) -> str | None:
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return _ACT_LINEAR.get(type(act))


def _fuse_act_linear(linear: nn.Module, where: tuple[nn.Module, str], activation: str) -> Callable[[], None]:
    def apply() -> None:
        linear.__class__ = ActLinear
        linear.activation = activation  # type: ignore[assignment]
        parent, child = where
        setattr(parent, child, nn.Identity())

    return apply


def _activation_bytes(model: nn.Module, args: tuple[Any, ...]) -> int:
    was_training = model.training
    state = {k: v.clone() for k, v in model.state_dict().items() if not isinstance(v, nn.Parameter)}
    model.train()
    try:
        with track(model) as tracker:
            out = model(*[a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args])
            held = tracker.live_by_category()["activations"]
        del out
    finally:
        with torch.no_grad():  # measuring must not move BatchNorm's running statistics
            for k, v in model.state_dict().items():
                if k in state:
                    v.copy_(state[k])
        model.train(was_training)
    return held

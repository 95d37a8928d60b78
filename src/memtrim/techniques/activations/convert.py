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
  hooks and state_dict keys), so an optimizer built before ``convert`` keeps working. A module absorbed into its
  neighbour becomes an :class:`Absorbed` identity the same way, so every name it is registered under (a module can
  be both ``self.act`` and ``self.block[1]``) and every reference to it see the change; a module the forward calls
  more than once is never fused.
* Hooks: a swapped module keeps its hooks, which see the same inputs and outputs. A pair is not fused when either
  module has forward, forward pre-, backward or backward pre-hooks: they would see the fused module's values, or
  never run.
* What breaks a converted module, and what convert checks: an output-keeping module's output must not be changed
  in place before backward (with example inputs the traced forward sees every in-place write, and such modules are
  skipped; otherwise backward raises ``ConvertError`` naming the module). Rebuilt norms have no second derivative
  (``Change.limits`` says so; a backward through their gradient raises ``ConvertError``). Under torch.compile and
  torch.func every converted module runs as torch's own ops, and so do the rebuilt norms and ActLinear under
  autocast (a bfloat16 output would rebuild xhat with bfloat16's rounding where torch reads the input in float32).
  Tracing and measuring leave the global (and CUDA) RNG, parameters and running statistics as they were.
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
from ._kernels import ConvertError
from .bn_relu import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d, install_recompute_hooks
from .functional import softplus_keeps_output
from .norm_act import BatchNormAct1d, BatchNormAct2d, BatchNormAct3d
from .transformer import ActLinear, LayerNorm, RMSNorm

__all__ = ["Absorbed", "Change", "ConversionReport", "ConvertError", "Skipped", "convert"]


@dataclass(frozen=True)
class Change:
    """One module (or pair) converted, with the activation bytes it saved on the example inputs, and what the
    converted module no longer supports (``limits``; empty where it does everything torch's does)."""

    modules: tuple[str, ...]
    before: str
    after: str
    bytes_saved: int | None
    limits: tuple[str, ...] = ()


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
            limits = f" [{'; '.join(c.limits)}]" if c.limits else ""
            lines.append(f"  changed {' + '.join(c.modules)}: {c.before} -> {c.after}{saved}{limits}")
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
    with torch.random.fork_rng(devices=_cuda_devices(model, args)):  # tracing must not draw from the user's RNG
        return _convert(model, args, module_filter)


def _convert(model: nn.Module, args: tuple[Any, ...] | None,
             module_filter: Callable[[str, nn.Module], bool] | None) -> tuple[nn.Module, ConversionReport]:
    skipped: list[Skipped] = []
    changes: list[tuple[tuple[str, ...], str, str, tuple[str, ...], Callable[[], None]]] = []
    trace: Any = _trace(model, args) if args is not None else _fx_graph(model)
    modules = dict(model.named_modules())  # each module once, under its first name
    aliases: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        aliases.setdefault(id(module), []).append(name)
    claimed: set[str] = set()

    def allowed(name: str, module: nn.Module) -> bool:
        if module_filter is not None and not all(module_filter(n, module) for n in aliases[id(module)]):
            skipped.append(Skipped((name,), "excluded by module_filter"))
            return False
        return True

    def edited(name: str) -> str | None:
        """Why ``name``'s output cannot be kept (it is changed in place later), or None."""
        if not isinstance(trace, _Trace):
            return None
        writer = trace.written_after(name)
        if writer is None:
            return None
        return (f"its output is changed in place after its forward (in {writer or 'the top-level forward'}); "
                "keeping the output for backward would break, as torch's module keeps its input")

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
        hooks = _user_hooks(module)
        if hooks:  # (a full backward hook also wraps the output in an op of the parent's: evidence would say that)
            skipped.append(Skipped((name,), f"{name} has {', '.join(hooks)}: fused with the next module, they would "
                                            "see the fused module's values. Remove the hooks to fuse it"))
            continue
        found = trace.pair_after(name) if isinstance(trace, _FxGraph) else _pair_after(name, trace, modules)
        if found is None:
            continue
        nxt_name, why = found
        nxt = modules.get(nxt_name)
        if why or nxt is None:
            skipped.append(Skipped((name, nxt_name) if nxt_name else (name,), why))
            continue
        pair = (name, nxt_name)
        if kind == "bn" and type(nxt) is not nn.ReLU and _bn_activation(nxt) is None:
            skipped.append(Skipped(pair, f"BatchNorm is followed by {type(nxt).__name__}, not ReLU, LeakyReLU "
                                         "(slope > 0) or ELU"))
            continue
        if kind == "act" and type(nxt) is not nn.Linear:
            skipped.append(Skipped(pair, f"{type(module).__name__} feeds {type(nxt).__name__}, not a Linear"))
            continue
        hooks = _user_hooks(nxt)
        if hooks:
            skipped.append(Skipped(pair, f"{nxt_name} has {', '.join(hooks)}: fused, they would see the fused module's "
                                         "values or not run. Remove the hooks to fuse the pair"))
            continue
        why = edited(nxt_name) if kind == "bn" else None
        if why:
            skipped.append(Skipped(pair, why))
            continue
        if kind == "bn":
            if not (allowed(name, module) and allowed(nxt_name, nxt)):
                continue
            limits: tuple[str, ...] = (_NO_DOUBLE_BACKWARD,)
            if type(nxt) is nn.ReLU:
                readers = [modules[r] for r in trace.keepers(nxt_name) if r in modules]
                target = _BN_RELU[type(module)]
                apply = _fuse_bn_relu(module, nxt, readers, _label(pair, target))
            else:
                target = _BN_ACT[type(module)]
                apply = _fuse_bn(module, nxt, _bn_activation(nxt), _label(pair, target))  # type: ignore[arg-type]
                limits += (_NO_AUTOCAST,)
            changes.append((pair, f"{type(module).__name__} + {type(nxt).__name__}", f"memtrim.nn.{target.__name__}",
                            limits, apply))
            claimed.update(pair)
        else:
            activation = _act_name(module)
            if activation is None:
                skipped.append(Skipped(pair, "GELU with an unsupported approximation"))
                continue
            if allowed(name, module) and allowed(nxt_name, nxt):
                changes.append((pair, f"{type(module).__name__} + Linear", "memtrim.nn.ActLinear", (_NO_AUTOCAST,),
                                _fuse_act_linear(module, nxt, activation, _label(pair, ActLinear))))
                claimed.update(pair)
    for name, module in modules.items():
        if type(module) is nn.ReLU and trace is not None:
            found = trace.pair_after(name) if isinstance(trace, _FxGraph) else _pair_after(name, trace, modules)
            if found is not None and not found[1] and type(modules.get(found[0])) is nn.Linear:
                skipped.append(Skipped((name, found[0]), "ReLU keeps its output, which the Linear keeps anyway: "
                                                         "nothing to save"))
    for name, module in modules.items():
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
        if isinstance(module, nn.Softplus) and not softplus_keeps_output(module.threshold, torch.float32):
            skipped.append(Skipped((name,), f"Softplus with threshold {module.threshold}: just below the threshold "
                                            "the output is also a possible output of the linear region, and the two "
                                            "gradients differ by up to exp(-threshold); it would keep its input, as "
                                            "torch's does (from threshold 17.3 up in float32 it keeps its output)"))
            continue
        why = edited(name)
        if why:
            skipped.append(Skipped((name,), why))
            continue
        if allowed(name, module):
            limits = (_NO_DOUBLE_BACKWARD, _NO_AUTOCAST) if target in (LayerNorm, RMSNorm) else ()
            changes.append(((name,), type(module).__name__, f"memtrim.nn.{target.__name__}", limits,
                            _swap_class(module, target, _label((name,), target))))

    before = _activation_bytes(model, args) if args is not None else None
    done: list[Change] = []
    current = before
    for names, old, new, limits, apply in changes:
        apply()
        after = _activation_bytes(model, args) if args is not None else None
        done.append(Change(names, old, new, None if after is None or current is None else current - after, limits))
        current = after
    notes = []
    if args is None:
        notes.append("no example_inputs: pairs " + ("proven from the torch.fx graph" if trace is not None else
                                                     "skipped (the model does not trace with torch.fx)")
                     + "; savings not measured; in-place changes of outputs found only at backward")
    return model, ConversionReport(done, skipped, before, current, notes)


_NO_DOUBLE_BACKWARD = "no double backward (a backward through its gradient raises ConvertError)"
_NO_AUTOCAST = "saves nothing under autocast (runs as torch's own ops there)"


def _label(names: tuple[str, ...], target: type) -> str:
    """How errors name a converted module."""
    return f"{' + '.join(repr(n) for n in names)} (converted by memtrim.convert to memtrim.nn.{target.__name__})"


def _cuda_devices(model: nn.Module, args: tuple[Any, ...] | None) -> list[int]:
    """The CUDA devices the model and the example inputs live on: their RNG is saved and restored around tracing."""
    found = {t.device.index or 0 for t in (*model.parameters(), *model.buffers(), *tensors_in(args or ()))
             if t.device.type == "cuda"}
    return sorted(found)


def _user_hooks(module: nn.Module) -> list[str]:
    """The kinds of hooks on ``module`` other than memtrim's own recompute hooks."""
    own = {h.id for h in getattr(module, "_memtrim_recompute_hooks", None) or ()}
    kinds = []
    for attr, label in (("_forward_pre_hooks", "forward pre-hooks"), ("_forward_hooks", "forward hooks"),
                        ("_backward_pre_hooks", "backward pre-hooks"), ("_backward_hooks", "backward hooks")):
        if any(key not in own for key in getattr(module, attr, None) or {}):
            kinds.append(label)
    return kinds


# ---------------------------------------------------------------------- evidence: a traced forward
class _Trace:
    """A forward on the example inputs: every op's reads (storage, module stack), every tensor autograd saved
    (storage, module stack) and every module call."""

    def __init__(self) -> None:
        self.clock = 0
        self.reads: list[tuple[int, int, tuple[str, ...]]] = []  # (time, id(storage), module stack)
        self.writes: list[tuple[int, int, tuple[str, ...]]] = []  # in-place writes: (time, id(storage), stack)
        self.saves: list[tuple[int, int, tuple[str, ...]]] = []  # (time, id(storage), module stack)
        self.calls: dict[str, list[tuple[int, int, set[int]]]] = {}  # name -> (start, end, output storage ids)
        self.keep: list[Any] = []  # storages stay alive, so their ids stay unique

    def written_after(self, name: str) -> str | None:
        """Where ``name``'s output is changed in place after its forward returned (the innermost module, "" for
        the top-level forward), or None if it never is."""
        for _, end, outputs in self.calls.get(name, []):
            for time, storage, stack in self.writes:
                if storage in outputs and time > end:
                    return stack[-1] if stack else ""
        return None

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
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    value = args[i] if i < len(args) else kwargs.get(arg.name)
                    for t in tensors_in(value):
                        trace.writes.append((trace.clock, id(t.untyped_storage()), tuple(self.stack)))
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

    handles = [m.register_forward_pre_hook(pre, prepend=True) for m in model.modules()]  # before users' hooks
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


# ---------------------------------------------------------------------- the changes
class Absorbed(nn.Identity):
    """A module whose work its neighbour now does (:func:`memtrim.convert`): the identity, wherever it is registered.

    Its class is changed in place, like every conversion, so that each name the module is registered under, and
    each reference to it, sees the same change."""

    def extra_repr(self) -> str:
        return f"absorbed into {getattr(self, 'memtrim_absorbed_into', '?')}"


def _absorb(module: nn.Module, into: str) -> None:
    module.__class__ = Absorbed
    module.memtrim_absorbed_into = into  # type: ignore[assignment]


def _swap_class(module: nn.Module, target: type, label: str) -> Callable[[], None]:
    def apply() -> None:
        module.__class__ = target
        module.memtrim_owner = label  # type: ignore[assignment]
        if target in (lean.ReLU, lean.LeakyReLU, lean.Hardtanh, lean.ReLU6, lean.Hardsigmoid):
            module.save = "output"  # type: ignore[attr-defined]
        if target in (LayerNorm, RMSNorm):
            module.gamma_threshold = 0.0  # type: ignore[attr-defined]  # the error bound decides

    return apply


def _bn_activation(act: nn.Module) -> tuple[str, float] | None:
    if type(act) is nn.LeakyReLU and act.negative_slope > 0:
        return "leaky_relu", act.negative_slope
    if type(act) is nn.ELU and act.alpha > 0:
        return "elu", act.alpha
    return None


def _fuse_bn(bn: nn.Module, act: nn.Module, spec: tuple[str, float], label: str) -> Callable[[], None]:
    def apply() -> None:
        bn.__class__ = _BN_ACT[type(bn)]
        bn.activation = spec[0]  # type: ignore[assignment]
        bn.negative_slope = spec[1] if spec[0] == "leaky_relu" else 0.01  # type: ignore[assignment]
        bn.alpha = spec[1] if spec[0] == "elu" else 1.0  # type: ignore[assignment]
        bn.gamma_threshold = 0.0  # type: ignore[assignment]  # the error bound decides
        bn.memtrim_owner = label  # type: ignore[assignment]
        _absorb(act, label)

    return apply


def _fuse_bn_relu(bn: nn.Module, relu: nn.Module, readers: list[nn.Module], label: str) -> Callable[[], None]:
    def apply() -> None:
        bn.__class__ = _BN_RELU[type(bn)]
        bn.memtrim_owner = label  # type: ignore[assignment]
        _absorb(relu, label)
        for reader in readers:  # the modules that would keep the ReLU output keep a recipe instead
            install_recompute_hooks(reader)

    return apply


def _act_name(act: nn.Module) -> str | None:
    if isinstance(act, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}.get(act.approximate)
    return _ACT_LINEAR.get(type(act))


def _fuse_act_linear(act: nn.Module, linear: nn.Module, activation: str, label: str) -> Callable[[], None]:
    def apply() -> None:
        linear.__class__ = ActLinear
        linear.activation = activation  # type: ignore[assignment]
        linear.memtrim_owner = label  # type: ignore[assignment]
        _absorb(act, label)

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

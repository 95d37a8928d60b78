"""convert's built-in rules (NOTE [ convert's rules ] in rules.py), in the order they run.

* ``batchnorm_activation``: BatchNorm -> LeakyReLU / ELU becomes ``BatchNormAct`` (+ :class:`Absorbed`);
  BatchNorm -> ReLU becomes ``BatchNormReLU`` with recipe hooks on the modules that keep the ReLU output.
* ``relu_linear``: reports ReLU -> Linear (nothing to save: both keep the same storage).
* ``layer_norm_consumer`` (recompute_rules.py): a LayerNorm whose output only later call sites keep stays torch's;
  they keep a recipe.
* ``keep_output``: single torch modules that keep their input where their output serves (LeakyReLU, Hardtanh, ...,
  LayerNorm, RMSNorm) become their ``memtrim.nn`` forms (not ELU, CELU, SELU: NOTE [ ELU keeps its input ]).
* ``norm_by_behaviour``: a LayerNorm or RMSNorm in another library's spelling, recognised by its traced ops
  (see norms.py).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from ...errors import ConvertError
from ..activations import modules as lean
from ..activations import softplus_keeps_output
from ..guards import (
    FUSION,
    INPUT_AND_FORWARD_HOOKS,
    INPUT_HOOKS,
    RELU,
    activated,
    plain_only,
    refuse_later_hooks,
    watch_replacement,
)
from ..norms import (
    BatchNormAct1d,
    BatchNormAct2d,
    BatchNormAct3d,
    BatchNormReLU1d,
    BatchNormReLU2d,
    BatchNormReLU3d,
    LayerNorm,
    RMSNorm,
)
from ..norms._kernels import HALF_PRECISION
from ..norms.bn_relu import rebuilds_bitwise
from ..recompute import LIMITS, keep_recipes_in
from .rules import Candidate, Context, Undo, chain, class_swap, label, register_rule

__all__ = ["Absorbed", "FROM_OUTPUT", "FUSED", "HARDSIGMOID_EDGE", "KEEP_OUTPUT_FORMS", "NO_AUTOCAST",
           "NO_DOUBLE_BACKWARD", "REBUILT_INPUT", "half_precision_guard"]

NO_DOUBLE_BACKWARD = "no double backward (a backward through its gradient raises ConvertError)"
"""The limit a change states (``Change.limits``) when its module rebuilds a tensor it has no second derivative for."""
NO_AUTOCAST = "saves nothing under autocast (runs as torch's own ops there)"
"""The limit a change states (``Change.limits``) when its module runs as torch's own ops under autocast."""
REBUILT_INPUT = ("its input is rebuilt from its output in backward: gradients agree with torch's to rounding, "
                 "not bitwise")
"""The limit of a norm (or BatchNorm + activation) that keeps its output and rebuilds its input (not bitwise)."""
FROM_OUTPUT = "its gradient is computed from its output: agrees with torch's to rounding, not bitwise"
"""The limit of an activation whose derivative memtrim computes from the output by another formula than torch's."""
FUSED = ("fused: the BatchNorm returns its activation's output, and the activation module is an identity there; a "
         "path the example inputs did not take that reads the BatchNorm's output apart from the activation (a "
         "features flag, retain_grad on it) gets the activation's output (convert fuses what the example inputs "
         "show), and so does a global module hook or a hook on a module whose output is the BatchNorm's; a hook "
         "added to either module after convert that would see a fused value (the BatchNorm's output, the "
         "activation's input, or their gradients) raises ConvertError, and so does torch.fx tracing")
"""The limit of every BatchNorm + activation pair convert fuses into one module."""
HARDSIGMOID_EDGE = ("its gradient is computed from its output: on the CPU torch's, bitwise, except where a float32 or "
                    "float64 input is exactly the largest float below 3 (its output rounds to 1: gradient 0 where "
                    "torch's is grad/6); on CUDA, whose forward multiplies by 1/6 (checked on an H200), also every "
                    "float64 input within about 1.8e-7 below 3; so not bitwise")
"""The limit of memtrim's Hardsigmoid: torch's arithmetic, but its output cannot tell that one input from 3."""


def half_precision_guard(ctx: Context, name: str, module: nn.Module, what: str) -> str | None:
    """Why ``module`` (a norm ``what`` would make keep its output) stays torch's: it runs in float16 or bfloat16
    (NOTE [ norms in half precision ] in norms/_kernels.py), where it would run as torch's anyway and save nothing;
    None otherwise. Seen in its own floating tensors and the inputs the trace saw (float32 weights fed bfloat16
    activations run as torch's too), else (nothing to tell: a LayerNorm without affine, no example inputs) in the
    model's first floating parameter."""
    seen = [t.dtype for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
            if t.is_floating_point()]
    if ctx.trace is not None:
        seen += [d for site in ctx.trace.sites_of(name) for d in site.input_dtypes if d.is_floating_point]
    if not seen:
        seen = [p.dtype for p in ctx.model.parameters() if p.is_floating_point()][:1]
    found = next((d for d in seen if d in HALF_PRECISION), None)
    if found is None:
        return None
    return (f"{type(module).__name__} runs in {str(found).removeprefix('torch.')}: {what} would rebuild its input "
            "from its half-precision output, whose rounding adds up in the weight gradient's sums (far past torch's "
            "error where they cancel), so it runs as torch's there and would save nothing (precision guard, "
            "NOTE [ norms in half precision ])")


KEEP_OUTPUT_FORMS: dict[type, type] = {
    nn.LeakyReLU: lean.LeakyReLU,
    nn.Hardtanh: lean.Hardtanh, nn.ReLU6: lean.ReLU6, nn.Hardsigmoid: lean.Hardsigmoid,
    nn.Softplus: lean.Softplus, nn.Sigmoid: lean.Sigmoid, nn.Tanh: lean.Tanh, nn.LayerNorm: LayerNorm,
    nn.RMSNorm: RMSNorm,
}
"""The ``keep_output`` rule's swaps: each torch class to its ``memtrim.nn`` form (norm_by_behaviour leaves these
classes to it)."""
_BN_ACT: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: BatchNormAct1d, nn.BatchNorm2d: BatchNormAct2d, nn.BatchNorm3d: BatchNormAct3d}
_BN_RELU: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: BatchNormReLU1d, nn.BatchNorm2d: BatchNormReLU2d, nn.BatchNorm3d: BatchNormReLU3d}
# keep-output activations whose gradient from the output is torch's own arithmetic: a mask times the incoming gradient
# (LeakyReLU's slope, Hardtanh, ReLU6), or torch's own formula from the output (Sigmoid, Tanh). Softplus rounds
# otherwise; Hardsigmoid differs at one input (HARDSIGMOID_EDGE): measured in
# tests/techniques/test_convert_contract.py
_BITWISE_FROM_OUTPUT = frozenset({lean.LeakyReLU, lean.Hardtanh, lean.ReLU6, lean.Sigmoid, lean.Tanh})


class Absorbed(nn.Identity):
    """A module whose work its neighbour now does (:func:`memtrim.convert`): the identity, wherever it is registered.

    Its class is changed in place, like every conversion, so that each name the module is registered under, and
    each reference to it, sees the same change."""


    def extra_repr(self) -> str:
        """Which module now does this one's work (``absorbed into <name>``)."""
        return f"absorbed into {getattr(self, 'memtrim_absorbed_into', '?')}"

    def forward(self, input: Any) -> Any:
        """``input`` itself: its neighbour did this module's work."""
        refuse_later_hooks(self, "this activation is an identity now: the BatchNorm before it applies it",
                           INPUT_HOOKS if self.__dict__.get("inplace") else INPUT_AND_FORWARD_HOOKS)
        fused = self.__dict__.get("memtrim_fused_settings")
        if fused is not None:  # (name, value) of the settings its BatchNorm applies, copied at convert
            for setting, value in fused:
                now = getattr(self, setting)
                if now != value:
                    raise ConvertError(
                        f"memtrim.convert: {getattr(self, 'memtrim_absorbed_into', '?')} applies this activation "
                        f"since convert, with {setting}={value}; the activation's {setting} is {now} "
                        "now, changed after convert, which the BatchNorm does not see. Expected the setting convert "
                        f"fused; found it changed. To fix: set {setting} before memtrim.convert (convert the "
                        "unconverted model again), or leave the pair out (module_filter)."
                    )
        relu = getattr(self, "memtrim_relu", False)
        if plain_only():  # torch.compile must trace no check: a ReLU applied again is the ReLU once
            return torch.relu(input) if relu else input
        # a ReLU's: any fused BatchNorm + ReLU's output (relu'd twice it is relu'd once); another's: its own BatchNorm's
        state = activated(input, RELU if relu else self.__dict__.get(FUSION))
        if state is True:
            return input
        if relu and state is None:  # not its BatchNorm's output: this module's own ReLU, as before convert
            return torch.relu(input)
        into = getattr(self, "memtrim_absorbed_into", "?")
        found = ("its BatchNorm's output, changed in place since (a path the traced forward did not take)"
                 if state is False else "another tensor")
        raise ConvertError(
            f"memtrim.convert: expected the output of {into}, which applies this activation since convert, but this "
            f"module (an identity now) got {found}: {into} was replaced after convert (torch's "
            "SyncBatchNorm.convert_sync_batchnorm, timm's freeze_batch_norm_2d and other tools that rebuild BatchNorms "
            "by class make torch's BatchNorm, without the activation), compiled apart from it, or the module is "
            "called on something else. Run such tools before memtrim.convert, compile the whole model, or leave the "
            "pair out (module_filter)."
        )


class AbsorbedReLU(Absorbed, nn.ReLU):
    """An absorbed ``nn.ReLU``: still an ``nn.ReLU`` to ``isinstance``, so that code that finds activations by class
    (a utility replacing every ReLU) finds it, and its BatchNorm sees the replacement (NOTE [ a fused activation
    replaced after convert ] in guards.py)."""


class AbsorbedLeakyReLU(Absorbed, nn.LeakyReLU):
    """An absorbed ``nn.LeakyReLU``, still one to ``isinstance`` (see :class:`AbsorbedReLU`)."""


class AbsorbedELU(Absorbed, nn.ELU):
    """An absorbed ``nn.ELU``, still one to ``isinstance`` (see :class:`AbsorbedReLU`)."""


_ABSORBED: dict[type, type] = {nn.ReLU: AbsorbedReLU, nn.LeakyReLU: AbsorbedLeakyReLU, nn.ELU: AbsorbedELU}


def absorb(module: nn.Module, into: str, bn: nn.Module, places: list[tuple[nn.Module, str]],
           idempotent: bool = False, settings: tuple[tuple[str, float], ...] | None = None) -> Undo:
    """Make ``module`` an :class:`Absorbed` identity whose work ``into`` (the BatchNorm ``bn``) now does.
    ``idempotent``: the activation is a ReLU (applied twice, it is applied once), which this module can then apply to
    an input ``into`` did not make. ``settings``: the activation's settings ``bn`` copied, checked at every call.
    ``places``: (parent, name) where ``module`` is registered."""
    # the token of this pair's marks: another fused BatchNorm's output is not this activation's input as it made it
    token = None if idempotent else secrets.token_hex(8)
    if token is not None:
        bn.__dict__[FUSION] = token

    def forget() -> None:
        bn.__dict__.pop(FUSION, None)

    return chain(class_swap(module, _ABSORBED.get(type(module), Absorbed), memtrim_absorbed_into=into,
                            memtrim_owner=into, memtrim_relu=idempotent, memtrim_fused_settings=settings,
                            **({FUSION: token} if token is not None else {})),
                 watch_replacement(bn, module, places), forget)


# ---------------------------------------------------------------------- pairs
def _pair(ctx: Context, name: str, module: nn.Module, what: str) -> tuple[str, nn.Module] | Candidate | None:
    """The module that alone reads ``name``'s output, a skip saying why there is none, or None (no evidence)."""
    if ctx.evidence is None:
        return Candidate((name,), reason=f"{what} pairs need example_inputs (or a model torch.fx can trace) to prove "
                                         "the first module's output goes to the second alone", skip=True)
    if getattr(module, "qconfig", None) is not None:
        return Candidate((name,), reason=f"{name} is prepared for quantization (a qconfig): fused, it would get no "
                                         "observers", skip=True)
    hooks = ctx.user_hooks(module)
    if hooks:  # (a full backward hook also wraps the output in an op of the parent's: evidence would say that)
        return Candidate((name,), reason=f"{name} has {', '.join(hooks)}: fused with the next module, they would see "
                                         "the fused module's values. Remove the hooks to fuse it", skip=True)
    found = ctx.evidence.pair_after(name)
    if found is None:
        return None
    nxt_name, why = found
    nxt = ctx.modules.get(nxt_name)
    if why or nxt is None:
        return Candidate((name, nxt_name) if nxt_name else (name,), reason=why, skip=True)
    hooks = ctx.user_hooks(nxt)
    if hooks:
        return Candidate((name, nxt_name), reason=f"{nxt_name} has {', '.join(hooks)}: fused, they would see the fused "
                                                  "module's values or not run. Remove the hooks to fuse the pair",
                         skip=True)
    return nxt_name, nxt


def _bn_activation(act: nn.Module) -> tuple[str, float] | None:
    if type(act) is nn.LeakyReLU and act.negative_slope > 0:
        return "leaky_relu", act.negative_slope
    if type(act) is nn.ELU and act.alpha > 0:
        return "elu", act.alpha
    return None


def _shared_relu(ctx: Context, skip: Candidate) -> bool:
    """A pair refused because its ReLU runs at several call sites, or its BatchNorm does, each call followed by one
    ReLU module: ``batchnorm_relu_call_site`` decides it."""
    from .recompute_rules import relu_calls_after  # (that module imports this one)

    return (ctx.traced and len(skip.modules) == 2 and "times per forward" in skip.reason
            and relu_calls_after(ctx, skip.modules[0]) is not None)


@register_rule("batchnorm_activation")
def batchnorm_activation(ctx: Context) -> Iterator[Candidate]:
    """BatchNorm -> LeakyReLU / ELU (inverted from the output) or -> ReLU (recomputed from the BatchNorm input)."""
    for name, bn in ctx.modules.items():
        if type(bn) not in _BN_ACT or not ctx.free(bn):
            continue
        found = _pair(ctx, name, bn, "BatchNorm + activation")
        if not isinstance(found, tuple):
            if found is not None and not _shared_relu(ctx, found):
                yield found
            continue
        act_name, act = found
        pair = (name, act_name)
        spec = _bn_activation(act)
        if type(act) is not nn.ReLU and spec is None:
            yield Candidate(pair, reason=f"BatchNorm is followed by {type(act).__name__}, not ReLU, LeakyReLU "
                                         "(slope > 0) or ELU", skip=True)
            continue
        why = ctx.edited(act_name) or ctx.input_edited(name) or (None if type(act) is nn.ReLU else
                                       half_precision_guard(ctx, name, bn, f"fused with {type(act).__name__}, it"))
        if why:
            yield Candidate(pair, reason=why, skip=True)
            continue
        if type(act) is nn.ReLU:
            target = _BN_RELU[type(bn)]
            readers = [ctx.modules[r] for r in ctx.evidence.keepers(act_name) if r in ctx.modules]  # type: ignore[union-attr]
            apply = _fuse_bn_relu(bn, act, readers, target, label(pair, f"memtrim.nn.{target.__name__}"),
                                  ctx.places(act))
            limits: tuple[str, ...] = (*LIMITS["batchnorm_relu"], FUSED)
            bitwise = rebuilds_bitwise(bn)
            # the ReLU's output, which its own node and its readers keep, is kept by none of them (NOTE [ changes
            # measured together ] in api.py)
            trace = ctx.trace
            expected = None if trace is None else sum(trace.storages[k].nbytes for s in trace.sites_of(act_name)
                                                      for k in s.outputs[:1] if trace.storages[k].holders)
        else:
            target = _BN_ACT[type(bn)]
            apply = _fuse_bn(bn, act, target, spec, label(pair, f"memtrim.nn.{target.__name__}"),  # type: ignore[arg-type]
                             ctx.places(act))
            limits = (REBUILT_INPUT, NO_DOUBLE_BACKWARD, NO_AUTOCAST, FUSED)
            bitwise = False
            expected = None  # (it keeps copies of the weights, and some features' input where they decide so)
        yield Candidate(pair, f"{type(bn).__name__} + {type(act).__name__}", f"memtrim.nn.{target.__name__}",
                        reason="the BatchNorm's output is read by the activation alone", targets=(bn, act),
                        expected_bytes=expected or None, limits=limits, bitwise=bitwise, apply=apply)


def _fuse_bn(bn: nn.Module, act: nn.Module, target: type, spec: tuple[str, float], owner: str,  # noqa: ANN202
             places: list[tuple[nn.Module, str]]):
    def apply() -> Undo:
        return chain(
            class_swap(bn, target, activation=spec[0], negative_slope=spec[1] if spec[0] == "leaky_relu" else 0.01,
                       alpha=spec[1] if spec[0] == "elu" else 1.0, gamma_threshold=0.0, memtrim_owner=owner,
                       memtrim_activation_inplace=bool(getattr(act, "inplace", False))),
            absorb(act, owner, bn, places,
                   settings=(("negative_slope" if spec[0] == "leaky_relu" else "alpha", spec[1]),)))

    return apply


def _fuse_bn_relu(bn: nn.Module, relu: nn.Module, readers: list[nn.Module], target: type, owner: str,  # noqa: ANN202
                  places: list[tuple[nn.Module, str]]):
    def apply() -> Undo:
        undos = [class_swap(bn, target, memtrim_owner=owner), absorb(relu, owner, bn, places, idempotent=True)]
        for reader in readers:  # the modules that would keep the ReLU output keep a recipe instead
            undos.append(_recompute_hooks(reader))
        return chain(*undos)

    return apply


def _recompute_hooks(module: nn.Module) -> Undo:
    """Run ``module``'s forward as a recipe-honouring consumer scope; the undo gives up this use of it (the last
    use removes it)."""
    return keep_recipes_in(module).remove


@register_rule("relu_linear")
def relu_linear(ctx: Context) -> Iterator[Candidate]:
    """ReLU -> Linear: reported only (the ReLU keeps its output, which the Linear keeps anyway)."""
    if ctx.evidence is None:
        return
    for name, relu in ctx.modules.items():
        if type(relu) is nn.ReLU and ctx.free(relu):
            found = ctx.evidence.pair_after(name)
            if found is not None and not found[1] and type(ctx.modules.get(found[0])) is nn.Linear:
                yield Candidate((name, found[0]), reason="ReLU keeps its output, which the Linear keeps anyway: "
                                                         "nothing to save", skip=True)


# ---------------------------------------------------------------------- single modules
# NOTE [ ELU keeps its input ]: ELU's derivative from its output, y + alpha, cancels as y nears -alpha: the output
# carries alpha * exp(x) only to within a rounding of alpha, so where inputs sit far below 0 the derivative's error
# grows as exp(-x), and in float32 an input below about -17 gets the gradient 0 where torch's is exp(x) > 0 (a unit
# that sits there, which Adam would move at its full step size, never moves). So convert does not swap ELU, CELU or
# SELU for their keep-output forms (memtrim.nn's, by hand, keep that limit): with a traced forward,
# ``activation_consumer`` rebuilds their output for the call sites that keep it instead, with torch's kernels
# (bitwise, the same bytes); without one they stay torch's
_ELU_FAMILY = (nn.ELU, nn.CELU, nn.SELU)
_ELU_IN_PLACE = "{} runs in place: torch's in-place op keeps its output only already (nothing to save)"
_ELU_UNTRACED = ("{} keeps its input, as torch's does: its derivative from the output (y + alpha) loses precision far "
                 "below 0 (in float32 an input below about -17 gets the gradient 0); with example_inputs convert "
                 "rebuilds its output in backward for the modules that keep it instead (bitwise)")


def _single_refusal(module: nn.Module) -> str | None:
    if isinstance(module, nn.LeakyReLU) and module.negative_slope < 0:
        return "LeakyReLU with a negative slope: the output does not determine the gradient"
    if isinstance(module, (nn.ELU, nn.CELU)) and module.alpha <= 0:
        return "alpha <= 0: the output does not determine the gradient"
    if isinstance(module, nn.Softplus) and not softplus_keeps_output(module.threshold, torch.float32):
        return (f"Softplus with threshold {module.threshold}: just below the threshold the output is also a possible "
                "output of the linear region, and the two gradients differ by up to exp(-threshold); it would keep "
                "its input, as torch's does (from threshold 17.3 up in float32 it keeps its output)")
    return None


@register_rule("keep_output")
def keep_output(ctx: Context) -> Iterator[Candidate]:
    """Single torch modules that keep their input become ``memtrim.nn`` forms that keep their output."""
    for name, module in ctx.modules.items():
        if type(module) in _ELU_FAMILY and ctx.trace is None and ctx.free(module):
            yield Candidate((name,), reason=(_ELU_IN_PLACE if module.inplace else _ELU_UNTRACED).format(
                type(module).__name__), skip=True)
            continue
        target = KEEP_OUTPUT_FORMS.get(type(module))
        if target is None or not ctx.free(module):
            continue
        norm = target in (LayerNorm, RMSNorm)
        why = (_single_refusal(module) or ctx.edited(name) or ctx.input_edited(name)
               or (half_precision_guard(ctx, name, module, "keeping its output, it") if norm else None))
        if why:
            yield Candidate((name,), reason=why, skip=True)
            continue
        owner = label((name,), f"memtrim.nn.{target.__name__}")
        attrs: dict = {"memtrim_owner": owner}
        if target in (lean.ReLU, lean.LeakyReLU, lean.Hardtanh, lean.ReLU6, lean.Hardsigmoid):
            attrs["save"] = "output"
        limits: tuple[str, ...] = ()
        if norm:
            attrs["gamma_threshold"] = 0.0  # the error bound decides
            limits = (REBUILT_INPUT, NO_DOUBLE_BACKWARD, NO_AUTOCAST)
        elif target is lean.Hardsigmoid:
            limits = (HARDSIGMOID_EDGE,)
        elif target not in _BITWISE_FROM_OUTPUT:
            limits = (FROM_OUTPUT,)
        yield Candidate((name,), type(module).__name__, f"memtrim.nn.{target.__name__}",
                        reason="keeps its output instead of its input", targets=(module,), limits=limits,
                        bitwise=not limits, apply=partial(class_swap, module, target, **attrs),
                        expected_bytes=_nothing_to_drop(ctx, name))


def _nothing_to_drop(ctx: Context, name: str) -> int | None:
    """0 where every call of module ``name`` keeps nothing but its output already (torch's ``leaky_relu_`` and
    ``relu_`` keep their result), so a form keeping its output keeps the same bytes; None (measure it) otherwise. (A
    LeakyReLU model had each of these applied and measured alone, a forward apiece, until 2026-12-03.)"""
    trace = ctx.trace
    sites = trace.sites_of(name) if trace is not None else []
    if trace is not None and sites and all(set(trace.held_inside(s)) <= set(s.outputs) for s in sites):
        return 0
    return None


from . import norms as _norms  # noqa: E402,F401  (registers norm_by_behaviour after keep_output)
from . import recompute_rules as _recompute_rules  # noqa: E402,F401  (registers the per-call-site rules)

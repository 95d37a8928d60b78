"""Norms recognised by what they compute, whatever their class: the ``norm_by_behaviour`` rule.

NOTE [ norms by behaviour ]
Class names do not predict behaviour; traced ops do. A call site whose compute ops (views, permutes and copies left
out) are one ``native_layer_norm`` is a LayerNorm (timm's ``LayerNorm``/``LayerNorm2d``, any subclass or wrapper
of ``F.layer_norm``); one whose ops are ``pow, mean, add, rsqrt, mul, mul`` with the last ``mul`` by a 1-D parameter
of the module is an RMSNorm (HF ``LlamaRMSNorm`` and its copies in Mistral/Qwen/..., timm's ``RmsNorm``). Either
becomes a norm that keeps its output (NOTE [ norms that keep their output ] in norms/keep_output.py) when its
output is kept by a later op anyway (else it would save nothing), it computes in its input's dtype (an upcast,
as in a bfloat16 Llama, would make the output a rounded copy of what backward needs: precision guard) and its
weights are not float16 or bfloat16 (NOTE [ norms in half precision ] in norms/_kernels.py). An RMSNorm that cannot
for those two reasons is recomputed in backward instead where it keeps more than its input (HF's Llama RMSNorm in
bfloat16 keeps float32 copies of it): ``_Recomputed`` keeps the input and the module's parameters and runs the
module's own forward again, with the parameters and the numbers the forward read, bitwise. So is a leaf norm with an
``rsqrt`` whose ops are not the canonical ones (Gemma's ``x * rsqrt(mean(x^2) + eps) * (1 + w)``, which no keep-output
form computes), where every op it runs reads only its input, its own parameters and what it computed from those
(``1 + w``; NOTE [ what a recomputed norm may read ]). A LayerNorm
whose output only later call sites keep is decided before, by ``layer_norm_consumer`` (NOTE [ recompute rules ]):
it stays torch's own, bitwise.

The change is a class swap to a subclass of the module's own class made once per class (parameters, buffers, hooks,
attribute names and state_dict keys unchanged; a state_dict loads into the unconverted class). The LayerNorm form
runs the module's own forward with its ``layer_norm`` call replaced (a ``TorchFunctionMode``); the RMSNorm form
computes ``x * rsqrt(mean(x^2) + eps) * weight`` in the same op order, so the forward is bitwise the original's in the
dtype convert traced (HF's RMSNorms compute any other in float32). Under torch.compile, torch.func, autocast, without
grad, for a float16 or bfloat16 input, or for an input in another dtype than the weight (the RMSNorm form: than the
traced one), both run the module's own forward; so does the RMSNorm form for an unbatched or empty input, and once a
setting of the module (its eps: any number, flag or string in its ``__dict__``) differs from what convert saw, with a
warning. While a CUDA graph is captured the LayerNorm form runs the module's own forward too, and the RMSNorm form
torch's ops with one tensor rebuilt in backward (NOTE [ an RMSNorm while a CUDA graph is captured ]).
"""

from __future__ import annotations

import builtins
import copyreg
import inspect
import warnings
from collections.abc import Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import ConvertError
from ...proof.compare import bitwise_equal
from ..checkpoint._core import _MARK as _CHECKPOINTED
from ..guards import (
    autocasting,
    capturing,
    hooks_allowed,
    no_double_backward,
    owner,
    plain_apply,
    plain_only,
    saves_checked,
)
from ..norms._kernels import HALF_PRECISION, _keep_mask
from ..norms.keep_output import apply_norm_keep_output
from ..recompute import mark_recomputable, recipes_honoured
from .builtin import KEEP_OUTPUT_FORMS, NO_AUTOCAST, NO_DOUBLE_BACKWARD, REBUILT_INPUT, half_precision_guard
from .evidence import CallSite, ModelTrace, buffers_kept
from .rules import Candidate, Context, class_swap, label, register_rule

__all__ = ["IN_TRACED_DTYPE", "RMS_OPS", "layer_norm_form", "rms_norm_form"]

RMS_OPS = ["pow", "mean", "add", "rsqrt", "mul", "mul"]
SHIFTED_RMS_OPS = ["pow", "mean", "add", "rsqrt", "mul", "add", "mul"]  # Gemma's `* (1 + w)`, in its own dtype
IN_TRACED_DTYPE = ("keeps its output for {} inputs, the dtype convert traced it in; after model.to() another dtype "
                   "runs the module's own forward (which may upcast) and saves nothing: convert after casting")
"""The limit of the RMSNorm form: its forward is the module's, bitwise, only in the dtype convert traced."""
_LAYER_NORM_FUNCTIONS = {torch.nn.functional.layer_norm, torch.layer_norm}
# the compute ops a norm recomputed by its own forward may run besides the canonical ones (Gemma's `* (1 + w)`):
# pointwise ops and plain reductions, whose kernels give the same bits when run again on the same values (no
# scatter or index_add, which may not on CUDA, no matmul whose kernel a recomputation could pick otherwise)
_NORM_OPS = frozenset({
    "mul", "add", "sub", "div", "pow", "rsqrt", "sqrt", "reciprocal", "neg", "rsub", "abs", "square", "exp", "log",
    "tanh", "sigmoid", "clamp", "clamp_min", "clamp_max", "minimum", "maximum", "where", "mean", "sum", "var",
    "var_mean", "std", "amax", "amin", "linalg_vector_norm", "norm",
})


def _wants_plain(x: Any, params: list[torch.Tensor]) -> bool:
    return (not isinstance(x, torch.Tensor) or not torch.is_grad_enabled() or plain_only(in_backward=False)
            or not saves_checked()
            or autocasting(x) or x.dtype in HALF_PRECISION  # (NOTE [ norms in half precision ]: after model.to())
            or not (x.requires_grad or any(p.requires_grad for p in params)))


# NOTE [ an RMSNorm while a CUDA graph is captured ]
# The keep-output form decides from its weights' values which features keep their input, which a capture cannot
# record (NOTE [ keep decisions while a CUDA graph is captured ] in norms/_kernels.py). A LayerNorm runs as torch's
# there. An RMSNorm's ops are torch's own small ops, so it runs them as the module does (the same ops on the same
# values: its forward, bitwise) but for one thing: ``x * rsqrt(...)``, which the multiply by the weight keeps, is a
# recipe (NOTE [ recipes at consumer call sites ] in recompute/_core.py) rebuilt in backward from ``x`` and the rsqrt,
# which the ops keep anyway. The graph's nodes are torch's, so its gradients are too, bitwise; it keeps its input,
# the rsqrt and its output (which the next layers keep), where the keep-output form keeps its output alone and torch
# keeps ``x * rsqrt(...)`` besides. No decision, no wait: what a capture records holds at every replay. An input that
# needs no gradient is kept by none of the ops: ``x * rsqrt(...)`` is kept as itself then, as torch keeps it. An input
# written through ``.data`` between forward and backward (no version bump for autograd to see) rebuilds it from the
# written values, where torch reads the one it kept.
def _rms_rebuilding_xhat(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float,
                         who: str) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps) * (weight [+ offset])`` as torch runs it, keeping ``x * rsqrt(...)`` as a
    recipe (NOTE [ an RMSNorm while a CUDA graph is captured ]); callers have found :func:`_wants_plain` false."""
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    gamma = weight + offset if offset else weight
    if not x.requires_grad:  # the ops keep neither x nor the rsqrt then, only xhat for the weight's gradient: a
        return xhat * gamma  # recipe would keep more, and an x that may change after (found by an adversarial pass)
    mark_recomputable(xhat, torch.mul, x, rstd, owner=who, checked=True)
    with recipes_honoured():
        return xhat * gamma


class _LayerNormKeepsOutput(TorchFunctionMode):
    """Inside a converted module's forward: ``layer_norm`` calls run as the keep-output norm."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _LAYER_NORM_FUNCTIONS:
            return func(*args, **kwargs)
        bound = dict(zip(("input", "normalized_shape", "weight", "bias", "eps"), args))
        bound.update({k: v for k, v in kwargs.items() if k in ("input", "normalized_shape", "weight", "bias", "eps")})
        x, weight, bias = bound["input"], bound.get("weight"), bound.get("bias")
        params = [t for t in (weight, bias) if isinstance(t, torch.Tensor)]
        if (_wants_plain(x, params) or any(p.dtype != x.dtype for p in params)
                or capturing(x)):  # (NOTE [ keep decisions while a CUDA graph is captured ] in norms/_kernels.py)
            return func(*args, **kwargs)
        return apply_norm_keep_output(x, weight, bias, (tuple(bound["normalized_shape"]), bound.get("eps", 1e-5),
                                      "layer", _threshold(self.module), owner(self.module)))


def _threshold(module: nn.Module) -> float:
    """``getattr(module, "gamma_threshold", 0.0)`` without nn.Module's ``__getattr__``, which raises and catches an
    AttributeError for a module without one (every norm convert changed), at every call."""
    state = module.__dict__
    if "gamma_threshold" in state:
        return state["gamma_threshold"]
    if (hasattr(type(module), "gamma_threshold") or "gamma_threshold" in module._parameters
            or "gamma_threshold" in module._buffers):  # (a class's, a property's, a buffer's: as getattr finds it)
        return getattr(module, "gamma_threshold", 0.0)
    return 0.0


_FORMS: dict[tuple[type, str], type] = {}


def _form(base: type[nn.Module], kind: str) -> type:
    """The keep-output (or ``kind="recomputed"``) subclass of ``base``, made once per class. It pickles as (``base``,
    ``kind``) and is made again from them (``__reduce_ex__`` below); its name is also bound in this module for pickles
    made before that, which name it."""
    found = _FORMS.get((base, kind))
    if found is not None:
        return found
    name = f"KeepOutput{base.__name__}"

    if kind == "layer":
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if plain_only(in_backward=False) or not torch.is_grad_enabled():
                return base.forward(self, *args, **kwargs)
            with _LayerNormKeepsOutput(self):
                return base.forward(self, *args, **kwargs)
    elif kind == "recomputed":
        name = f"Recomputed{base.__name__}"

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            x = args[0] if args else next(iter(kwargs.values()), None)
            # its parameters are the ones convert saw, its own (no parametrization registered since; no parameter,
            # buffer or submodule added since, which the recomputation would read as backward finds it), and the
            # input has the dtype convert traced (after model.float(), the upcast is no copy: the input feeds two
            # ops, whose gradients autograd adds in another order than the recomputation would)
            # (a module pickled by a memtrim before these names, with `memtrim_weight`, runs its own forward)
            names: tuple[str, ...] = self.__dict__.get("memtrim_params", ())
            found = [self._parameters.get(n) for n in names]
            params = [p for p in found if p is not None]
            if ("memtrim_params" not in self.__dict__ or len(params) != len(names)
                    or sum(p is not None for p in self._parameters.values()) != len(names)
                    or tuple(self._modules) != self.__dict__.get("memtrim_modules") or self._buffers
                    or not isinstance(x, torch.Tensor) or x.dtype != self.memtrim_dtype
                    or len(args) + len(kwargs) != 1 or not torch.is_grad_enabled() or plain_only()
                    or not saves_checked() or not hooks_allowed() or autocasting(x)
                    or not (x.requires_grad or any(p.requires_grad for p in params))):
                return base.forward(self, *args, **kwargs)
            return _apply_recomputed(self, base.forward, names, x, *params)
    else:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # (weight name, eps, and what Gemma's RMSNorm adds to the weight; pickled before that: no offset)
            state = self.__dict__
            weight_name, eps, *shift = state["memtrim_rms"]  # (no typing.cast: a call at every forward)
            weight = self._parameters.get(weight_name)
            if weight is None:  # (not a parameter now: whatever the name gives, as the module's own forward reads it)
                weight = getattr(self, weight_name)
            x = args[0] if args else next(iter(kwargs.values()), None)
            # the dtype convert traced it in (where it computed in its input's dtype; HF's RMSNorms upcast any other
            # to float32): another one, after model.to(), runs the module's own forward; so does an unbatched or
            # empty input, and a module whose settings (its eps) changed since convert; and one in eval mode: its
            # forward was checked in training mode (_behaves_as_rms_norm), and one that picks its eps by its training
            # flag computed another norm in eval with grad on (found by an adversarial pass, 0.69 off)
            if (not isinstance(x, torch.Tensor) or _wants_plain(x, [weight]) or x.dtype != weight.dtype
                    or x.dtype != state.get("memtrim_dtype", x.dtype) or len(args) + len(kwargs) != 1
                    or x.dim() <= 1 or x.numel() == 0 or not self.training or _settings_changed(self)):
                return base.forward(self, *args, **kwargs)
            if capturing(x):  # (NOTE [ an RMSNorm while a CUDA graph is captured ])
                return _rms_rebuilding_xhat(x, weight, eps, shift[0] if shift else 0.0, owner(self))
            return apply_norm_keep_output(x, weight, None, (tuple(weight.shape), eps, "rms", _threshold(self),
                                                          owner(self), *shift))

    doc = (f"{base.__qualname__} "
           f"{'recomputed in backward from its input' if kind == 'recomputed' else 'keeping its output'} instead of "
           "what it keeps (made by memtrim.convert; see NOTE [ norms by behaviour ] in "
           "memtrim/techniques/convert/norms.py).")
    def __reduce_ex__(self: nn.Module, protocol: Any) -> Any:
        # pickled as (its base class, its kind) and made again from them, not by its name: two classes of one name
        # (a library's RMSNorm and a user's) make two forms of one name, and a new process has made none yet
        reduced = base.__reduce_ex__(self, protocol)  # (what pickling the base does)
        if isinstance(reduced, tuple) and reduced[0] is _NEWOBJ and reduced[1] == (form,):
            return (_made_again, (base, kind), *reduced[2:])
        return reduced  # (a base with a pickling of its own)

    form = type(name, (base,), {"forward": forward, "__doc__": doc, "__module__": __name__, "__qualname__": name,
                                "__reduce_ex__": __reduce_ex__,
                                # (NOTE [ keep decisions made together ])
                                "memtrim_keep_decisions": kind != "recomputed"})
    _FORMS[(base, kind)] = form
    globals().setdefault(name, form)
    return form


def _made_again(base: type[nn.Module], kind: str) -> nn.Module:
    """An empty module of ``base``'s form of ``kind`` (unpickling: its state is set after)."""
    form = _form(base, kind)
    return cast(nn.Module, object.__new__(form))


_NEWOBJ = copyreg.__newobj__  # type: ignore[attr-defined]  # what object.__reduce_ex__ builds an instance with


def layer_norm_form(base: type[nn.Module]) -> type:
    """The keep-output subclass of a LayerNorm-like class ``base`` (its ``layer_norm`` call replaced)."""
    return _form(base, "layer")


def _settings(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """What the module's forward may read from its ``__dict__``, as convert saw it: its own plain settings (numbers,
    flags, strings and Nones: an RMSNorm's eps, a clip switched on later), and every other name its forward's code
    names (:func:`_forward_names`: ``self.post``, ``getattr(self, "post", None)``), with :data:`_ABSENT` where the
    module has none yet."""
    state = module.__dict__
    found = {k: v for k, v in state.items()
             if type(v) in _PLAIN_SETTING and k != "training" and not k.startswith(("_", "memtrim"))}
    for name in _forward_names(type(module)):
        if name not in found and name not in module._parameters and name not in module._buffers \
                and name not in module._modules:
            found[name] = state.get(name, _ABSENT)
    return tuple(found.items())


_PLAIN_SETTING = (int, float, bool, str, type(None))
_ABSENT = "<memtrim: no such attribute>"  # (a string: it pickles and copies as itself, and compares equal to itself)


def _forward_names(cls: type) -> frozenset[str]:
    """The attribute names and string constants in ``cls.forward``'s code (nested code too), but builtins, the
    globals of the forward's module and ``nn.Module``'s own attributes."""
    forward: Any = getattr(cls, "forward", None)
    if callable(forward):
        forward = inspect.unwrap(forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return frozenset()
    names: set[str] = set()
    codes = [code]
    while codes:
        c = codes.pop()
        names.update(c.co_names)
        for const in c.co_consts:
            if isinstance(const, str) and const.isidentifier():
                names.add(const)
            elif hasattr(const, "co_names"):
                codes.append(const)
    # (a tensor method's name is kept: `self.clip` reads the module, `y.clip` the tensor, and the code does not say
    # which; a name the module never has costs one lookup a call)
    scope = getattr(forward, "__globals__", {})
    return frozenset(n for n in names if not n.startswith(("_", "memtrim")) and n != "training" and n not in scope
                     and not hasattr(builtins, n) and not hasattr(nn.Module, n))


def _settings_changed(module: nn.Module) -> bool:
    """Whether what :func:`_settings` recorded at convert differs now (warned once per module: it saves nothing
    then). The RMSNorm form computes the norm the trace showed, without the module's own forward: a setting that
    forward reads (its eps, a clip it applies once set) changed or set since, its own forward must run."""
    state = module.__dict__
    for key, value in state.get("memtrim_settings", ()):
        now = state.get(key, _ABSENT)
        if now is not value and not (type(now) in _PLAIN_SETTING and type(value) in _PLAIN_SETTING and now == value):
            return _warn_changed(module, key, now, value)
    return False


def _warn_changed(module: nn.Module, key: str, now: Any, value: Any) -> bool:
    state = module.__dict__
    if not state.get("memtrim_settings_warned"):
        state["memtrim_settings_warned"] = True
        was, now_text = ("not set" if isinstance(v, str) and v == _ABSENT else repr(v) for v in (value, now))
        warnings.warn(f"memtrim.convert: {owner(module)}'s {key} is {now_text}, changed after convert (it was "
                      f"{was}): it runs its own forward now and saves nothing. Convert after changing it.",
                      stacklevel=4)
    return True


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Recomputed(torch.autograd.Function):
    """A norm's own forward, keeping its input and its parameters (autograd checks their versions) instead of what its
    ops keep; backward runs the forward again on them, with the parameters and the module's attributes as the forward
    read them (its eps, its training flag, anything set on it per call), and differentiates it: the same ops on the
    same values, so torch's gradients bit for bit. No second derivative (``no_double_backward``). Not seen, as with
    torch's own checkpoint: a global, or an object the module holds, changed between forward and backward."""

    @staticmethod
    def forward(ctx: Any, module: nn.Module, run: Any, names: tuple[str, ...], x: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, *params)
        ctx.module, ctx.run, ctx.names, ctx.owner = module, run, names, owner(module)
        ctx.attributes = dict(vars(module))  # (the values its forward reads now: a parent may set one per call)
        ctx.rebuilds = "keeps its input and runs its forward again"  # (no_double_backward's message)
        # with grad mode on, as the unconverted forward runs (a forward may read it); what its ops save is freed with
        # the graph at the return, kept detached meanwhile: not handed to a user's saved-tensor hooks (an offload
        # would copy it for nothing), and not as itself, which for an op that saves its output (rsqrt) holds the
        # output's own node, a cycle through C++ that gc cannot free (it kept every call's graph alive, the input's
        # too; found by an adversarial pass)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_detached, _as_is):
            return run(module, x).detach()

    @staticmethod
    @no_double_backward
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        module = ctx.module
        leaves = tuple(t.detach().requires_grad_(needs) for t, needs in zip(saved, ctx.needs_input_grad[3:]))
        # the forward again on a stand-in of the module (the attributes and parameters the forward read): the module
        # itself is left alone, so another thread's forward of it reads its own weight meanwhile
        stand_in = object.__new__(type(module))
        vars(stand_in).update(ctx.attributes, _parameters={**ctx.attributes["_parameters"],
                                                           **dict(zip(ctx.names, leaves[1:]))})
        with torch.enable_grad():
            out = ctx.run(stand_in, leaves[0])
        wanted = [t for t in leaves if t.requires_grad]
        try:
            found = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            raise ConvertError(  # (found by an adversarial pass: torch's error named a call the user never made)
                f"memtrim.convert: {ctx.owner} is recomputed in backward and differentiated with torch.autograd.grad, "
                "which torch's reentrant checkpoint inside its forward refuses. Expected a forward without "
                "torch.utils.checkpoint(use_reentrant=True); to fix: use_reentrant=False inside it, or leave this "
                f"module out of memtrim.convert (module_filter). torch: {e}") from e
        return (None, None, None, *(next(found) if t.requires_grad else None for t in leaves))


_apply_recomputed = plain_apply(_Recomputed)  # (its callers have found plain_only false)


def recomputed_form(base: type[nn.Module]) -> type:
    """The subclass of an RMSNorm-like class ``base`` recomputed in backward (needs ``memtrim_params`` and
    ``memtrim_modules``, the names of its parameters and submodules, and ``memtrim_dtype``, the input dtype convert
    traced)."""
    return _form(base, "recomputed")


def rms_norm_form(base: type[nn.Module]) -> type:
    """The keep-output subclass of an RMSNorm-like class ``base`` (needs ``memtrim_rms = (weight name, eps)``, or
    ``(weight name, eps, offset)`` for a norm that multiplies by ``offset + weight``: Gemma's ``1 + w``)."""
    return _form(base, "rms")


def _innermost(trace: ModelTrace, site: CallSite) -> bool:
    """No child call of ``site`` ran all of its ops (a wrapper around a norm is not the norm)."""
    return not any(s.parent == site.index and s.first_op == site.first_op and s.last_op == site.last_op
                   for s in trace.sites[site.index + 1:])


def _rms_spec(trace: ModelTrace, site: CallSite, module: nn.Module) -> tuple[str, float, float] | str:
    """``(weight name, eps, offset)`` of an RMSNorm-shaped call site, or why it is not one convert can rebuild.

    The op names are not enough (a 4th-moment norm, a statistic over another axis through a view, a gated norm
    grouping features have them too): the call must run exactly ``pow(x, 2)``, ``mean(-1, keepdim=True)``, ``+ eps``,
    ``rsqrt``, ``x *`` and ``* weight`` (or ``* (offset + weight)``, Gemma's ``1 + w``) on its own input, nothing else
    (no view, no in-place op), and its forward must then give the canonical formula's output and gradients bit for
    bit (:func:`_behaves_as_rms_norm`: what aten ops cannot show, a statistic computed under no_grad or through
    ``.data``)."""
    # (detaches left out: the trace's own saves make them; a detach of the module's is in the gradients checked below)
    ops = [o for o in trace.ops_in(site, compute_only=False) if o.name != "detach"]
    if [o.name for o in ops] not in (RMS_OPS, SHIFTED_RMS_OPS) or len(site.inputs) != 1 or len(site.outputs) != 1:
        return ("an RMSNorm-like call that runs other ops too (a view, an in-place op: "
                f"{', '.join(o.name for o in ops)}) or takes more than its input")
    shift = ops.pop(5) if len(ops) == len(SHIFTED_RMS_OPS) else None
    pow_, mean, add, rsqrt, first, last = ops
    x = site.inputs[0]
    dims = mean.scalars[0] if mean.scalars else None
    if (list(dims) if isinstance(dims, (list, tuple)) else [dims]) != [-1] or mean.scalars[1:2] != (True,):
        return "an RMSNorm-like call whose mean is not over the last dimension, kept"
    eps = next((s for s in add.scalars if isinstance(s, float)), None)
    if eps is None:
        return "an RMSNorm-like call whose eps is not a constant"
    own = {id(p.untyped_storage()): n for n, p in module.named_parameters(recurse=False)}
    gain = shift if shift is not None else last  # (the op that reads the weight)
    weights = [own[k] for k in gain.inputs if k in own]
    if len(weights) != 1 or getattr(module, weights[0]).dim() != 1:
        return "an RMSNorm-like call whose last multiply is not by a 1-D parameter of the module"
    weight_key = next(k for k in gain.inputs if k in own)
    offset = 0.0
    if shift is not None:
        found = [s for s in shift.scalars if isinstance(s, (int, float)) and not isinstance(s, bool)]
        if shift.inputs != (weight_key,) or len(found) != 1 or found[0] == 0.0 or len(shift.scalars) != 1:
            return "an RMSNorm-like call whose weight is shifted by other than one constant (as Gemma's 1 + w)"
        offset = float(found[0])  # (`1 + w` and `1.0 + w` add the same value)
    factor = weight_key if shift is None else shift.outputs[0]
    flow = (pow_.inputs == (x,) and pow_.scalars[:1] in ((2,), (2.0,)) and mean.inputs == pow_.outputs
            and add.inputs == mean.outputs and rsqrt.inputs == add.outputs
            and sorted(first.inputs) == sorted((x, *rsqrt.outputs))
            and sorted(last.inputs) == sorted((factor, *first.outputs)) and last.outputs == site.outputs
            and (shift is None or len(shift.outputs) == 1))
    if not flow:
        return ("an RMSNorm-like call that computes something else than x * rsqrt(mean(x^2, -1) + eps) * weight "
                "(another power, axis or operand)")
    with buffers_kept(module):  # (a forward that counts its calls in an attribute, as convert's own runs do)
        why = _behaves_as_rms_norm(module, weights[0], float(eps), site.input_shapes[0], offset)
    if why:
        return f"an RMSNorm-like call whose forward, run again on a random input of its traced shape, {why}"
    return weights[0], float(eps), offset


def _behaves_as_rms_norm(module: nn.Module, weight_name: str, eps: float, shape: tuple[int, ...],
                         offset: float = 0.0) -> str:
    """Why ``module``'s own forward, in training mode, with random weights on a random input of the traced
    ``shape``, does not give the output and the input and weight gradients that autograd gives for ``x *
    rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight`` (``* (weight + offset)`` with an offset) bit for bit (the
    same ops in the same order give the same bits): "" where it does. Run on the CPU outside any fake or dispatch mode
    (a plan's trace), the module's parameters swapped for the call and its training flag set as in training, both put
    back."""
    params = module._parameters
    held, training = dict(params), module.training
    weight = held[weight_name]
    assert weight is not None
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.utils._python_dispatch._disable_current_modes(), torch.enable_grad():
            for name, p in held.items():
                if p is not None:
                    params[name] = nn.Parameter(torch.randn(p.shape, generator=generator, dtype=p.dtype)
                                                if p.is_floating_point() else torch.zeros(p.shape, dtype=p.dtype),
                                                requires_grad=p.is_floating_point())
            w = params[weight_name]
            assert w is not None
            module.training = True  # convert traced it in training mode (as_training); it trains in it
            x = torch.randn(shape, generator=generator, dtype=weight.dtype, requires_grad=True)
            tables: tuple[dict[str, Any], ...] = (vars(module), module._buffers, params)
            state = [dict(table) for table in tables]
            out = module.forward(x)
            if not all(before.keys() == now.keys() and all(now[k] is v for k, v in before.items())
                       for before, now in zip(state, tables)):
                # (the form computes the formula and runs no forward of the module's: a cache its forward keeps, as
                # `self.scale = 1 + self.weight` read again under no_grad, would be stale; found by an adversarial
                # pass, 0.013 off in evaluation)
                return ("sets an attribute of its own in its forward (a cached value), which the keep-output form "
                        "would not")
            expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + offset if offset else w)
            if not isinstance(out, torch.Tensor) or not bitwise_equal(out.detach(), expected.detach()):
                return "gives another output than the formula"
            grad = torch.randn(shape, generator=generator, dtype=weight.dtype)
            found = torch.autograd.grad(out, (x, w), grad, allow_unused=True)
            wanted = torch.autograd.grad(expected, (x, w), grad)
            if any(f is None or not bitwise_equal(f, e) for f, e in zip(found, wanted)):
                return "gives other gradients than the formula (a statistic under no_grad or detached)"
    except Exception as e:  # it needs its own values, or raises on a random input: not checkable, left alone
        return f"raised {type(e).__name__}: {e}"
    finally:
        params.update(held)
        module.training = training
    return ""


def _expected(trace: ModelTrace, site: CallSite) -> tuple[int, bool]:
    """(bytes the keep-output form drops, whether the output is kept after the call anyway)."""
    out_keys = set(site.outputs)
    kept_after = any(h.time > site.end and site.index not in h.stack
                     for k in out_keys for h in trace.storages[k].holders)
    big = max((trace.storages[k].nbytes for k in out_keys), default=0)
    dropped = 0
    for key in trace.held_inside(site):  # (every holder inside the call: at least one is)
        record = trace.storages[key]
        if (record.kind == "activation" or key in site.inputs) and record.kind != "parameter" and record.holders \
                and all(site.index in h.stack for h in record.holders) and record.nbytes >= big and key not in out_keys:
            dropped += record.nbytes
    return dropped - (0 if kept_after else big), kept_after


RECOMPUTED_NORM = (
    "its forward runs again in backward on its kept input, with the parameters and the numbers the forward read "
    "(the parameters version-checked), bitwise",
    "its input is kept for the recomputation: an input changed in place between forward and backward raises "
    "autograd's in-place error, where torch's module, keeping copies of it, would not need it",
    NO_DOUBLE_BACKWARD,
    "runs as its own forward under torch.compile, torch.func and autocast, without grad, and inside a checkpointed "
    "region (HF gradient checkpointing), which keeps its inputs itself",
)


def _recomputed(ctx: Context, trace: ModelTrace, site: CallSite, why: str) -> Candidate:
    """An RMSNorm the keep-output form cannot take (``why``: an upcast, half precision) recomputed in backward
    instead, keeping its input (HF's Llama RMSNorm in bfloat16 keeps float32 copies of it besides its output); or the
    skip with ``why`` where it cannot be, or would save nothing."""
    from .recompute_rules import _kept_inside, _random_ops  # (that module imports this one)

    module = site.module
    sites = trace.sites_of(site.path)
    acts = [k for k in site.inputs if trace.storages[k].kind != "parameter"]
    hooks = ctx.user_hooks(module)
    later = next((trace.site_name(op.site) for s in sites for op in trace.writers()
                  if op.time > s.end and set(op.writes) & set(acts)), None)
    # NOTE [ what a recomputed norm may read ]
    # the recomputation reads the module's parameters as the forward left them (version-checked) and its numbers as
    # the forward read them; anything else its ops read it would read as backward finds it: a gain set on the module
    # from outside (AdaLN's `self.norm.gain = ...`), a global tensor. So every tensor an op of each call reads must
    # be the call's input, a parameter of the module's own, or made by an earlier op of the call (Gemma's `1 + w`),
    # nothing it writes in place may come from outside the call, and nothing may draw random numbers
    own = {id(p.untyped_storage()): n for n, p in module.named_parameters(recurse=False)}
    strangers: list[int] = []
    written: list[int] = []
    params_read: dict[tuple[int, int], int] = {}
    for s in sites:
        allowed = set(own) | {k for k in s.inputs if trace.storages[k].kind != "parameter"}
        made: set[int] = set()
        for op in trace.ops_in(s, compute_only=False):
            strangers += [k for k in op.inputs if k not in allowed and k not in made]
            written += [k for k in op.writes if k not in made]
            made.update(k for k in op.outputs if (p := trace.storages[k].producer) is not None
                        and s.first_op <= p < s.last_op)
            for k in set(op.inputs) & set(own):  # (a view of a parameter reads it once: its reader reads it)
                if k not in op.outputs:
                    params_read[(s.index, k)] = params_read.get((s.index, k), 0) + 1
    random = sorted({name for s in sites for name in _random_ops(trace, s)})
    # autograd adds the gradients of an input two ops read inside the norm before the one from outside; the
    # recomputation hands back their sum, added after it: another rounding (T5's LayerNorm, an RMSNorm in bfloat16
    # that does not upcast, Gemma's in float32). One reader (HF's Llama and Gemma upcasts: the float32 copy reads it)
    # gives the same sum (detaches left out: the trace's own saves make them). Counted at each call, on its own input
    inputs_of = {s.index: {k for k in s.inputs if trace.storages[k].kind != "parameter"} for s in sites}
    counts = [sum(1 for o in trace.ops_in(s, compute_only=False)
                  if o.name != "detach" and set(o.inputs) & inputs_of[s.index]) for s in sites]
    readers = next((n for n in counts if n != 1), 1)
    many = sorted({own[k] for (_, k), n in params_read.items() if n > 1})
    cannot = ("it takes more than one tensor" if len(acts) != 1 or len(site.input_dtypes) != 1 else
              f"{readers} of its ops read its input, whose gradients the recomputation would add in another order"
              if readers != 1 else
              "it has buffers, which a recomputation would read as backward finds them" if module._buffers else
              "its ops read a tensor that is neither its input, a parameter of its own nor made from those (a gain "
              "set on it from outside, not by a parameter of its own), which a recomputation would read as backward "
              "finds it" if strangers else
              "it writes its input or a tensor from outside in place, which a recomputation would write again"
              if written else
              f"it draws random numbers ({', '.join(random)}), which a recomputation would draw anew" if random else
              f"its parameter{'s' if len(many) > 1 else ''} {', '.join(many)} "
              f"{'are' if len(many) > 1 else 'is'} read by more than one of its ops, whose gradients the "
              "recomputation would add in another order" if many else
              f"it has {', '.join(hooks)}, which a recomputation would run again" if hooks else
              f"its input is changed in place after it (in {later or 'the top-level forward'}), and a recomputation "
              "needs it as it was" if later is not None else
              "it is checkpointed already" if _CHECKPOINTED in module.__dict__ else
              None)
    if cannot is not None:
        return Candidate((site.path,), reason=f"{why}; not recomputed either: {cannot}", skip=True)
    # the recomputation keeps the input: a cost where nothing else keeps it
    kept_anyway = any(trace.holders_outside(k, s) for k in acts for s in sites)
    expected = _kept_inside(trace, site) - (0 if kept_anyway else sum(trace.storages[k].nbytes for k in acts))
    if expected <= 0:
        return Candidate((site.path,), reason=f"{why}; a recomputation would save nothing", skip=True)
    names = tuple(n for n, p in module._parameters.items() if p is not None)
    target = recomputed_form(type(module))
    return Candidate((site.path,), type(module).__name__, f"recomputed in backward ({target.__name__})",
                     reason=f"{why}: recomputed in backward instead", targets=(module,), expected_bytes=expected,
                     limits=RECOMPUTED_NORM, apply=partial(class_swap, module, target, memtrim_params=names,
                                                           memtrim_modules=tuple(module._modules),
                                                           memtrim_dtype=site.input_dtypes[0],
                                                           memtrim_owner=label((site.path,), "a recomputed norm")))


def _weight_copies(module: nn.Module, rms: tuple[Any, ...] | None) -> int | None:
    """The bytes a keep-output form of ``module`` holds at each call beyond what the trace of the unconverted one
    counts: the copies of its weight and bias that its rebuild reads (NOTE [ the weights a rebuild reads ] in
    norms/_kernels.py; Gemma's ``1 + w`` is no copy). None where that is not known before it runs: it would keep some
    features' input too (decided from the weights' values: NOTE [ when a norm keeps its input ]), or its weights are
    not the ``weight`` and ``bias`` of a LayerNorm (``rms``: an RMSNorm's spec, its weight's name first)."""
    if rms is not None:
        name, _, *shift = rms
        weight, bias, offset = module._parameters.get(name), None, (shift[0] if shift else 0.0)
    else:
        if set(module._parameters) - {"weight", "bias"}:
            return None
        weight, bias, offset = module._parameters.get("weight"), module._parameters.get("bias"), 0.0
    if weight is None:
        return None if rms is not None or bias is not None else 0
    if any(t.is_meta or type(t) not in (nn.Parameter, torch.Tensor) for t in (weight, bias) if t is not None):
        return None
    with torch.no_grad():
        if bool(_keep_mask(weight, bias, None, _threshold(module), offset).any()):
            return None
    return (0 if offset else weight.nbytes) + (0 if bias is None else bias.nbytes)


@register_rule("norm_by_behaviour")
def norm_by_behaviour(ctx: Context) -> Iterator[Candidate]:
    """LayerNorm / RMSNorm in any library's spelling, recognised by traced ops, keep their output."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done):
        module = site.module
        if type(module) in KEEP_OUTPUT_FORMS or not _innermost(trace, site):
            continue
        names = ctx.op_names(site)
        kind = "layer" if names == ["native_layer_norm"] else "rms" if names in (RMS_OPS, SHIFTED_RMS_OPS) else None
        if kind is None and "rsqrt" in names and set(names) <= _NORM_OPS and trace.leaf(site):
            kind = "other"  # an RMS-style norm no keep-output form computes (Gemma's `* (1 + w)`): recomputed, or not
        if kind is None:
            if ("native_layer_norm" in names or "rsqrt" in names) and trace.leaf(site):
                done.add(id(module))
                yield Candidate((site.path,), reason=f"{type(module).__name__} computes a norm convert has no rule for "
                                                     f"(ops: {', '.join(names)})", skip=True)
            continue
        done.add(id(module))
        sites = trace.sites_of(site.path)
        if any(ctx.op_names(s) != names for s in sites):
            yield Candidate((site.path,), reason=f"{type(module).__name__} computes different things at its "
                                                 f"{len(sites)} calls", skip=True)
            continue
        edited = ctx.edited(site.path) or ctx.input_edited(site.path)
        if edited:
            yield Candidate((site.path,), reason=edited, skip=True)
            continue
        why = (f"{type(module).__name__} computes in another dtype than its input (a cast, as HF's RMSNorms cast to "
               "float32): its output would be a rounded copy of what backward needs (precision guard)"
               if any(o.name == "_to_copy" for s in sites for o in trace.ops_in(s, compute_only=False))
               else half_precision_guard(ctx, site.path, module, "keeping its output, it"))
        if kind == "other":
            why = (f"{type(module).__name__} computes a norm no keep-output form has a rule for (ops: "
                   f"{', '.join(names)})" + (f"; {why}" if why else ""))
            yield _recomputed(ctx, trace, site, why)
            continue
        if why:
            yield _recomputed(ctx, trace, site, why) if kind == "rms" else Candidate((site.path,), reason=why,
                                                                                       skip=True)
            continue
        expected = sum(_expected(trace, s)[0] for s in sites)
        if expected <= 0:
            yield Candidate((site.path,), reason=f"{type(module).__name__}'s output is not kept after it (e.g. a "
                                                 "dropout follows): keeping it would save 0 B", skip=True)
            continue
        attrs: dict[str, Any]
        if kind == "layer":
            target, attrs = layer_norm_form(type(module)), {}
        else:
            spec = _rms_spec(trace, site, module)
            if isinstance(spec, str):
                yield Candidate((site.path,), reason=spec, skip=True)
                continue
            target = rms_norm_form(type(module))
            attrs = {"memtrim_rms": spec, "memtrim_dtype": getattr(module, spec[0]).dtype,
                     "memtrim_settings": _settings(module)}
        attrs["memtrim_owner"] = label((site.path,), f"a keep-output {type(module).__name__}")
        what = "LayerNorm" if kind == "layer" else "RMSNorm"
        copies = _weight_copies(module, attrs.get("memtrim_rms"))
        # (where the copies take all it drops, it is measured alone: its skip then says so, as before the expectation)
        net = None if copies is None or expected - copies * len(sites) <= 0 else expected - copies * len(sites)
        limits = (REBUILT_INPUT, NO_DOUBLE_BACKWARD, NO_AUTOCAST) + ((IN_TRACED_DTYPE.format(
            str(attrs["memtrim_dtype"]).removeprefix("torch.")),) if kind == "rms" else ())
        yield Candidate((site.path,), type(module).__name__, f"memtrim keep-output {what} ({target.__name__})",
                        reason=f"traced ops are a {what}; its output is kept after it anyway", targets=(module,),
                        expected_bytes=net, limits=limits,
                        bitwise=False, apply=partial(class_swap, module, target, **attrs))

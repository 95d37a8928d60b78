"""convert's rules that keep a recipe instead of a tensor, per call site (mechanisms in ``techniques/recompute``).

NOTE [ recompute rules ]
Matched on traced evidence (NOTE [ convert's evidence ]), never on class names:

* ``layer_norm_consumer`` (before ``keep_output``): a call site whose compute op is one ``native_layer_norm`` (any
  class), which keeps its input, and whose output is kept only by later call sites (a Linear, HF ``Conv1D``, a
  convolution, a parent's ``F.linear``): the norm stays torch's own and those sites keep the recipe (the norm of
  its input, rebuilt by the module's own forward, with its weight and bias version-checked like autograd's). It
  saves what the keep-output LayerNorm saves there, with torch's kernels in backward, so training stays bitwise
  (double backward included). Where the output is kept otherwise (by the parent's own code, or by a module an
  earlier rule changed), the keep-output rules decide. Under autocast nothing is marked: autocast runs the norm in
  float32 and a rebuild outside it would not.
* ``group_norm_consumer`` (before ``keep_output``): a GroupNorm (one ``native_group_norm``) whose output is kept only
  by later call sites (the SiLU or GELU after it in a diffusion U-Net's blocks): as ``layer_norm_consumer``, rebuilt
  by the module's own forward (its node does not keep the bias). Every other GroupNorm is reported with why.
* ``batchnorm_relu_call_site``: a ``relu`` op whose input is a BatchNorm's output, read by nothing before it: the
  BatchNorm becomes ``BatchNormReLU`` (keeps its input; the ReLU output is a recipe) and the modules that keep the
  ReLU output run as recipe-honouring scopes. A ReLU module called at several sites (torchvision's ``self.relu``)
  becomes a ``PassThroughReLU``: it returns a fused BatchNorm's output unchanged and relus anything else, so its
  other call sites stay exactly torch's.
* ``gated_mlp``: ``down(act(gate(x)) * up(x))`` in one call (Llama, Mistral, Qwen): ``act(g)`` and the product are
  rebuilt from ``g`` and ``u``, which stay kept.
* ``max_pool_offsets``: torch's own ``nn.MaxPool2d`` becomes ``memtrim.nn.MaxPool2d``, which keeps each window's
  argmax as a one-byte offset instead of an int64 index (NOTE [ compact max-pool indices ]): seven eighths of the
  indices saved, without running the pool again.
* ``checkpoint_pointwise``: a leaf call whose ops are pointwise in one input (HF ``NewGELUActivation``) or a max
  pool in another module (its int64 indices), keeping more than its input: the call is recomputed in backward
  (checkpoint). Not an RMSNorm the keep-output rules left alone (tried on 2026-11-29 and taken out: the recompute
  read the weight at backward, so ``functional_call`` with other weights and a weight stepped between forward and
  backward trained on the wrong one, and an input written in place later failed; it needs the weight as a
  checkpointed input and a check of later writes to the input).
* ``activation_consumer``: an activation call (one pointwise input-keeping op, any class: HF ``ACT2FN``, timm's,
  torch's) whose output is kept only by later call sites (a Linear, HF ``Conv1D``, a convolution, a parent's
  ``F.linear`` or ``*``): the output is marked as the activation of its input and those sites keep the recipe.

* ``embedding_sum`` (last): an embedding lookup's output, or a sum of lookups (``tok(idx) + pos(arange)``, BERT's
  ``a + b; x += c``; leaf calls whose one compute op is ``embedding``, any class), kept only by later leaf call sites
  (the first norm keeps its input): they keep the indices instead, and backward reruns the lookups and additions
  in the same order (``recompute_sum``). Per call the tensor's grad_fn graph decides: only ``alpha == 1`` additions
  over the lookups' outputs, unchanged since; a dropout after the sum (GPT-2's ``embd_pdrop`` in training) leaves
  nothing to rebuild. The consumers are targets too, so a module_filter excluding the norm excludes this change.

Expected bytes come from the evidence (storages every holder of which the change removes, minus storages it
newly holds); convert measures each change anyway and undoes one that saves nothing.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
import sys
import textwrap
import types
from collections.abc import Iterator
from functools import partial
from typing import Any, NamedTuple

from torch import nn

from ..guards import CONVERTED, memtrims, watch_replacement
from ..norms import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d
from ..norms.bn_relu import keeping_class, rebuilds_bitwise
from ..pooling import LIMITS as POOL_LIMITS
from ..pooling import MaxPool2d, compactable, offset_dtype
from ..recompute import (
    LIMITS,
    PassThroughReLU,
    checkpoint_call,
    keep_recipes_in,
    recompute_gated_mlp,
    recompute_op_output,
    recompute_output,
    recompute_sum,
)
from ..recompute._core import NODE_OPS
from .builtin import (
    _BN_ACT,
    FUSED,
    NO_AUTOCAST,
    NO_DOUBLE_BACKWARD,
    REBUILT_INPUT,
    _bn_activation,
    half_precision_guard,
)
from .evidence import CallSite, ModelTrace, Op
from .norms import _innermost
from .rules import Candidate, Context, Undo, chain, class_swap, label, op_name, register_rule, registered_rules

__all__: list[str] = []

_BN_RELU: dict[type[nn.Module], type[nn.Module]] = {
    nn.BatchNorm1d: BatchNormReLU1d, nn.BatchNorm2d: BatchNormReLU2d, nn.BatchNorm3d: BatchNormReLU3d}
# single-input activation ops that keep their input (their output is then only kept by the consumers)
_KEEPS_INPUT = frozenset({"gelu", "silu", "mish", "hardswish", "softplus", "elu", "leaky_relu", "hardtanh", "relu6",
                          "hardsigmoid", "celu", "selu", "log_sigmoid", "log_sigmoid_forward"})  # as the trace names it
_POINTWISE = frozenset({
    "mul", "add", "sub", "div", "pow", "tanh", "sigmoid", "erf", "exp", "expm1", "neg", "rsub", "reciprocal",
    "sqrt", "rsqrt", "minimum", "maximum", "clamp", "clamp_min", "clamp_max", "abs", "relu", "gelu", "silu",
    "softplus", "log1p", "where", "sign", "square", "hardtanh", "leaky_relu", "elu",
})
def _random_ops(trace: ModelTrace, site: CallSite) -> list[str]:
    """The ops of ``site`` that draw random numbers (in place or not: ``bernoulli_`` is ``bernoulli``): every op aten
    tags ``nondeterministic_seeded`` (dropout, rrelu's noise, randperm, exponential_, ...). Draws outside torch
    (NumPy's, Python's ``random``) make no op and are not seen."""
    return sorted({op_name(o) for o in trace.ops_in(site, compute_only=False) if o.random})


def _owned(trace: ModelTrace, ops: list[Op], inputs: set[int]) -> bool:
    """Every tensor an op of ``ops`` reads is one of ``inputs`` or made by an earlier op of ``ops`` (or a scalar)."""
    made = set(inputs)
    for op in ops:
        for key in op.inputs:
            if key not in made and trace.storages[key].nbytes > 8:
                return False
        made.update(op.outputs)
    return True


def _holder_modules(ctx: Context, key: int, site: CallSite) -> list[nn.Module] | None:
    """The modules of the call sites that keep storage ``key`` after ``site`` (None if one is ``site`` itself or
    one of its ancestors' own code holds it before the site ended)."""
    trace = ctx.trace
    assert trace is not None
    found: list[nn.Module] = []
    for h in trace.storages[key].holders:
        if site.index in h.stack:
            continue
        if h.time < site.end or h.site is None:
            return None
        module = trace.sites[h.site].module
        if module not in found:
            found.append(module)
    return found


def _keeps_output(trace: ModelTrace, sites: list[CallSite]) -> bool:
    """Whether an op inside one of ``sites`` keeps the site's output for backward (a tanh, a sigmoid): the producer
    then needs a producer scope (``recompute_output(keeps_output=True)``)."""
    return any(s.index in h.stack for s in sites for k in s.outputs for h in trace.storages[k].holders)


def _recomputed_for(ctx: Context, consumers: list[nn.Module]) -> str:
    """``"recomputed for a, b, c and N more"``: the consumers' names, for the report."""
    names = [n or "<model>" for n, m in ctx.modules.items() if any(m is c for c in consumers)]
    return f"recomputed for {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _install_consumers(modules: list[nn.Module]) -> Undo:
    return chain(*(keep_recipes_in(m).remove for m in modules))  # (shared scopes: each change holds its own use)


# ---------------------------------------------------------------------- LayerNorm -> input-keeping consumers
_LAYER_NORM = ["native_layer_norm"]


def _consumers_of_outputs(ctx: Context, trace: ModelTrace, sites: list[CallSite]) -> tuple[list[nn.Module], int]:
    """The later call sites that keep the outputs of ``sites`` and the bytes they keep, or ``([], 0)`` when one
    output is kept otherwise (by its parent's own code) or one call keeps no input to rebuild from."""
    consumers: list[nn.Module] = []
    expected = 0
    for s in sites:
        acts = [k for k in s.inputs if trace.storages[k].kind != "parameter"]
        if len(s.outputs) != 1 or len(acts) != 1:
            return [], 0
        if not any(s.index in h.stack for h in trace.storages[acts[0]].holders):
            return [], 0  # the norm does not keep its input here: nothing to rebuild from
        found = _holder_modules(ctx, s.outputs[0], s)
        if found is None or not ctx.free(*found):
            return [], 0
        if found:
            consumers += [m for m in found if m not in consumers]
            expected += trace.storages[s.outputs[0]].nbytes
    return consumers, expected


@register_rule("layer_norm_consumer", before="keep_output")
def layer_norm_consumer(ctx: Context) -> Iterator[Candidate]:
    """A LayerNorm (one ``native_layer_norm``, any class) whose output is kept only by later call sites: they keep a
    recipe (the norm of its input, which the norm keeps anyway) and the norm stays torch's own, so training stays
    bitwise. Otherwise the keep-output rules decide."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done):
        module = site.module
        if ctx.op_names(site) != _LAYER_NORM or not _innermost(trace, site):
            continue
        done.add(id(module))
        sites = trace.sites_of(site.path)
        if (any(ctx.op_names(s) != _LAYER_NORM for s in sites) or ctx.user_hooks(module) or ctx.edited(site.path)
                or ctx.input_edited(site.path)
                or any(o.name == "_to_copy" for s in sites for o in trace.ops_in(s, compute_only=False))):
            continue
        consumers, expected = _consumers_of_outputs(ctx, trace, sites)
        if not consumers:
            continue
        owner = label((site.path,), "a recomputed LayerNorm")
        eps = _eps_attribute(trace, sites, module)

        def apply(module: nn.Module = module, consumers: list = consumers, owner: str = owner,
                  eps: str | None = eps) -> Undo:
            if eps is not None:  # rebuilt from the norm's own autograd node (less Python per call)
                producer = recompute_op_output(module, owner=owner, eps=eps)
            else:  # native_layer_norm keeps its input
                producer = recompute_output(module, owner=owner, parameters=True, under_autocast=False,
                                            keeps_output=False,
                                            strict=not _known_forward(module) and _reads_training(module))
            return chain(producer.remove, _install_consumers(consumers))

        yield Candidate((site.path,), type(module).__name__, f"torch's LayerNorm, {_recomputed_for(ctx, consumers)}",
                        reason="a LayerNorm whose output is kept only by later call sites, its input by itself",
                        targets=(module,), touches=tuple(consumers), expected_bytes=expected,
                        limits=LIMITS["recompute_op_norm" if eps is not None else "recompute_norm"], apply=apply)


_GROUP_NORM = ["native_group_norm"]


@register_rule("group_norm_consumer", before="keep_output")
def group_norm_consumer(ctx: Context) -> Iterator[Candidate]:
    """A GroupNorm (one ``native_group_norm``, any class: a diffusion U-Net's or BiT's) whose output is kept only by
    later call sites (the SiLU or GELU after it, which keeps its input): they keep a recipe, the module's own forward
    on its input (which the norm keeps anyway) with its parameters, and the norm stays torch's own, so training stays
    bitwise. Its autograd node does not keep the bias, so the rebuild is the module's forward, not the node's op. A
    GroupNorm left alone is reported with the reason."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done):
        module = site.module
        # (a GroupNorm, timm's GroupNormAct and HF BiT's among them, or a leaf module whose forward calls one: not a
        # block around one)
        if (not (isinstance(module, nn.GroupNorm) or not module._modules)
                or "native_group_norm" not in ctx.op_names(site) or not _innermost(trace, site)):
            continue
        done.add(id(module))
        sites = trace.sites_of(site.path)
        name = type(module).__name__
        why = ("a GroupNorm that runs other ops too" if any(ctx.op_names(s) != _GROUP_NORM for s in sites) else
               "a GroupNorm with hooks the user registered" if ctx.user_hooks(module) else
               "a GroupNorm whose output is changed in place after its forward (an in-place activation): what the "
               "next modules keep is not its output" if ctx.edited(site.path) else None)
        edited = None if why else ctx.input_edited(site.path)
        why = why or (f"a GroupNorm: {edited}" if edited else None)
        consumers, expected = ([], 0) if why is not None else _consumers_of_outputs(ctx, trace, sites)
        if why is None and not consumers:
            why = ("a GroupNorm whose output no later call site alone keeps (nothing keeps it, or its parent's own "
                   "code does), or that keeps no input to rebuild it from")
        if why is not None:
            yield Candidate((site.path,), name, reason=why, skip=True)
            continue
        owner = label((site.path,), "a recomputed GroupNorm")
        strict = type(module).forward is not nn.GroupNorm.forward and _reads_training(module)

        def apply(module: nn.Module = module, consumers: list = consumers, owner: str = owner,
                  strict: bool = strict) -> Undo:
            producer = recompute_output(module, owner=owner, parameters=True, under_autocast=False,
                                        keeps_output=False, strict=strict)  # (native_group_norm keeps its input)
            return chain(producer.remove, _install_consumers(consumers))

        yield Candidate((site.path,), name, f"torch's GroupNorm, {_recomputed_for(ctx, consumers)}",
                        reason="a GroupNorm whose output is kept only by later call sites, its input by itself",
                        targets=(module,), touches=tuple(consumers), expected_bytes=expected,
                        limits=LIMITS["recompute_norm"], apply=apply)


KNOWN_LAYER_NORM_FORWARDS: list[tuple[str, str]] = [("torch.nn", "LayerNorm"), ("timm.layers.norm", "LayerNorm"),
                                                     ("timm.layers.norm", "LayerNorm2d")]
"""LayerNorm classes whose ``forward`` passes ``self.eps`` to ``F.layer_norm`` at every call and returns its output
(or a view of it): (module, class name), looked up in ``sys.modules``. A module whose class uses one of these
forwards (a subclass that does not override it) is rebuilt from its norm's autograd node, with ``eps`` read at each
call; any other (an eps chosen per call, a forward that may return its input) by its own forward."""


def _reads_training(module: nn.Module) -> bool:
    """Whether ``module``'s forward names ``training`` (or is no Python function): a norm rebuilt by its own forward
    then has everything in its ``__dict__`` compared at the rebuild, its training flag included, and a change raises
    (``strict``). Found by an adversarial pass: a GroupNorm subclass choosing its eps by its training flag rebuilt
    another output after ``model.eval()`` between forward and backward, 0.027 off. Other forwards (HF's ConvNext and
    ESM LayerNorms, timm's GroupNorm) compare their plain settings only: strict for every class not torch's refused
    a validation pass between forward and backward, or a tag set on the module, where torch trains (a later pass)."""
    code = getattr(type(module).forward, "__code__", None)
    return code is None or "training" in code.co_names


def _known_forward(module: nn.Module) -> bool:
    """Whether ``module``'s class uses a forward of KNOWN_LAYER_NORM_FORWARDS."""
    forward = type(module).forward
    return any(getattr(getattr(sys.modules.get(where), name, None), "forward", None) is forward
               for where, name in KNOWN_LAYER_NORM_FORWARDS)


def _eps_attribute(trace: ModelTrace, sites: list[CallSite], module: nn.Module) -> str | None:
    """``"eps"`` where ``module``'s forward is known to pass its ``eps`` (KNOWN_LAYER_NORM_FORWARDS) and every traced
    call passed that value to ``native_layer_norm``, else None: the node does not keep the eps, so a rebuild from
    the node reads it from the module at each call."""
    if not _known_forward(module):
        return None
    found = {o.scalars[-1] for s in sites for o in trace.ops_in(s) if o.name == "native_layer_norm" and o.scalars}
    return "eps" if found == {vars(module).get("eps")} else None


def rebuilt_yet_changed(writer: str, what: str = "its output") -> str:
    """Why an output (``what``) changed in place after its forward (in ``writer``) is not rebuilt for the layers
    that keep it."""
    return (f"{what} is changed in place after its forward (in {writer or 'the top-level forward'}): the layers "
            "that keep it would get it rebuilt without the change, where torch keeps the changed tensor or raises")


# ---------------------------------------------------------------------- BatchNorm + ReLU per call site
def relu_calls_after(ctx: Context, name: str) -> list[tuple[CallSite, list[Op], CallSite]] | None:
    """For each call of the BatchNorm ``name``: (its site, the ops that read its output after it, the ReLU call that
    reads it first), where at every call the first reader is a ReLU module (``nn.ReLU`` or ``PassThroughReLU``) that
    runs only ``relu`` at every call, the same module at every call; else None (``batchnorm_activation`` decides)."""
    trace = ctx.trace
    if trace is None:
        return None
    found: list[tuple[CallSite, list[Op], CallSite]] = []
    for site in trace.sites_of(name):
        reads = trace.reads_after(site.outputs, site.end)
        if not reads or reads[0].name not in ("relu", "relu_") or reads[0].site is None:
            return None
        relu_site = trace.sites[reads[0].site]
        if (type(relu_site.module) not in (nn.ReLU, PassThroughReLU) or ctx.op_names(relu_site) != ["relu"]
                or (found and relu_site.module is not found[0][2].module)):
            return None
        found.append((site, reads, relu_site))
    return found or None


@register_rule("batchnorm_relu_call_site", before="relu_linear")
def batchnorm_relu_call_site(ctx: Context) -> Iterator[Candidate]:
    """BatchNorm -> ReLU where the ReLU module also runs elsewhere (torchvision's shared ``relu``), or where the
    BatchNorm runs several times per forward, each call followed by the ReLU (a backbone called on two views, as in
    SimCLR): fused at those calls."""
    trace = ctx.trace
    if trace is None:
        return
    for name, bn in ctx.modules.items():
        if type(bn) not in _BN_RELU or not ctx.free(bn):
            continue
        calls = relu_calls_after(ctx, name)
        if calls is None or (len(calls) == 1 and not calls[0][2].shared):  # (one call, its own ReLU: a pair)
            continue
        relu_site = calls[0][2]
        relu = relu_site.module
        where = (name, relu_site.label if len(calls) == 1 else relu_site.path)
        hooks = ctx.user_hooks(bn) or ctx.user_hooks(relu)
        if hooks:
            yield Candidate(where, reason=f"hooks on the pair ({', '.join(hooks)}): fused, they would see the fused "
                                          "module's values. Remove the hooks to fuse it", skip=True)
            continue
        if getattr(bn, "qconfig", None) is not None:
            yield Candidate(where, reason=f"{name} is prepared for quantization (a qconfig): fused, it would get no "
                                          "observers", skip=True)
            continue
        if any(trace.ops_in(s) and ctx.op_names(s) != ["relu"] for s in trace.sites_of(relu_site.path)):
            yield Candidate(where, reason=f"{relu_site.path} does more than a ReLU at some call", skip=True)
            continue
        consumers: list[nn.Module] = []
        expected = 0
        why = ctx.input_edited(name)
        for _, reads, at in ([] if why else calls):
            if reads[0].name == "relu" and len(reads) > 1:
                why = f"{name}'s output is also read after the ReLU" + (f" (call {at.call} of {at.path})"
                                                                         if len(calls) > 1 else "")
                break
            writer = trace.written_after_call(at)  # (found by an adversarial pass: fused, it trained on unchanged)
            if writer is not None:
                why = rebuilt_yet_changed(writer, "the ReLU's output")
                break
            z = reads[0].outputs[0]
            kept_by = _holder_modules(ctx, z, at)
            if kept_by is None:
                why = "the ReLU output is kept by its parent's own code"
                break
            consumers += [m for m in kept_by if not any(m is c for c in consumers)]
            expected += trace.storages[z].nbytes
        if why is not None:
            yield Candidate(where, reason=why, skip=True)
            continue
        target = _BN_RELU[type(bn)]
        owner = label(where, f"memtrim.nn.{target.__name__}")
        places = ctx.places(relu)

        def apply(bn: nn.Module = bn, relu: nn.Module = relu, consumers: list = consumers, target: type = target,
                  owner: str = owner, relu_path: str = relu_site.path, places: list = places) -> Undo:
            # (marked converted: a hook added to it later would see a fused BatchNorm's output, relu'd already, as
            # its input, and raises; not a target, so that the other BatchNorms it follows can be fused too)
            swap = (class_swap(relu, PassThroughReLU, memtrim_owner=f"'{relu_path}'",
                               **{CONVERTED: "batchnorm_relu_call_site"})
                    if type(relu) is nn.ReLU else (lambda: None))
            return chain(class_swap(bn, target, memtrim_owner=owner, memtrim_relu_follows=True), swap,
                         watch_replacement(bn, relu, places), _install_consumers(consumers))

        what = (f"call {relu_site.call} of {relu_site.path}" if len(calls) == 1 else
                f"{len(calls)} calls, each followed by {relu_site.path}")
        yield Candidate(where, f"{type(bn).__name__} + ReLU ({what})",
                        f"memtrim.nn.{target.__name__} + PassThroughReLU",
                        reason=("this call of the ReLU reads the BatchNorm's output first" if len(calls) == 1 else
                                "the ReLU reads the BatchNorm's output first at each of its calls"), targets=(bn,),
                        touches=(relu, *consumers), expected_bytes=expected,
                        limits=(*LIMITS["batchnorm_relu"], FUSED), bitwise=rebuilds_bitwise(bn), apply=apply)


# ---------------------------------------------------------------------- gated MLP
def _child_of(trace: ModelTrace, parent: CallSite, key: int) -> CallSite | None:
    """The direct child call of ``parent`` that returned storage ``key``."""
    for s in trace.sites[parent.index + 1:]:
        if s.start > parent.end:
            break
        if s.parent == parent.index and key in s.outputs:
            return s
    return None


def _relative(parent: str, child: str) -> str:
    return child[len(parent) + 1:] if parent else child


KNOWN_BATCHNORM_ACT: list[tuple[str, str]] = [("timm.layers.norm_act", "BatchNormAct2d")]
"""BatchNorm subclasses whose forward is known to be torch's BatchNorm (with the module's own settings), ``drop``,
then ``act``: (module, class name), looked up in ``sys.modules`` (memtrim never imports them). Exact classes only:
a subclass's forward may do anything."""


def _known_batchnorm_act(module: nn.Module) -> bool:
    for where, name in KNOWN_BATCHNORM_ACT:
        found = getattr(sys.modules.get(where), name, None)
        if found is not None and type(module) is found:
            return True
    return False


@register_rule("batchnorm_act_module", before="relu_linear")
def batchnorm_act_module(ctx: Context) -> Iterator[Candidate]:
    """timm's ``BatchNormAct2d`` (in ``ConvNormAct``: torch's BatchNorm, then ``drop``, then ``act`` in its own
    forward): with a ReLU, fused as ``BatchNormReLU`` (the modules that keep its output keep the recipe); with a
    LeakyReLU (slope > 0) or an ELU, as ``BatchNormAct`` (keeping only the output, its input rebuilt from it, as the
    BatchNorm + activation pair of torch modules is: darknet and cspnet backbones); with another activation, left
    alone and reported. Other BatchNorm subclasses are left alone and reported: their forward may use other settings,
    arguments or side effects, which a class swap would drop."""
    trace = ctx.trace
    if trace is None:
        return
    for name, bn in ctx.modules.items():
        base = next((k for k in _BN_RELU if isinstance(bn, k)), None)
        if base is None or type(bn) in _BN_RELU or not ctx.free(bn) or not trace.sites_of(name):
            continue
        if not _known_batchnorm_act(bn):
            yield Candidate((name,), reason=f"{type(bn).__name__} is a BatchNorm subclass with its own forward, which "
                                            "convert does not know computes torch's BatchNorm with the module's "
                                            "settings (known: " + ", ".join(f"{w}.{n}" for w, n in KNOWN_BATCHNORM_ACT)
                                            + ")", skip=True)
            continue
        act = getattr(bn, "act", None)
        spec = _bn_activation(act) if act is not None else None  # a LeakyReLU (slope > 0) or an ELU: BatchNormAct
        if (type(act) not in (nn.ReLU, nn.Identity) and spec is None) or type(getattr(bn, "drop", None)) is not \
                nn.Identity:
            yield Candidate((name,), reason=f"{type(bn).__name__} applies {type(act).__name__} after "
                                            f"{type(getattr(bn, 'drop', None)).__name__}: only ReLU, LeakyReLU "
                                            "(slope > 0) or ELU after no dropout is fused with it", skip=True)
            continue
        sites = trace.sites_of(name)
        ops = [[o for o in trace.ops_in(s) if not _bookkeeping(o, trace)] for s in sites]
        names = {tuple(op_name(o) for o in site_ops) for site_ops in ops}
        if names == {("native_batch_norm",)}:
            yield Candidate((name,), reason=f"{type(bn).__name__} runs no activation after the norm here (nothing "
                                            "to fuse it with)", skip=True)
            continue
        fused_op = "relu" if spec is None else spec[0]
        if names != {("native_batch_norm", fused_op)}:
            after = sorted({op_name(o) for site_ops in ops for o in site_ops} - {"native_batch_norm"})
            yield Candidate((name,), reason=f"{type(bn).__name__} runs {', '.join(after)} after the norm: only its "
                                            f"{type(act).__name__} ({fused_op}) is fused with it", skip=True)
            continue
        act_name = type(act).__name__
        hooks = ctx.user_hooks(bn)
        if hooks:
            yield Candidate((name,), reason=f"{name} has {', '.join(hooks)}: they would see the fused module's "
                                            "values", skip=True)
            continue
        if any(fused.inputs[:1] != norm.outputs[:1] or site.outputs != fused.outputs
               for site, (norm, fused) in zip(sites, ops)):
            yield Candidate((name,), reason=f"{name} returns more than the {act_name}'s output", skip=True)
            continue
        writer = trace.written_after(name)
        if writer is not None:  # (found by an adversarial pass: fused, it trained on the unchanged output)
            yield Candidate((name,), reason=rebuilt_yet_changed(writer, f"the {act_name}'s output"), skip=True)
            continue
        edited = ctx.input_edited(name) or (None if spec is None else ctx.edited(name) or half_precision_guard(
            ctx, name, bn, f"fused with {act_name}, it"))
        if edited:
            yield Candidate((name,), reason=edited, skip=True)
            continue
        if spec is not None:  # keeping only its output: no consumer keeps a recipe
            target = keeping_class(_BN_ACT[base], type(bn))
            owner = label((name,), f"memtrim.nn.{_BN_ACT[base].__name__}")
            fuse = partial(class_swap, bn, target, activation=spec[0],
                           negative_slope=spec[1] if spec[0] == "leaky_relu" else 0.01,
                           alpha=spec[1] if spec[0] == "elu" else 1.0, gamma_threshold=0.0, memtrim_owner=owner,
                           memtrim_activation_inplace=bool(getattr(act, "inplace", False)))
            yield Candidate((name,), f"{type(bn).__name__} (BatchNorm + {act_name})",
                            f"memtrim.nn.{_BN_ACT[base].__name__}",
                            reason=f"its forward is a BatchNorm and a {act_name} the output can be inverted through",
                            targets=(bn,), limits=(REBUILT_INPUT, NO_DOUBLE_BACKWARD, NO_AUTOCAST, FUSED),
                            bitwise=False, apply=fuse)
            continue
        # (each call's output: a backbone called on two views in one forward runs it twice)
        found = [_holder_modules(ctx, site.outputs[0], site) for site in sites]
        if any(kept_by is None for kept_by in found):
            yield Candidate((name,), reason="the ReLU output is kept by its parent's own code", skip=True)
            continue
        consumers: list[nn.Module] = []
        for kept_by in found:
            consumers += [m for m in kept_by or () if not any(m is c for c in consumers)]
        target = _BN_RELU[base]
        owner = label((name,), f"memtrim.nn.{target.__name__}")
        keeping = keeping_class(target, type(bn))  # still the library's class: its tools keep the activation

        def apply(bn: nn.Module = bn, consumers: list = consumers, target: type = keeping, owner: str = owner) -> Undo:
            return chain(class_swap(bn, target, memtrim_owner=owner), _install_consumers(consumers))

        yield Candidate((name,), f"{type(bn).__name__} (BatchNorm + ReLU)", f"memtrim.nn.{target.__name__}",
                        reason="its forward is a BatchNorm and a ReLU", targets=(bn,), touches=tuple(consumers),
                        expected_bytes=sum(trace.storages[site.outputs[0]].nbytes for site, kept_by
                                           in zip(sites, found) if kept_by),
                        limits=LIMITS["batchnorm_relu"], bitwise=rebuilds_bitwise(bn), apply=apply)


def _bookkeeping(op: Op, trace: ModelTrace) -> bool:
    """Whether ``op`` is a BatchNorm's bookkeeping: ``num_batches_tracked += 1`` (an in-place add on a buffer),
    reading it (``float(num_batches_tracked)`` for ``momentum=None``) or the empty reserve torch makes."""
    if op.name == "add_":
        return bool(op.writes) and all(trace.storages[k].kind == "buffer" for k in op.writes)
    if op.name == "_local_scalar_dense":
        return all(trace.storages[k].kind == "buffer" for k in op.inputs)
    return op.name == "empty" and not op.inputs


@register_rule("gated_mlp")
def gated_mlp(ctx: Context) -> Iterator[Candidate]:
    """``down(act(gate(x)) * up(x))``: act(gate) and the product rebuilt in backward from gate's and up's outputs."""
    trace = ctx.trace
    if trace is None:
        return
    # every product of each MLP (a call each, or several in one forward): (its op, the MLP's, act's, up's, gate's and
    # down's calls); the first one's names decide
    calls: dict[int, list[tuple[Op, CallSite, CallSite, CallSite, CallSite, CallSite]]] = {}
    for op in trace.ops:
        if op.name != "mul" or op.site is None or len(op.inputs) != 2:
            continue
        parent = trace.sites[op.site]
        if not ctx.free(parent.module):
            continue
        a_site, u_site = (_child_of(trace, parent, k) for k in op.inputs)
        if a_site is None or u_site is None:
            continue
        if ctx.op_names(a_site) not in (["silu"], ["gelu"]) and ctx.op_names(u_site) in (["silu"], ["gelu"]):
            a_site, u_site = u_site, a_site
        if ctx.op_names(a_site) not in (["silu"], ["gelu"]) or not a_site.inputs:
            continue
        g_site = _child_of(trace, parent, a_site.inputs[0])
        d_site = next((s for s in trace.sites[parent.index + 1:] if s.parent == parent.index
                       and op.outputs and op.outputs[0] in s.inputs), None)
        if g_site is None or d_site is None:
            continue
        calls.setdefault(id(parent.module), []).append((op, parent, a_site, u_site, g_site, d_site))
    for found in calls.values():
        op, parent, a_site, u_site, g_site, d_site = found[0]
        names = {k: _relative(parent.path, s.path) for k, s in
                 (("gate", g_site), ("up", u_site), ("down", d_site), ("act", a_site))}
        modules = (parent.path or type(parent.module).__name__,)
        # at any call, act(gate) or the product changed in place once made, or gate's or up's output (what they are
        # rebuilt from) after the product (found by adversarial passes: rebuilt, they lost the change)
        writer = next((trace.site_name(o.site) for o in trace.writers() for p, _, a, u, _, _ in found
                       if (o.time > a.end and a.outputs[0] in o.writes)
                       or (o.time > p.time and set(o.writes) & {p.outputs[0], *a.inputs[:1], *u.outputs[:1]})), None)
        if writer is not None:
            yield Candidate(modules, reason=rebuilt_yet_changed(
                writer, f"act({names['gate']}), the product or what they are rebuilt from"), skip=True)
            continue
        expected = 0
        for p, _, a, _, _, d in found:
            expected += sum(trace.storages[k].nbytes for k in (a.outputs[0], p.outputs[0])
                            if all(h.site in (d.parent, d.index) for h in trace.storages[k].holders))
        owner = label(modules, "a gated MLP recomputing act(gate) * up")

        def apply(mlp: nn.Module = parent.module, names: dict = names, owner: str = owner) -> Undo:
            # (the act's op is silu or gelu, which keep their input: no producer scope needed around it)
            return recompute_gated_mlp(mlp, owner=owner, act_keeps_output=False, **names).remove

        yield Candidate(modules, type(parent.module).__name__, "gated MLP keeping gate(x) and up(x) only",
                        reason=f"traced: {names['act']}({names['gate']}(x)) * {names['up']}(x) -> {names['down']}",
                        targets=(parent.module, a_site.module),
                        touches=(g_site.module, u_site.module, d_site.module), expected_bytes=expected,
                        limits=LIMITS["recompute_gated_mlp"], apply=apply)


# ---------------------------------------------------------------------- max pools: compact indices, or checkpoint
def _kept_inside(trace: ModelTrace, site: CallSite) -> int:
    """Bytes that the calls of ``site``'s module make and keep for backward, other than their outputs."""
    inner = 0
    for s in trace.sites_of(site.path):
        for key, record in trace.storages.items():
            if (record.producer is not None and s.first_op <= record.producer < s.last_op
                    and key not in s.outputs and record.holders
                    and all(s.index in h.stack for h in record.holders)):
                inner += record.nbytes
    return inner


@register_rule("max_pool_offsets")
def max_pool_offsets(ctx: Context) -> Iterator[Candidate]:
    """torch's own ``nn.MaxPool2d`` keeping int64 indices: swapped to ``memtrim.nn.MaxPool2d``, which keeps each
    window's argmax as a small offset instead (NOTE [ compact max-pool indices ]). Other modules that pool are left to
    ``checkpoint_pointwise``."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done):
        module = site.module
        if not trace.leaf(site) or not compactable(module):
            continue
        done.add(id(module))
        if any(ctx.op_names(s) != ["max_pool2d_with_indices"] for s in trace.sites_of(site.path)):
            continue
        inner = _kept_inside(trace, site)  # the int64 indices of every call
        if inner <= 0:
            continue

        def apply(module: nn.Module = module) -> Undo:
            return class_swap(module, MaxPool2d)

        size = offset_dtype(module).itemsize  # an offset per output element stays kept where the index was
        yield Candidate((site.path,), type(module).__name__, f"memtrim.nn.MaxPool2d ({size}-byte window offsets)",
                        reason="a max pool keeps int64 indices", targets=(module,),
                        expected_bytes=inner - inner // 8 * size, limits=POOL_LIMITS, apply=apply)


# ---------------------------------------------------------------------- pointwise modules and pools: checkpoint
@register_rule("checkpoint_pointwise")
def checkpoint_pointwise(ctx: Context) -> Iterator[Candidate]:
    """A leaf call, pointwise in one input (or a max pool), keeping more than its input: recomputed in backward."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done):
        module = site.module
        if not trace.leaf(site):
            continue
        names = ctx.op_names(site)
        pool = names == ["max_pool2d_with_indices"]
        if not pool and (len(names) < 2 or not set(names) <= _POINTWISE):
            continue
        done.add(id(module))
        acts = [k for k in site.inputs if trace.storages[k].kind != "parameter"]
        if len(acts) != 1 or not _owned(trace, trace.ops_in(site), set(site.inputs)):
            continue
        if any(ctx.op_names(s) != names for s in trace.sites_of(site.path)):
            continue
        inner = _kept_inside(trace, site)
        if inner <= 0:
            continue
        hooks = ctx.user_hooks(module)
        if hooks:
            yield Candidate((site.path,), reason=f"{type(module).__name__} has {', '.join(hooks)}: a recomputed "
                                                 "call would run them twice", skip=True)
            continue
        edited = ctx.input_edited(site.path)  # (what the recomputation reads; found by an adversarial pass)
        if edited:
            yield Candidate((site.path,), reason=edited, skip=True)
            continue

        def apply(module: nn.Module = module) -> Undo:
            return checkpoint_call(module).remove

        yield Candidate((site.path,), type(module).__name__, "recomputed in backward (checkpoint of the call)",
                        reason=("a max pool keeps int64 indices" if pool else
                                f"pointwise ops ({', '.join(names)}) keeping {inner:,} B besides the input"),
                        targets=(module,), expected_bytes=inner, limits=LIMITS["checkpoint_call"], apply=apply)


# ---------------------------------------------------------------------- activation -> input-keeping consumers
def _activation_like(ctx: Context, site: CallSite) -> bool:
    names = ctx.op_names(site)
    if len(names) == 1:
        return names[0] in _KEEPS_INPUT
    return len(names) >= 2 and set(names) <= _POINTWISE


def _out_of_place(module: nn.Module) -> Undo:
    """Set ``module.inplace = False`` (NOTE [ in-place activations made out of place ]); the undo sets it back."""
    setattr(module, "inplace", False)  # noqa: B010  (an attribute of some activation classes, not of Module)

    def undo() -> None:
        setattr(module, "inplace", True)  # noqa: B010

    return undo


def _source_reads_input_after(ctx: Context, module: nn.Module) -> str | None:
    """Why ``module``, an activation run in place, must stay in place, from its parents' source code (NOTE [ in-place
    activations made out of place ]), or None. In each parent's methods (every definition in its class and the classes
    it inherits from, overridden ones too: a ``super()`` call runs them; ``__init__``, where the activation may be
    wrapped; generated or patched ones; a method bound on the instance; a decorated method's wrapped function; a
    module-level function the method calls that mentions the activation), a call ``self.<name>(v)`` on a variable
    ``v`` whose result is not assigned back to ``v`` (``v = self.act(v)``) while the function reads ``v`` again after
    it (``self.act(v); return conv(v)``, on any path: no control flow is followed, a loop's next pass counts), or
    ``v`` shared with another holder (:func:`_shared_names`), relies on the input being overwritten; so does a
    ``getattr(self, <computed name>)`` or a loop calling the parent's children. A method that mentions the activation
    but whose source cannot be read (a class made by ``exec``, ``python -c``) counts as relying on it, as does a
    forward set on the instance that is not a method bound to it (a closure). Every module above the parent is read
    for code reaching the activation itself (``self.block.act(v)``) or the container holding it (``self.acts[0](v)``,
    ``for act in self.acts``; :func:`_ancestor_reaches`). Each of these trained silently otherwise until 2026-12-03
    (adversarial passes: the training step convert checks on the example inputs takes one branch)."""
    held = _held_elsewhere(ctx.model, module)
    if held:
        return held
    for path in ctx.aliases.get(id(module), []):
        parent_path, _, name = path.rpartition(".")
        parent = ctx.model.get_submodule(parent_path)
        parent_class: type = type(parent)
        # the parent's modules that may return their input (an identity, a dropout in evaluation, a drop path)
        passthrough = _Parent(frozenset(attr for attr, m in parent._modules.items()
                                        if m is not None and _may_return_input(m)), frozenset(parent._modules),
                              frozenset(attr for attr, m in parent._modules.items()
                                        if m is not None and _may_keep_input(_class_of(m))))
        why = (_first_in_sequential(parent, name) or _instance_reads_input_after(parent, name, passthrough)
               or _class_reads_input_after(parent_class, name, passthrough)
               or _ancestor_reaches(ctx.model, path))
        if why:
            return why
    return None


_TRUSTED = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict, object)


def _held_elsewhere(model: nn.Module, module: nn.Module) -> str | None:
    """Where a module of ``model`` holds the activation outside its registered modules (``self._fast = [act]``,
    ``object.__setattr__(self, "fn", act)``, a ``partial`` or bound method of it): the code calling it there is not
    read by name (both trained otherwise on a branch the example did not take, silently, until 2026-12-03)."""
    def holds(value: Any, depth: int = 0) -> bool:
        if value is module or getattr(value, "__self__", None) is module or getattr(value, "func", None) is module:
            return True
        if depth < 2 and isinstance(value, (list, tuple, set, frozenset)):
            return any(holds(v, depth + 1) for v in value)
        if depth < 2 and isinstance(value, dict):
            return any(holds(v, depth + 1) for v in value.values())
        return False

    for holder_name, holder in model.named_modules():
        for attr, value in vars(holder).items():
            if attr != "_modules" and holds(value):
                where = f"{holder_name}.{attr}" if holder_name else attr
                return f"it is held outside the modules' registry too ({where}), where code may call it unread"
    return None


def _first_in_sequential(parent: nn.Module, name: str) -> str | None:
    """Where the activation is the first module of an ``nn.Sequential`` (or comes after modules that may return their
    input only): its input is the Sequential's, which the code calling the Sequential may read after the call (a
    pre-activation block: 0.70 off on a branch the example did not take, silently, until 2026-12-03)."""
    if not isinstance(parent, nn.Sequential):  # (a subclass's own forward too: super().forward(x) + x)
        return None
    for key, module in parent._modules.items():
        if key == name:
            return (f"it runs first in its nn.Sequential ({type(parent).__name__}), on the Sequential's own input, "
                    "which the code calling the Sequential may read after the call")
        if module is not None and not _may_return_input(module):
            return None
    return None


class _Parent(NamedTuple):
    """What the source check knows of the parent instance: its modules that may return their input (an identity, a
    dropout in evaluation, a flatten, an empty Sequential), and all its modules' names (``self.X(v)`` with X not
    one is a method of the parent, which may keep v). ``modules`` None: not known (a helper's source)."""

    passthrough: frozenset[str] = frozenset()
    modules: frozenset[str] | None = None
    keepers: frozenset[str] = frozenset()  # modules whose forward may keep its input (self.last = x)


_UNKNOWN = _Parent()


_NEW_TENSOR = (nn.Linear, nn.Bilinear, nn.modules.conv._ConvNd, nn.modules.batchnorm._NormBase, nn.LayerNorm,
               nn.GroupNorm, nn.Embedding, nn.EmbeddingBag, nn.modules.pooling._MaxPoolNd,
               nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
               nn.modules.pooling._AdaptiveMaxPoolNd, nn.MultiheadAttention, nn.RNNBase, nn.Softmax, nn.LogSoftmax)


def _class_of(module: nn.Module) -> type:
    return type(module)


@functools.lru_cache(maxsize=256)
def _may_keep_input(cls: type) -> bool:
    """Whether a module class's forward may keep its input past the call (``self.last = x``, ``self.inputs.append(x)``
    : a child module called on the activation's input on a branch the example did not take kept the values before
    the activation, silently, until 2026-12-03). torch's own modules keep nothing; a forward that cannot be read may."""
    forward = getattr(cls, "forward", None)
    if forward is None or getattr(forward, "__module__", "").startswith("torch."):
        return False
    parsed = _parsed(inspect.unwrap(forward), cls.__qualname__, "its input")
    if isinstance(parsed, str):
        return True
    node, _ = parsed
    me = node.args.args[0].arg if node.args.args else ""
    for statement in ast.walk(node):
        if isinstance(statement, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            if any(_kept_by(t, me) for t in targets) and statement.value is not None and any(
                    isinstance(n, ast.Name) and n.id != me for n in ast.walk(statement.value)):
                return True  # self.last = x (or something computed from locals: conservative)
        if (isinstance(statement, ast.Call) and isinstance(statement.func, ast.Attribute)
                and (statement.func.attr in _STORING or statement.func.attr in ("register_buffer", "__setattr__"))
                or isinstance(statement, ast.Call) and isinstance(statement.func, ast.Name)
                and statement.func.id == "setattr"):
            return True
    return False


def _may_return_input(module: nn.Module) -> bool:
    """Whether ``module`` may return its input itself (a dropout in evaluation, an identity, a flatten of a flat
    input, a hook point, a reshape): any module but torch's that always compute a new tensor (a Linear, a
    convolution, a norm, a pool, attention; an activation out of place), and a Sequential of those."""
    if isinstance(module, nn.Sequential):
        return len(module) == 0 or any(_may_return_input(m) for m in module)
    if isinstance(module, _NEW_TENSOR) and not re.search("drop|identity", type(module).__name__, re.IGNORECASE):
        return False
    if type(module).__module__.startswith("torch.nn.modules.activation"):
        return getattr(module, "inplace", False) is True
    return True
_DYNAMIC = frozenset({"getattr", "children", "named_children", "modules", "named_modules", "_modules"})


def _mentions(code: types.CodeType, names: frozenset[str] | set[str]) -> bool:
    """Whether compiled ``code`` (or a function or lambda nested in it) reads an attribute or global of ``names``
    (``self.act``) or holds one as a string (``getattr(self, "act")``): the methods not mentioning one are not
    parsed."""
    return not names.isdisjoint(code.co_names) or any(
        c in names if isinstance(c, str) else isinstance(c, types.CodeType) and _mentions(c, names)
        for c in code.co_consts)


def _functions(cls_or_instance_dict: dict[str, Any]) -> Iterator[Any]:
    """The Python functions of a class's (or an instance's) namespace: methods, static and class methods' functions,
    properties' getters and setters, methods bound on an instance."""
    for value in cls_or_instance_dict.values():
        if isinstance(value, property):
            yield from (f for f in (value.fget, value.fset) if f is not None)
        elif isinstance(value, (staticmethod, classmethod, types.MethodType)):
            yield value.__func__
        elif inspect.isfunction(value):
            yield value


def _parsed(function: Any, owner: str, what: str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, int] | str:
    """``function``'s own def, parsed, and its first line; or why it cannot be read (``what`` it reads)."""
    try:
        lines, start = inspect.getsourcelines(function)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, IndentationError) as e:
        return (f"{owner}.{function.__name__} reads {what} and its source cannot be read ({type(e).__name__}: {e}), "
                "so convert cannot check that it does not read the activation's input after the call")
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return (f"{owner}.{function.__name__} reads {what} and is not a def convert can read (a lambda?), so "
                "convert cannot check that it does not read the activation's input after the call")
    return node, start


def _function_reads_input_after(function: Any, name: str, owner: str, passthrough: _Parent = _UNKNOWN,
                                dynamic: bool = True, depth: int = 0) -> str | None:
    """:func:`_reads_after` for one Python function (a method of ``owner``), from its own source; and for the
    functions it wraps (a decorator without ``functools.wraps``) or calls by a global name, where they mention it."""
    function = inspect.unwrap(function)  # (a decorated method: functools.wraps's wrapper mentions nothing)
    code = getattr(function, "__code__", None)
    if code is None or depth > 3:
        return None
    inner = [cell.cell_contents for cell in (function.__closure__ or ()) if _cell_function(cell)]
    helpers = [g for g in (function.__globals__.get(n) for n in code.co_names) if inspect.isfunction(g)]
    for other in (*inner, *helpers):  # (a helper(self, h) calling self.act(h): read with its first argument as self)
        why = _function_reads_input_after(other, name, owner, passthrough, dynamic and other in inner, depth + 1)
        if why:
            return why
    if not _mentions(code, {name} | (_DYNAMIC if dynamic else set())):
        return None
    parsed = _parsed(function, owner, f"self.{name}")
    if isinstance(parsed, str):
        return parsed if _mentions(code, {name}) else None
    node, start = parsed
    first = node.args.args[0].arg if node.args.args else None
    others = [n for n in ast.walk(node) if isinstance(n, ast.Attribute) and n.attr == name
              and isinstance(n.value, ast.Name) and n.value.id != first]
    if others and not any(isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.value, ast.Name)
                          and n.value.id == first for n in ast.walk(node)):
        return (f"{owner}.{function.__name__} reaches the activation as {ast.unparse(others[0])}, not through its "
                f"first argument, so convert cannot follow its input ({inspect.getsourcefile(function)}:"
                f"{start + others[0].lineno - 1})")
    line = _reads_after(node, name, passthrough, dynamic)
    if line is None:
        return None
    return (f"{owner}.{function.__name__} may rely on self.{name} overwriting its input "
            f"({inspect.getsourcefile(function)}:{start + line - 1})")


def _cell_function(cell: Any) -> bool:
    try:
        return inspect.isfunction(cell.cell_contents)
    except ValueError:  # an empty cell
        return False


def _instance_reads_input_after(parent: nn.Module, name: str, passthrough: _Parent) -> str | None:
    """:func:`_source_reads_input_after` for what is set on the parent instance itself: a method bound to it
    (``types.MethodType(fn, module)``) is read as its class's are; another callable set as its ``forward`` (a
    closure, a partial) cannot be read."""
    owner = type(parent).__qualname__
    for attr, value in vars(parent).items():
        if isinstance(value, types.MethodType) and value.__self__ is parent:
            why = _function_reads_input_after(value.__func__, name, owner, passthrough)
            if why:
                return why
        elif attr == "forward" and callable(value):
            return (f"{owner} at this place has a forward set on the instance ({type(value).__name__}), which "
                    f"convert cannot read for a read of self.{name}'s input after the call")
    return None


@functools.lru_cache(maxsize=256)  # a model's blocks share a few classes: each is read once per attribute name
def _class_reads_input_after(parent: type, name: str, passthrough: _Parent) -> str | None:
    """:func:`_source_reads_input_after` for one parent class and the attribute name of the activation in it: the
    definitions it runs (a method set on the class after its body, as torch.fx's generated forward, too), an
    overridden one where the override calls ``super()`` or names a base class (``Base.forward(self, x)``)."""
    reached: dict[str, bool] = {}  # attribute -> whether the definition seen last reaches the next one down
    bases = {cls.__name__ for cls in parent.__mro__}
    for cls in parent.__mro__:
        if cls in _TRUSTED:
            continue
        for attr, value in vars(cls).items():
            if not reached.get(attr, attr not in reached):
                continue  # overridden, and not called by the override
            functions = list(_functions({attr: value}))
            reached[attr] = any(_mentions(f.__code__, {"super"} | bases) for f in functions)
            for function in functions:
                # (torch's own classes, fx's GraphModule: read for the activation alone, not for getattr)
                why = _function_reads_input_after(function, name, cls.__qualname__, passthrough,
                                                  not cls.__module__.startswith("torch."))
                if why:
                    return why
    return None


def _ancestor_reaches(model: nn.Module, path: str) -> str | None:
    """Where a module above the activation's parent reaches the activation (``self.block.act(v)``) or uses the
    container holding it otherwise than calling it (``self.acts[0](v)``, ``for act in self.acts``): its reads of the
    activation's input are not seen by the parent's check. Every module on the path, from the model down."""
    parts = path.split(".")
    for depth in range(len(parts) - 1):
        rest = tuple(parts[depth:])
        if len(rest) < 2:
            continue
        ancestor = model.get_submodule(".".join(parts[:depth]))
        functions = [*_functions(dict(vars(ancestor)))]
        ancestor_class: type = type(ancestor)
        why = _reaching(functions, rest, ancestor_class.__qualname__) or _class_reaches(ancestor_class, rest)
        if why:
            return why
    return None


_BUILDING = frozenset({"__init__", "__repr__", "extra_repr"})  # methods a training forward does not run: timm's
# NormFreeNet.__init__ lists its stem's children, which left the stem's activations alone until 2026-12-03


@functools.lru_cache(maxsize=256)
def _class_reaches(ancestor: type, rest: tuple[str, ...]) -> str | None:
    for cls in ancestor.__mro__:
        if cls not in _TRUSTED:
            namespace = {k: v for k, v in vars(cls).items() if k not in _BUILDING}
            why = _reaching(list(_functions(namespace)), rest, cls.__qualname__)
            if why:
                return why
    return None


def _reaching(functions: list[Any], rest: tuple[str, ...], owner: str) -> str | None:
    for function in functions:
        function = inspect.unwrap(function)
        code = getattr(function, "__code__", None)
        if code is None or not _mentions(code, {rest[0]}):
            continue
        parsed = _parsed(function, owner, f"self.{rest[0]}")
        if isinstance(parsed, str):
            return parsed
        node, start = parsed
        line = _reaches(node, rest)
        if line is not None:
            return (f"{owner}.{function.__name__} reaches self.{'.'.join(rest)} itself or its container "
                    f"({inspect.getsourcefile(function)}:{start + line - 1}), and may read its input after the call")
    return None


_ITERATING = frozenset({"zip", "enumerate", "iter", "next", "list", "tuple", "reversed", "getattr", "map", "filter",
                        "sorted", "dict", "vars"})


def _reaches(function: ast.FunctionDef | ast.AsyncFunctionDef, rest: tuple[str, ...]) -> int | None:
    """The line where ``function`` reads ``self.<rest...>`` (the activation), or takes it from ``self.<rest[:-1]...>``
    (the module holding it) by a subscript, an iteration or its children; calling that module whole, or handing it
    on (``nn.Sequential(self.stem, self.bn1)``), runs its own forward, which is read as the parent's."""
    if not function.args.args:
        return None
    me = function.args.args[0].arg
    parents = {id(child): node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(function):
        chain: list[str] = []
        root: ast.AST = node
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if (not (isinstance(root, ast.Name) and root.id == me) or isinstance(parents.get(id(node)), ast.Attribute)
                or not isinstance(getattr(node, "ctx", None), ast.Load)):
            continue  # not rooted at self, not the outermost attribute of its chain, or set (self.bn1 = ...)
        chain.reverse()
        line = int(getattr(node, "lineno", 0))
        if tuple(chain) == rest:
            return line  # self.block.act
        use = parents.get(id(node))
        if tuple(chain) == rest[:-1] and (
                (isinstance(use, ast.Subscript) and use.value is node)
                or (isinstance(use, (ast.For, ast.AsyncFor, ast.comprehension)) and use.iter is node)):
            return line  # self.acts[0], for a in self.acts
        if tuple(chain[:-1]) == rest[:-1] and chain[-1] in (_DYNAMIC | {"values", "items", "__getitem__"}):
            return line  # self.acts.values(), self.seq.children()
        if (tuple(chain) == rest[:-1] and isinstance(use, ast.Call) and node in use.args
                and isinstance(use.func, ast.Name) and use.func.id in _ITERATING):
            return line  # zip(self.fcs, self.acts), enumerate(self.acts), next(iter(self.acts))
    return None


_INTROSPECTION = frozenset({"isinstance", "type", "hasattr", "getattr", "id", "repr", "str"})


def _root_name(arg: ast.expr, me: str) -> ast.Name | int | None:
    """The variable whose tensor ``arg`` may be (or be a view of): ``v``, ``v[...]``, ``v.view(...)``, ``v.t``; None
    for a temporary (a call of one of ``me``'s modules or of a function); a line number for anything else (an
    attribute of ``me``, a container's item)."""
    while True:
        if isinstance(arg, ast.Name):
            return arg
        if isinstance(arg, ast.Subscript):
            arg = arg.value
        elif isinstance(arg, ast.Call):
            func = arg.func
            if not isinstance(func, ast.Attribute) or (isinstance(func.value, ast.Name) and func.value.id == me) or (
                    isinstance(func.value, ast.Attribute)):
                return None  # self.bn(x), F.relu(x), self.block.conv(x), torch.cat(...): a new tensor
            arg = func.value  # x.view(...), x.transpose(...): maybe a view of x
        elif isinstance(arg, ast.Attribute):
            if isinstance(arg.value, ast.Name) and arg.value.id == me:
                return arg.lineno  # self.h: held by the module
            arg = arg.value
        else:
            return arg.lineno if isinstance(arg, (ast.List, ast.Tuple, ast.Starred)) else None


# what a tensor's attribute read gives that cannot hold its data
_METADATA = frozenset({"shape", "dtype", "device", "ndim", "is_cuda", "requires_grad", "grad_fn", "layout", "is_leaf",
                       "names", "is_sparse", "is_quantized", "is_meta", "itemsize", "nbytes"})
# methods and torch functions known to return a new tensor (or no tensor): anything else may return its argument or a
# view of it (adjoint, numpy, unsafe_chunk, broadcast_tensors, as_tensor, jit.annotate, Parameter: each made an alias
# the check missed, until 2026-12-03)
_FRESH = frozenset({
    "size", "dim", "numel", "item", "tolist", "element_size", "stride", "storage_offset", "nelement", "is_contiguous",
    "data_ptr", "sum", "mean", "std", "var", "norm", "prod", "max", "min", "amax", "amin", "argmax", "argmin", "abs",
    "exp", "log", "sqrt", "rsqrt", "pow", "add", "sub", "mul", "div", "matmul", "mm", "bmm", "softmax",
    "log_softmax", "relu", "sigmoid", "tanh", "gelu", "silu", "clone", "eq", "ne", "lt", "gt", "le", "ge", "any",
    "all", "cumsum", "logsumexp", "masked_fill", "where", "clamp", "round", "floor", "ceil", "sign", "neg",
    "reciprocal", "square", "cat", "stack", "concat", "concatenate", "zeros_like", "ones_like", "empty_like",
    "full_like", "rand_like", "randn_like", "linear", "conv1d", "conv2d", "conv3d", "layer_norm", "batch_norm",
    "group_norm", "rms_norm", "isfinite", "isnan", "allclose", "equal", "embedding"})
_MODULE_NAMES = frozenset({"torch", "F", "nn", "functional"})  # torch.x(...), F.x(...), torch.nn.functional.x(...)
_HARMLESS = frozenset({"len", "print", "isinstance", "id", "hasattr", "repr", "str", "float", "int", "bool"})
# reads of a variable that never name it: eval("h"), locals()["h"], sys._getframe(0).f_locals["h"]
_BY_NAME = frozenset({"eval", "exec", "locals", "vars", "globals", "_getframe", "currentframe"})
_STORING = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "put", "put_nowait", "push",
                      "__setitem__", "appendleft"})


def _torch_function(func: ast.expr) -> bool:
    """``torch.cat``, ``F.relu``, ``torch.nn.functional.gelu``: a torch function, which keeps no argument."""
    while isinstance(func, ast.Attribute):
        func = func.value
        if isinstance(func, ast.Name):
            return func.id in _MODULE_NAMES
    return False


def _torch_ops(func: ast.expr) -> bool:
    """``torch.ops.<namespace>.<op>...``: any op, whose result may be its argument's view."""
    chain = []
    while isinstance(func, ast.Attribute):
        chain.append(func.attr)
        func = func.value
    return isinstance(func, ast.Name) and func.id == "torch" and chain[-1:] == ["ops"]


def _shared_names(function: ast.FunctionDef | ast.AsyncFunctionDef, me: str, parents: dict[int, ast.AST],
                  passthrough: _Parent) -> tuple[set[str], dict[str, set[str]]]:
    """Which variables' tensors (or views of them) another holder may read: ``escaped``, those put in a container
    (``[v]``, ``feats.append(v)``, ``self.feats.append(v)``, ``store[k] = v``, ``self.h = v``, a global), passed to a
    function of the user's (``keep(store, v)``), yielded, or read by a lambda or nested def; and ``links``, each
    variable's other names (``t = v``, ``first = v[:, :4]``, ``a, b = v.chunk(2)``, ``for t in v``, ``skip =
    self.drop(v)``: a module may return its input), both ways. Read as a number (``v.shape``, ``v.size(1)``),
    computed on (``v + 1``, ``v.sum()``), passed to a torch function (``torch.cat([v])``) or to a module of ``me``
    whose result is not kept under another name, or assigned back to itself (``v = v.view(...)``) is neither. No
    control flow is followed (a branch not taken counts)."""
    escaped: set[str] = set()
    links: dict[str, set[str]] = {}
    outside = {n for node in ast.walk(function) if isinstance(node, (ast.Global, ast.Nonlocal)) for n in node.names}
    arguments = {a.arg for a in (*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs,
                                 *(a for a in (function.args.vararg, function.args.kwarg) if a is not None))}
    assigned = {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
    local = (arguments | assigned) - {me}  # (self, torch, F: not tensors the function holds)
    for node in ast.walk(function):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _kept_by(node.value, me, local):
            # h = self.buf (if ...): h holds a tensor the module keeps, which its other code reads by that name
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            escaped |= {t.id for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)}
        if not (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in local):
            continue
        if _captured(node, function, parents):
            escaped.add(node.id)  # read by a lambda or nested def, which may run after the call
            continue
        call = parents.get(id(node))
        if isinstance(call, ast.Call) and node in call.args and isinstance(call.func, ast.Name) and (
                call.func.id not in _HARMLESS):
            escaped.add(node.id)  # keep(store, v), as_rows(v): the user's function may keep v, or return a view of it
        if (isinstance(call, ast.Call) and node in call.args and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name) and call.func.value.id == me
                and call.func.attr in passthrough.keepers):
            escaped.add(node.id)  # self.keep(v): a module whose forward keeps its input
        here, up = _holding(node, parents, me, passthrough)
        if isinstance(up, (ast.Assign, ast.AnnAssign, ast.NamedExpr, ast.For, ast.AsyncFor, ast.comprehension)):
            value = up.iter if isinstance(up, (ast.For, ast.AsyncFor, ast.comprehension)) else up.value
            if value is not here:
                continue
            targets = (up.targets if isinstance(up, ast.Assign) else [up.target])
            names = [t for target in targets for t in ast.walk(target) if isinstance(t, ast.Name)]
            stored = [t for target in targets for t in ast.walk(target)
                      if isinstance(t, (ast.Attribute, ast.Subscript, ast.Starred))]
            if stored or any(t.id in outside for t in names):
                escaped.add(node.id)  # self.h = v, store[k] = v, a global
            for target in names:
                if target.id != node.id:
                    links.setdefault(node.id, set()).add(target.id)
                    links.setdefault(target.id, set()).add(node.id)
        elif isinstance(up, ast.Match) and up.subject is here:
            escaped.add(node.id)  # match v: case t: (t is v)
        elif _shares(here, up, me, parents, passthrough):
            escaped.add(node.id)
    return escaped, links


def _kept_by(value: ast.expr, me: str, local: set[str] | None = None) -> bool:
    """Whether ``value`` may be a tensor ``me`` keeps (``self.buf``, ``self.cache[k]``, ``a if c else self.buf``), or,
    given the function's ``local`` names, a global one (``h = G``)."""
    if isinstance(value, ast.Name):
        return local is not None and value.id not in local and value.id != me and value.id not in dir(builtins)
    if isinstance(value, ast.Attribute):
        root: ast.expr = value
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id == me
    if isinstance(value, (ast.Subscript, ast.Starred)):
        return _kept_by(value.value, me, local)
    if isinstance(value, ast.IfExp):
        return _kept_by(value.body, me, local) or _kept_by(value.orelse, me, local)
    if isinstance(value, ast.BoolOp):
        return any(_kept_by(v, me, local) for v in value.values)
    return False


def _captured(node: ast.Name, function: ast.AST, parents: dict[int, ast.AST]) -> bool:
    """Whether ``node`` is read inside a lambda, a def nested in ``function`` or a comprehension (a generator runs
    later; a list's items may be views) that does not bind that name."""
    up = parents.get(id(node))
    while up is not None and up is not function:
        if isinstance(up, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef)):
            bound = {a.arg for a in (*up.args.posonlyargs, *up.args.args, *up.args.kwonlyargs)}
            if node.id not in bound:
                return True
        if isinstance(up, ast.ClassDef):
            return True  # class K: v = h (K.v holds it)
        if isinstance(up, (ast.GeneratorExp, ast.ListComp, ast.SetComp, ast.DictComp)):
            targets = {n.id for g in up.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
            if node.id not in targets:
                return True  # (h * k for k in ...): lazy, or its items views of h
        up = parents.get(id(up))
    return False


def _holding(node: ast.Name, parents: dict[int, ast.AST], me: str, passthrough: _Parent
             ) -> tuple[ast.AST, ast.AST | None]:
    """The outermost expression that may still hold ``node``'s tensor (or a view of it: ``v[...]``, ``v.view(...)``,
    ``torch.chunk(v, 2)``, ``[v, w]``, ``*v``; or itself: ``self.drop(v)``, a module of ``me`` in ``passthrough``,
    which may return its input: ``nn.Identity``, a dropout in evaluation), and the node using it."""
    here: ast.AST = node
    up = parents.get(id(here))
    while True:
        if isinstance(up, ast.Attribute) and up.value is here and up.attr not in _METADATA | _FRESH:
            call = parents.get(id(up))
            if isinstance(call, ast.Call) and call.func is up:
                up = call  # v.view(...), v.mul_(2), v.numpy(): any method but those known to make a new tensor
            # (else v.T, v.data, f = v.view: a view, a bound method of v, or an attribute of an object v)
        elif isinstance(up, ast.Subscript) and up.value is here:
            pass  # v[:, :4]
        elif (isinstance(up, ast.Call) and here in up.args and isinstance(up.func, ast.Attribute)
              and (up.func.attr not in _FRESH or _torch_ops(up.func)) and _torch_function(up.func)):
            pass  # torch.chunk(v, 2), torch.broadcast_tensors(v, w), torch.ops.aten.alias.default(v)
        elif (isinstance(up, ast.Call) and here in up.args and isinstance(up.func, ast.Attribute)
              and isinstance(up.func.value, ast.Name) and up.func.value.id == me
              and up.func.attr in passthrough.passthrough):
            pass  # skip = self.drop(v): v itself in evaluation (a v = self.ident(v) assigns it back: not sharing)
        elif (isinstance(up, ast.Call) and here in up.args and isinstance(up.func, ast.Name)
              and up.func.id not in _HARMLESS and up.func.id not in _ITERATING):
            pass  # t = as_rows(v): the user's function may return a view of v
        elif isinstance(up, (ast.List, ast.Tuple, ast.Set, ast.Starred)):
            pass  # [v, w]: holds v
        elif isinstance(up, ast.Dict) and here in up.values:
            pass
        elif isinstance(up, ast.IfExp) and up.test is not here:
            pass
        elif isinstance(up, ast.BoolOp) or (isinstance(up, ast.UnaryOp) and isinstance(up.op, ast.UAdd)):
            pass  # None or v; +v is v
        elif isinstance(up, ast.Call) and up.func is here:
            pass  # f = v.view; f(4, -1)
        else:
            return here, up
        here, up = up, parents.get(id(up))


def _shares(value: ast.AST, up: ast.AST | None, me: str, parents: dict[int, ast.AST], passthrough: _Parent
            ) -> bool:
    """Whether ``value`` (which may hold a variable's tensor) is kept by something else where ``up`` uses it (not an
    assignment: :func:`_shared_names` links those)."""
    if isinstance(up, ast.AugAssign):
        return isinstance(value, (ast.List, ast.Tuple, ast.Set, ast.Dict))  # feats += [v]; (s += v: a sum)
    if isinstance(up, (ast.Yield, ast.YieldFrom)):
        return True
    if isinstance(up, ast.keyword):
        up = parents.get(id(up))
    if isinstance(up, ast.Call) and up.func is not value:
        return not _keeps_no_argument(up.func, me, passthrough.modules, passthrough.keepers)
    return False


def _keeps_no_argument(func: ast.expr, me: str, modules: frozenset[str] | None = None,
                       keepers: frozenset[str] = frozenset()) -> bool:
    """A call of a torch function, of a module of ``me`` (``self.conv(v)``) or of a harmless builtin: nothing keeps
    its arguments after it returns."""
    if isinstance(func, ast.Name):
        return func.id in _HARMLESS
    if not isinstance(func, ast.Attribute) or func.attr in _STORING:
        return False  # feats.append(v), self.feats.append(v), store.update(...)
    if _torch_function(func):
        return True
    # self.conv(v) (a module of the parent); not self.store.keep(v) (a method of one, which may keep v), nor
    # w.add(v) (w may be a list)
    return (isinstance(func.value, ast.Name) and func.value.id == me and func.attr not in keepers
            and (modules is None or func.attr in modules))  # (self._stash(v): a method of the parent, may keep v)


def _children_called(loop: ast.For | ast.AsyncFor, me: str) -> bool:
    """``for m in self.children(): m(x)`` (or ``modules()``, ``_modules.values()``, ``named_children()``): the loop
    calls what it takes from the parent's own modules, the activation among them."""
    names = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    if not _iterates_children(loop.iter, me):
        return False
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names
               for statement in loop.body for n in ast.walk(statement))


def _iterates_children(iterable: ast.expr, me: str) -> bool:
    """``self.children()``, ``self._modules.values()``, ``self.named_modules()``: the parent's own modules."""
    mentions = {n.attr for n in ast.walk(iterable) if isinstance(n, ast.Attribute)}
    roots = {n.id for n in ast.walk(iterable) if isinstance(n, ast.Name)}
    return me in roots and not mentions.isdisjoint(_DYNAMIC)


def _fresh(arg: ast.expr, me: str, passthrough: _Parent) -> bool:
    """Whether ``arg`` is a new tensor nothing else holds: a call of a module of ``me`` that does not return its
    input (``self.bn(x)``), or arithmetic on such (``self.bn(x) * 2``)."""
    if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and isinstance(arg.func.value, ast.Name):
        return (arg.func.value.id == me and arg.func.attr not in passthrough.passthrough
                and (passthrough.modules is None or arg.func.attr in passthrough.modules))
    if isinstance(arg, ast.BinOp):
        return True  # a + b: a new tensor
    return False


def _branches(node: ast.AST, function: ast.AST, parents: dict[int, ast.AST]) -> list[ast.AST]:
    """The statements around ``node`` that run it on some paths only (an ``if``, a loop, a ``try``): a binding
    inside one that is not also around the call does not rebind on every path to it (``if not alt: x = self.norm(x)``
    left the caller's tensor to the activation on the other path: an adversarial pass on 2026-12-03)."""
    found: list[ast.AST] = []
    up = parents.get(id(node))
    while up is not None and up is not function:
        if isinstance(up, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.IfExp, ast.Match)):
            found.append(up)
        up = parents.get(id(up))
    return found


def _reads_after(function: ast.FunctionDef | ast.AsyncFunctionDef, name: str,
                 passthrough: _Parent = _UNKNOWN, dynamic: bool = True) -> int | None:
    """The line (in the parsed class) where ``function`` may rely on the activation ``self.<name>`` overwriting its
    input, or None where every use is one the out-of-place activation computes the same: a direct call whose input
    is a temporary (``self.conv(self.act(self.bn(x)))``), or a variable ``v`` that no other name shares and that is
    assigned the call's result (``v = self.act(v)``, ``v = self.conv(self.act(v))``) or never read after it. Anything
    else counts: a call as a statement (``self.act(v)``), ``v`` read after the call, ``v`` shared with another name
    (``t = v``), a keyword or starred input, the module used other than called (``a = self.act``, ``self.act.forward``,
    ``getattr(self, "act")``, passed to ``checkpoint``), a call inside a lambda, an input that is (a view of) an
    argument of the function not assigned before the call (the caller's tensor). No control flow is followed: a read
    on any path counts."""
    if not function.args.args:
        return None
    me = function.args.args[0].arg  # ``self``, whatever it is called
    arguments = {a.arg for a in (*function.args.posonlyargs, *function.args.args[1:], *function.args.kwonlyargs,
                                 *(a for a in (function.args.vararg, function.args.kwarg) if a is not None))}
    parents = {id(child): node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    bound = [(t.id, (node.end_lineno or node.lineno, node.end_col_offset or 0), _branches(node, function, parents))
             for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]
    names = [n for n in ast.walk(function) if isinstance(n, ast.Name)]
    local_names = arguments | {n.id for n in names if not isinstance(n.ctx, ast.Load)}
    escaped, links = _shared_names(function, me, parents, passthrough)
    for node in ast.walk(function):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) and node.args[0].id == me
                and (dynamic or isinstance(node.args[1], ast.Constant))
                and not (isinstance(node.args[1], ast.Constant) and node.args[1].value != name)):
            return node.lineno  # getattr(self, "act"), getattr(self, computed)
        if isinstance(node, ast.Call) and (
                (isinstance(node.func, ast.Name) and node.func.id in _BY_NAME)
                or (isinstance(node.func, ast.Attribute) and node.func.attr in _BY_NAME)):
            return node.lineno  # a variable read by its name at run time
        if dynamic and isinstance(node, (ast.For, ast.AsyncFor)) and _children_called(node, me):
            return node.lineno
        if dynamic and isinstance(node, ast.comprehension) and _iterates_children(node.iter, me):
            return getattr(node.iter, "lineno", 0)  # [m for m in self.children() if ...][0](x)
        if not (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)
                and node.value.id == me and isinstance(node.ctx, ast.Load)):
            continue
        call = parents.get(id(node))
        if isinstance(call, ast.Attribute) and call.attr not in ("forward", "__call__", "_call_impl"):
            continue  # a setting read (self.act.inplace)
        if (isinstance(call, ast.Call) and call.func is not node and isinstance(call.func, ast.Name)
                and call.func.id in _INTROSPECTION and call.args and call.args[0] is node):
            continue  # isinstance(self.act, ...)
        if not isinstance(call, ast.Call) or call.func is not node:
            return node.lineno  # used other than called directly
        if call.keywords or any(isinstance(a, ast.Starred) for a in call.args):
            return node.lineno
        enclosing: ast.AST = call
        up = parents.get(id(call))
        while up is not None and not isinstance(enclosing, ast.stmt):
            if isinstance(up, ast.Lambda):
                return node.lineno
            enclosing, up = up, parents.get(id(up))
        if not isinstance(enclosing, ast.stmt):
            return node.lineno
        loops = []  # the loops around the call, within function: a read anywhere in one may come after the call
        outer = parents.get(id(enclosing))
        while outer is not None and outer is not function:
            if isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                return node.lineno  # called inside a nested def, on its own arguments or a captured name
            if isinstance(outer, (ast.For, ast.AsyncFor, ast.While)):
                loops.append(outer)
            outer = parents.get(id(outer))
        statement = enclosing
        if isinstance(statement, ast.Expr):
            return node.lineno  # called for its effect alone
        roots: list[ast.Name] = []
        for arg in call.args:
            root = _root_name(arg, me)
            if isinstance(root, int):
                return node.lineno
            if root is not None and root.id in local_names:
                roots.append(root)  # v, v[...], v.view(...)
            elif not _fresh(arg, me, passthrough):
                # self.act(torch.flatten(h)), self.act(h if c else x), self.act(flat(h)): every local variable in it
                roots += [n for n in ast.walk(arg) if isinstance(n, ast.Name) and n.id in local_names]
        in_call = {id(n) for n in ast.walk(call)}
        for root in roots:
            group = {root.id}  # the variable and its other names (t = v), which read the same tensor
            while True:
                more = set().union(*(links.get(v, set()) for v in group)) - group
                if not more:
                    break
                group |= more
            if not group.isdisjoint(escaped):
                return node.lineno
            around = {id(b) for b in _branches(call, function, parents)}
            if any(v in arguments and not any(w == v and end <= (call.lineno, call.col_offset)
                                              and all(id(b) in around for b in branches)
                                              for w, end, branches in bound)
                   for v in group):
                return node.lineno  # the caller's tensor (not rebound on every path to the call), read after it
            targets = (statement.targets if isinstance(statement, ast.Assign)
                       else [statement.target] if isinstance(statement, ast.AnnAssign) else [])
            # v = ...self.act(v)...: later reads of v see the result; any other read after the call, in its own
            # statement too (self.conv(self.act(v)) + skip), sees what the in-place activation left
            assigned = {t.id for t in targets if isinstance(t, ast.Name)}
            end = (call.end_lineno or call.lineno, call.end_col_offset or 0)
            if any(n.id in group - assigned and isinstance(n.ctx, ast.Load) and (n.lineno, n.col_offset) > end
                   for n in names):
                return node.lineno
            if any(isinstance(n, ast.Name) and n.id in group and isinstance(n.ctx, ast.Load) and id(n) not in in_call
                   for n in ast.walk(statement)):
                return node.lineno  # torch.cat([v, self.act(v)]), v + self.act(v): v's data read after the call
            if any(isinstance(n, ast.Name) and n.id in group - assigned and isinstance(n.ctx, ast.Load)
                   and id(n) not in in_call
                   for loop in loops for n in ast.walk(loop)):
                return node.lineno  # read again in the loop's next pass
    return None


def _writes_its_input(trace: ModelTrace, site: CallSite) -> bool:
    """Whether an in-place op inside ``site`` writes a storage the site did not make (its input): timm's GammaAct,
    ``act(x).mul_(gamma)``, scales the activation's own new output in place, and was left alone as "runs in place"
    with advice it already followed until 2026-12-03 (found by a helper's run on dm_nfnet_f0). An in-place op whose
    writes the trace does not name counts as writing its input."""
    made: set[int] = set()
    for op in trace.ops_in(site, compute_only=False):
        if op.name.endswith("_") and not op.name.startswith("_") and (
                not op.writes or any(k in site.inputs or k not in made for k in op.writes)):
            return True
        made.update(op.outputs)
    return False


_IN_PLACE = ("{} runs in place with no inplace switch convert could turn off: its output overwrote its input, so "
             "nothing is left to rebuild the output from. To let convert rebuild it for the layers that keep it, "
             "make its forward run out of place (inplace=False), where nothing else reads the activation's input "
             "after it")


@register_rule("activation_consumer")
def activation_consumer(ctx: Context) -> Iterator[Candidate]:
    """An activation's output kept only by later call sites (Linear, Conv1D, conv, a parent's matmul): they keep a
    recipe (the activation of its input) instead."""
    done: set[int] = set()
    for trace, site in ctx.undecided_sites(done, stacks_on=("checkpoint_pointwise",)):
        module = site.module
        if not trace.leaf(site) or not _activation_like(ctx, site):
            continue
        done.add(id(module))
        sites = trace.sites_of(site.path)
        acts = [k for k in site.inputs if trace.storages[k].kind != "parameter"]
        if len(acts) != 1 or len(site.outputs) != 1 or _random_ops(trace, site):
            continue
        in_place = site.outputs[0] in site.inputs or _writes_its_input(trace, site)
        if in_place and getattr(module, "inplace", None) is not True:  # no switch to turn it out of place
            if any(trace.storages[s.outputs[0]].holders for s in sites if s.outputs):  # something to save
                yield Candidate((site.path,), reason=_IN_PLACE.format(type(module).__name__), skip=True)
            continue
        writer = trace.written_after(site.path)
        if writer is not None:  # (found by an adversarial pass: rebuilt, the Linear trained on the unchanged output)
            yield Candidate((site.path,), reason=rebuilt_yet_changed(writer), skip=True)
            continue
        edited = ctx.input_edited(site.path)
        if edited:
            yield Candidate((site.path,), reason=edited, skip=True)
            continue
        read_after = _source_reads_input_after(ctx, module) if in_place else None
        if in_place and not read_after:
            # a forward hook on the module that made the input (a feature extractor, Grad-CAM) keeps that output: the
            # in-place activation overwrote it, out of place the hook kept the values before it (1.196 off on the
            # features, silently, until 2026-12-03: an adversarial pass); global forward hooks see it too
            producers = [s.module for s in trace.sites if any(k in s.outputs for k in acts) and s is not site]
            hooked = [type(m).__name__ for m in producers if "forward hooks" in ctx.user_hooks(m)]
            if hooked or any(not memtrims(h) for h in nn.modules.module._global_forward_hooks.values()):
                read_after = (f"a forward hook on {hooked[0]}, which made its input, may keep that output"
                              if hooked else "global forward hooks may keep its input")
        if read_after:
            yield Candidate((site.path,), reason=f"runs in place and {read_after}: made out of place, a read of "
                                                 "that input after it would see the values before the activation",
                            skip=True)
            continue
        consumers: list[nn.Module] = []
        expected = 0
        refused = None
        for s in sites:
            if not s.outputs:
                continue
            found = _holder_modules(ctx, s.outputs[0], s)
            if found is None:
                refused = "its output is kept by its parent's own code before it returns"
                break
            if not found:
                continue
            consumers += [m for m in found if m not in consumers]
            if in_place:
                # its input and output are one storage, which its consumers keep, as its input will be once it runs
                # out of place: what it drops is the copy of its input torch's in-place autograd makes (silu_, not
                # leaky_relu_, which keeps its result); a LeakyReLU model had each candidate applied and measured
                # alone, a forward apiece, for nothing, until 2026-12-03 (tests: test_changes_the_trace_shows_...)
                expected += sum(trace.storages[k].nbytes for k in trace.held_inside(s)
                                if k not in s.inputs and k not in s.outputs)
                continue
            source = [k for k in s.inputs if trace.storages[k].kind != "parameter"]
            input_kept = bool(source) and bool(trace.storages[source[0]].holders)
            expected += trace.storages[s.outputs[0]].nbytes - (0 if input_kept else trace.storages[source[0]].nbytes)
        if refused:
            yield Candidate((site.path,), reason=refused, skip=True)
            continue
        if not consumers:
            continue
        hooks = ctx.user_hooks(module)
        if hooks:
            yield Candidate((site.path,), reason=f"{type(module).__name__} has {', '.join(hooks)}: they would see a "
                                                 "rebuilt output", skip=True)
            continue
        owner = label((site.path,), "a recomputed activation")
        keeps = _keeps_output(trace, sites)
        by_node = not keeps and all(ctx.op_names(s) == ctx.op_names(site) for s in sites) and len(
            ctx.op_names(site)) == 1 and ctx.op_names(site)[0] in NODE_OPS

        def apply(module: nn.Module = module, consumers: list = consumers, owner: str = owner,
                  keeps: bool = keeps, in_place: bool = in_place, by_node: bool = by_node) -> Undo:
            undos = [_out_of_place(module)] if in_place else []
            # one op whose node keeps what it reads (gelu, silu, ...): rebuilt from that node (less Python per call)
            producer = (recompute_op_output(module, owner=owner) if by_node
                        else recompute_output(module, owner=owner, keeps_output=keeps))
            return chain(*undos, producer.remove, _install_consumers(consumers))

        # NOTE [ in-place activations made out of place ]: an activation run in place (timm and torchvision build
        # them so) overwrites its input, leaving nothing to rebuild its output from; torch's in-place autograd
        # keeps a copy of that input anyway, so out of place it keeps the same bytes and computes the same values.
        # What the trace cannot show is whether the parent reads the input after the call through its own name
        # (`act(x); return conv(x)`, a running statistic of `x`, a straight-through `x - x.detach()`), where out of
        # place it would read the values before the activation. The parents' source is read for such a read on any
        # path (_source_reads_input_after: a branch the example inputs did not take too), and convert runs a
        # training step on the example inputs before and after and keeps the change only if the outputs, the
        # buffers and every parameter's gradient are bitwise the same
        yield Candidate((site.path,), type(module).__name__ + (" (in place)" if in_place else ""),
                        ("made out of place, " if in_place else "") + _recomputed_for(ctx, consumers),
                        reason="its output is kept only by later call sites, its input by itself",
                        targets=(module,), touches=tuple(consumers), expected_bytes=expected,
                        limits=LIMITS["recompute_op_output" if by_node else "recompute_output"], apply=apply,
                        stacks_on=("checkpoint_pointwise",), same_outputs=in_place)


# ---------------------------------------------------------------------- embedding lookups and their sum
def _embedding_sums(ctx: Context, trace: ModelTrace) -> dict[int, list[CallSite]]:
    """Storage -> the embedding lookups it is the sum of (``a + b``, ``(a + b) + c``, ``s += c``, or one lookup's
    output itself): lookups are leaf calls whose one compute op is ``embedding`` (any class, no hooks); a storage
    any other op changes in place is dropped."""
    sums: dict[int, list[CallSite]] = {}
    for site in trace.sites:
        if (trace.leaf(site) and len(site.outputs) == 1 and ctx.op_names(site) == ["embedding"]
                and not ctx.user_hooks(site.module)):
            sums[site.outputs[0]] = [site]
    if not sums:
        return sums
    for op in trace.ops:
        name = op_name(op)
        if name == "add" and len(op.inputs) == 2 and all(k in sums for k in op.inputs):
            target = op.writes[0] if op.writes else (op.outputs[0] if len(op.outputs) == 1 else None)
            if target is not None and (not op.writes or target == op.inputs[0]):
                sums[target] = sums.get(target, []) + [s for k in op.inputs for s in sums[k] if k != target]
                continue
        for key in op.writes:
            sums.pop(key, None)
    return sums


@register_rule("embedding_sum")
def embedding_sum(ctx: Context) -> Iterator[Candidate]:
    """Embedding lookups, or their sum (token + position embeddings), kept by later call sites (the first norm keeps
    its input): they keep the lookups' indices instead, and backward rebuilds the sum by the same lookups and
    additions (bitwise)."""
    trace = ctx.trace
    if trace is None:
        return
    # the consumers (a norm an earlier rule changed, still keeping its input) are targets too, for module_filter
    everything = tuple(rule.name for rule in registered_rules())
    for key, lookups in _embedding_sums(ctx, trace).items():
        holders = trace.storages[key].holders
        if not holders or trace.storages[key].kind != "activation":
            continue
        sites = [trace.sites[h.site] if h.site is not None else None for h in holders]
        names = tuple(dict.fromkeys(s.path for s in lookups))
        if any(s is None or not trace.leaf(s) or s.index in {lk.index for lk in lookups} for s in sites):
            where = next((s.path for s in sites if s is not None and not trace.leaf(s)), "the top-level forward")
            yield Candidate(names, reason=f"the embeddings' {'sum' if len(lookups) > 1 else 'output'} is kept by "
                                          f"{where}'s own code, not by a module it calls", skip=True)
            continue
        edited = next((why for why in map(ctx.input_edited, names) if why), None)
        if edited:  # (the indices the rebuild reads; found by an adversarial pass)
            yield Candidate(names, reason=f"an embedding lookup: {edited}", skip=True)
            continue
        consumers = list(dict.fromkeys(s.module for s in sites if s is not None))
        producers = list(dict.fromkeys(s.module for s in lookups))
        what = "Embedding sum" if len(lookups) > 1 else "Embedding output"
        owner = label(names, "a recomputed embedding sum")

        def apply(producers: list = producers, consumers: list = consumers, owner: str = owner) -> Undo:
            return chain(recompute_sum(consumers, producers, owner=owner).remove, _install_consumers(consumers))

        yield Candidate(names, what, f"rebuilt from the indices, {_recomputed_for(ctx, consumers)}",
                        reason=f"{'a sum of embedding lookups' if len(lookups) > 1 else 'an embedding lookup'} "
                               "kept only by later call sites",
                        targets=(*producers, *consumers), expected_bytes=trace.storages[key].nbytes,
                        limits=LIMITS["recompute_sum"], apply=apply, stacks_on=everything)
    yield from _other_lookups(ctx, trace)


def _other_lookups(ctx: Context, trace: ModelTrace) -> Iterator[Candidate]:
    """Skip lines for embedding modules that compute more than the lookup (BART's scaled word embedding: a ``mul``
    after it; its learned positions: an ``add`` on the ids before it) whose output, or a sum of it, later call sites
    keep: ``embedding_sum`` rebuilds lookups alone, so these stay kept, and the report says why."""
    kept = {k for k, st in trace.storages.items() if st.kind == "activation" and st.holders}
    # a storage added into a kept sum (``a + b``, ``(a + b) + c``, ``s += c``) counts as kept: ops run in order, so
    # walking them backwards sees each sum before its parts
    for op in reversed(trace.ops):
        if op_name(op) == "add" and len(op.inputs) == 2 and any(t in kept for t in (op.writes or op.outputs)[:1]):
            kept.update(op.inputs)
    for site in trace.sites:
        names = ctx.op_names(site) if trace.leaf(site) else []
        if "embedding" in names and names != ["embedding"] and len(site.outputs) == 1 and site.outputs[0] in kept:
            yield Candidate((site.path,), reason=f"{type(site.module).__name__} computes more than a lookup "
                                                 f"({', '.join(names)}): embedding_sum rebuilds plain lookups only, so "
                                                 "its output (or the sum it feeds) is kept as torch keeps it",
                            skip=True)

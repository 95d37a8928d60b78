"""BatchNorm + ReLU that keeps only the BatchNorm's input: its output is recomputed wherever it is needed.

NOTE [ BatchNorm + ReLU, recomputed ]
ReLU's zeros lose the normalised value, so BatchNorm + ReLU cannot be inverted from its output (see
NOTE [ inverting BatchNorm + activation ]). The other way round works: keep the BatchNorm's input ``x`` (which
BatchNorm's backward needs anyway) and recompute ``z = relu(batch_norm(x))`` wherever ``z`` is needed: in ReLU's
backward (its mask) and in the next layers, which would otherwise keep ``z`` for their weight gradients.

The forward is exactly the unconverted model's: torch's ``batch_norm`` (cuDNN's kernel where torch picks it; its
backward node keeps ``x`` and the statistics, as always), then a ReLU, here in place, whose output is marked as a
recipe (:mod:`memtrim.techniques.recompute`, NOTE [ recipes at consumer call sites ]): marked before the ReLU, at the
version ``relu_`` leaves, with ``relu_`` run in a consumer scope, so ReLU's backward node keeps the recipe instead of
its output (its mask); :func:`memtrim.convert` runs the modules in which autograd saved the output during its traced
forward as consumer scopes (:func:`memtrim.techniques.recompute.keep_recipes_in`): when an op there saves a tensor
that is a BatchNormReLU output (same storage, same version), autograd keeps the recipe instead.

Unpacking rebuilds ``z`` once per backward, shared by every holder and released after the last, by the same
``batch_norm`` call on the same input: in training without running statistics (the rebuild must not update them; the
batch statistics, and so the output, are the same), in eval from copies of the running statistics made at the forward (a
training forward of the same module before the backward updates them in place, inside torch's kernel, without a version
bump). In training the forward computes nothing else (no per-channel terms: a converted ResNet's forward launches the
kernels the plain one does). The rebuilt ``z`` is the forward's bit for bit where the BatchNorm kernel is deterministic:
on the CPU, tested for every dtype, memory format and thread count (the report says bitwise there, and a double backward
through it is torch's); on CUDA checked on one H200 (torch 2.11, cuDNN's kernel, float32 and float64, contiguous: three
ResNets' gradients bitwise, ``benchmarks/convert_cuda_check.py``) but not on every CUDA kernel path (channels_last, half
precision, torch's native kernels), so the report says not bitwise there. The rebuild reads the weight and bias as the
forward read them (a pruned or parametrized weight: the one computed for the call), so they are the recipe's sources,
version-checked like autograd's saved tensors, under saved-tensor hooks too: a change in place between forward and
backward raises autograd's error, also for the bias, which torch's own backward does not read; a change through
``.data`` is not seen. Every other saved tensor passes through unchanged (and through any saved-tensor hooks active
outside, so memtrim's tracker still sees them), with autograd's in-place check repeated. Under torch.compile and
torch.func the module runs as torch's BatchNorm and ReLU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..guards import (
    OUTPUT_HOOKS,
    RELU,
    WatchedFusion,
    fx_tracing,
    mark_activated,
    owner,
    plain_only,
    refuse_later_hooks,
)
from ..recompute._core import enter_consumer_scope, exit_consumer_scope, mark_recomputable
from .norm_act import batchnorm_arguments, other_dtype, refuse_fx_trace

__all__ = ["BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d", "keeping_class", "rebuilds_bitwise"]


def _rebuild(x: torch.Tensor, *tensors: torch.Tensor, layout: tuple[bool, bool, bool], training: bool, eps: float,
             cudnn: bool) -> torch.Tensor:
    """The ReLU output: ``batch_norm`` as the forward called it, without updating running statistics. ``tensors``
    are the weight, bias and running statistics the forward had (``layout``: which of weight, bias and the pair of
    running statistics there are)."""
    found = iter(tensors)
    weight, bias = (next(found) if layout[0] else None), (next(found) if layout[1] else None)
    mean, var = (next(found), next(found)) if layout[2] else (None, None)
    return torch.relu_(torch.batch_norm(x, weight, bias, mean, var, training, 0.0, eps, cudnn))


def rebuilds_bitwise(bn: nn.Module) -> bool:
    """Whether ``bn``'s rebuilt output is known to be its forward's bit for bit where its tensors are: on the CPU
    (tested); on CUDA only some kernel paths were checked (NOTE [ BatchNorm + ReLU, recomputed ])."""
    return all(t.device.type == "cpu" for t in (*bn.parameters(recurse=False), *bn.buffers(recurse=False)))


def _batchnorm_relu(bn: _BatchNormReLU, x: torch.Tensor) -> torch.Tensor:
    """torch's own BatchNorm and an in-place ReLU whose output is kept as a recipe. Autograd's nodes are the native
    ones: no Python in backward but the unpacking. This runs at every call of every converted BatchNorm: its
    parameters are read from their dict once (``bn.weight`` is nn.Module.__getattr__'s slow path)."""
    factor, bn_training, running_mean, running_var = batchnorm_arguments(bn, x)
    params, cudnn = bn._parameters, torch.backends.cudnn.enabled
    # a weight that pruning or a parametrization computes is no entry of the dict: read as torch's forward reads it
    weight = params["weight"] if "weight" in params else bn.weight
    bias = params["bias"] if "bias" in params else bn.bias
    out = torch.batch_norm(x, weight, bias, running_mean, running_var, bn_training, factor, bn.eps, cudnn)
    # what the rebuild reads: the parameters, and in eval the running statistics (in training the batch's), copied:
    # a training forward of the same module before the backward updates them in place without a version bump
    stats = ([running_mean.clone(), running_var.clone()]
             if not bn_training and running_mean is not None and running_var is not None else [])
    tensors = [t for t in (weight, bias) if t is not None] + stats
    rebuild = functools.partial(_rebuild, layout=(weight is not None, bias is not None, bool(stats)),
                                training=bn_training, eps=bn.eps, cudnn=cudnn)
    # marked before the ReLU makes it, at the version relu_ leaves: relu_'s own save (its backward's mask) then
    # keeps the recipe too, in an ordinary consumer scope. The recipe holds x and the module's tensors, never z: z's
    # storage dies once nobody but recipes needs it
    # (the caller has checked grad mode and plain_only)
    if not mark_recomputable(out, rebuild, x, *tensors, owner=owner(bn), tag="relu", version=out._version + 1,
                             checked=True):
        return torch.relu_(out)
    enter_consumer_scope(checked=True)
    try:
        return torch.relu_(out)
    finally:
        exit_consumer_scope(checked=True)


class _BatchNormReLU(WatchedFusion, nn.modules.batchnorm._BatchNorm):
    """``nn.BatchNorm`` + ReLU keeping only the BatchNorm's input. See NOTE [ BatchNorm + ReLU, recomputed ]."""


    def extra_repr(self) -> str:
        """The BatchNorm's repr plus the ReLU it applies."""
        return f"{super().extra_repr()}, activation=relu (recomputed from the input)"


    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """``relu(batch_norm(input))``, keeping only ``input`` (torch's own ops where nothing is kept)."""
        refuse_later_hooks(self, "it returns the output of the ReLU after it, which is now an identity", OUTPUT_HOOKS)
        if fx_tracing():
            refuse_fx_trace(self)
        self._check_input_dim(input)
        plain = plain_only()
        # nothing kept, or compile/torch.func, or an input of another dtype than the BatchNorm's (a rebuild in another
        # dtype gave other gradients, 0.0625 off in bfloat16): torch's own ops
        if not torch.is_grad_enabled() or plain or other_dtype(self, input):
            factor, bn_training, running_mean, running_var = batchnorm_arguments(self, input)
            out = nn.functional.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training,
                                           factor, self.eps)
            # fused at one call of a shared ReLU (convert's batchnorm_relu_call_site): that PassThroughReLU relus
            # it there, as in the unconverted model (relu'd twice in place, autograd's check would refuse it)
            if getattr(self, "memtrim_relu_follows", False):
                return out
            return torch.relu_(out) if plain else mark_activated(torch.relu_(out), RELU)
        return mark_activated(_batchnorm_relu(self, input), RELU)


class BatchNormReLU1d(_BatchNormReLU, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU2d(_BatchNormReLU, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` + ReLU keeping only the BatchNorm's input."""


class BatchNormReLU3d(_BatchNormReLU, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` + ReLU keeping only the BatchNorm's input."""


# ---------------------------------------------------------------------- a fused module that stays its library's class
_KEEPING: dict[tuple[type, type], type] = {}


def _keeping_name(target: str, base: str) -> str:
    """The name of :func:`keeping_class`'s class for the two classes' names."""
    return f"{target}Keeping{base}"


def keeping_class(target: type, base: type) -> type:
    """``target`` (a BatchNormReLU class) that is still a ``base`` (timm's ``BatchNormAct2d``, which holds its
    activation as ``act``) to ``isinstance``: tools that rebuild such modules by class (timm's
    ``freeze_batch_norm_2d``, ``convert_sync_batchnorm``) then make the frozen or synchronised ``BatchNormAct2d``, with
    its ``act``, where a plain BatchNorm class would drop the ReLU. Made once per pair, a module attribute here
    (pickle finds it by name: :func:`__getattr__` makes it again in a new process)."""
    key = (target, base)
    found = _KEEPING.get(key)
    if found is None:
        name = _keeping_name(target.__name__, base.__name__)
        found = type(name, (target, base), {"__module__": __name__, "__qualname__": name,
                                            "__doc__": f"memtrim's {target.__name__}, still a {base.__module__}."
                                                       f"{base.__name__}."})
        _KEEPING[key] = found
        globals()[name] = found
    return found


def __getattr__(name: str) -> type:
    """A :func:`keeping_class` asked for by name (unpickling a converted model in a new process)."""
    if "Keeping" not in name:  # (asked during imports too: nothing to import for those)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from ..convert.recompute_rules import KNOWN_BATCHNORM_ACT

    for target in (BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d):
        for where, base_name in KNOWN_BATCHNORM_ACT:
            if name == _keeping_name(target.__name__, base_name):
                return keeping_class(target, getattr(importlib.import_module(where), base_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

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
bump). In training, where it was found to give the same bits, the rebuild normalises in one pass with the batch
statistics the forward computed instead (NOTE [ the one-pass rebuild ]). In training the forward computes nothing else
(no per-channel terms: a converted ResNet's forward launches the kernels the plain one does). The rebuilt ``z`` is the
forward's bit for bit where the BatchNorm kernel is deterministic: on the CPU, tested for every dtype, memory format and
thread count (the report says bitwise there, and a double backward through it is torch's); on CUDA checked on one H200
(torch 2.11, cuDNN's kernel, float32 and float64, contiguous: three ResNets' gradients bitwise,
``benchmarks/convert_cuda_check.py``) but not on every CUDA kernel path (channels_last, half precision, torch's native
kernels), so the report says not bitwise there. The rebuild reads the weight and bias as the forward read them (a pruned
or parametrized weight: the one computed for the call), so they are the recipe's sources, version-checked like
autograd's saved tensors, under saved-tensor hooks too: a change in place between forward and backward raises autograd's
error, also for the bias, which torch's own backward does not read; a change through ``.data`` is not seen. Every other
saved tensor passes through unchanged (and through any saved-tensor hooks active outside, so memtrim's tracker still
sees them), with autograd's in-place check repeated. Under torch.compile and torch.func the module runs as torch's
BatchNorm and ReLU.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from ..guards import (
    OUTPUT_HOOKS,
    RELU,
    WatchedFusion,
    capturing,
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
             cudnn: bool, saved: tuple[torch.Tensor, torch.Tensor, int, bool] | None = None) -> torch.Tensor:
    """The ReLU output: ``batch_norm`` as the forward called it, without updating running statistics. ``tensors``
    are the weight, bias and running statistics the forward had (``layout``: which of weight, bias and the pair of
    running statistics there are); ``saved``, a training forward's batch statistics, the kernel that computed them
    and whether it updated running statistics, with which the rebuild can normalise in one pass (NOTE [ the one-pass
    rebuild ])."""
    found = iter(tensors)
    weight, bias = (next(found) if layout[0] else None), (next(found) if layout[1] else None)
    mean, var = (next(found), next(found)) if layout[2] else (None, None)
    once = None if saved is None else _normalised_once(saved, x, weight, bias, eps, cudnn)
    if once is not None:
        return torch.relu_(once)
    return torch.relu_(torch.batch_norm(x, weight, bias, mean, var, training, 0.0, eps, cudnn))


# NOTE [ the one-pass rebuild ]
# In training, rebuilding z by torch's batch_norm computes the batch statistics again: a second pass over x, and on a
# GPU 8.5 % more kernel time in a converted ResNet's step at batch 128 (results/convert_cuda_check_cuda.txt). The
# forward computed them already: in training the converted forward calls ``torch._batch_norm_impl_index``, the op
# ``torch.batch_norm`` is made of (the same kernel, output and autograd node), which also returns the batch mean and
# inverse standard deviation its node saves (the same tensors: small, C values each) and which kernel ran. The recipe
# holds them, not the node (a node held from the recipe kept, through what the node's saved tensors were packed into,
# the tensor whose death ends the recipe: a leak). So the normalisation alone can rebuild z: on CUDA torch's
# ``batch_norm_elemt`` (the normalising kernel of its native and SyncBatchNorm paths), on the CPU the arithmetic of
# torch's CPU kernel, ``x * alpha + beta`` with ``alpha = invstd * weight`` and ``beta = bias - mean * alpha``, each
# rounded once as the kernel's fused multiply-adds round them. Whether that is the forward's z bit for bit depends on
# which kernel the forward ran: on an H200 (benchmarks/bn_rebuild_kernels.py) ``batch_norm_elemt`` matched torch's
# native CUDA kernel at every ResNet shape and cuDNN's at 112², 56² and 28² in float32, but not cuDNN's at 14² and 7²
# (45 % of the values differ); on this project's CPU machine the CPU formula matches in float32 and float64 for every
# shape and memory format tried where torch's CPU kernel takes its fast path (input contiguous or channels-last, weight,
# bias and running statistics contiguous; otherwise it computes ((x - mean) * invstd) * weight + bias), not in bfloat16
# or float16 (the kernel computes those in float32). So only those layouts qualify, on either device, and nothing else
# is assumed: the first rebuild for each (forward kernel, device, dtype, shape, strides, affine, cuDNN flag, running
# statistics updated) first compares the two on a probe, bit for bit: the forward's kernel and the one-pass rebuild run
# on tensors laid out as x, the weight and the bias, filled from a generator of their own (seeded, so the user's random
# numbers are untouched), each channel at its own scale from 1e-2 to 1e2 and x's around its own mean (a kernel that
# rounds its per-channel terms otherwise shows it there). The one-pass rebuild is used only where they were equal. A
# probe, not the batch: on the batch the comparison would be of data as well as arithmetic (found by an adversarial
# pass: a first batch of zeros, or zero gammas, make any two formulas give the bias exactly, and a kernel that rounds
# otherwise then passed). The cost of the probe, once per key and process: three z-sized tensors for a moment, before
# the rebuild, and 4-9 two-pass rebuilds' time (on the CPU, one thread, at resnet18's shapes at batch 8: 1.4-12 ms in
# float32, 2.1-30 ms in float64; benchmarks/bn_rebuild_kernels.py, whose probe verdicts matched the comparison on real
# data at every shape, dtype and layout); after _ONE_PASS_MAX_KEYS probes, new keys keep the two-pass rebuild, and so
# does a key whose probe failed (no memory for its tensors on a GPU at its limit, no one-pass kernel for those dtypes).
# None is made while a CUDA graph is being captured (the comparison waits for the GPU). On the CPU, below
# _ONE_PASS_CPU_MIN values the one-pass rebuild's three small kernels cost more than torch's one: one thread, float32
# and float64, 0.5-0.7x as fast at 288 and 1,024 values, 1.0-1.2x at 8,192, 1.4x at 12,800 and 1.6-2.8x at resnet18's
# shapes at batch 8 (benchmarks/bn_rebuild_kernels.py, results/bn_rebuild_kernels_cpu.json, 2026-11-30, commit f8d90c0;
# two earlier runs that day on the same machine gave 0.4-0.8x and 0.6-0.7x, 0.9-1.3x, 1.0-1.5x and 1.4-2.5x).
ONE_PASS = True  # (tests and benchmarks switch it off to compare)
_ONE_PASS_CPU_MIN = 8192
_ONE_PASS_MAX_KEYS = 1024  # probes made at most, per process: new shapes after that keep the two-pass rebuild
_ONE_PASS_EQUAL: dict[tuple, bool] = {}  # the comparison's result per key; read and written without a lock: a race
# only compares twice


def _normalised_once(saved: tuple[torch.Tensor, torch.Tensor, int, bool], x: torch.Tensor,
                     weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float,
                     cudnn: bool) -> torch.Tensor | None:
    """batch_norm's output before the ReLU, normalised in one pass with the forward's batch statistics (``saved``:
    mean, inverse standard deviation, which kernel, whether it updated running statistics) where that is known to be
    the forward's bit for bit; None where it is not, or not known."""
    device = x.device.type
    # (a tensor subclass, the planner's fake tensors among them, has no values to compare)
    if not ONE_PASS or type(x) is not torch.Tensor or device not in ("cpu", "cuda") or (device == "cpu" and (
            x.numel() < _ONE_PASS_CPU_MIN or x.dtype not in (torch.float32, torch.float64))):
        return None
    mean, invstd, kernel, running = saved
    if not (mean.dim() == invstd.dim() == 1 and mean.numel() == invstd.numel() == x.shape[1]):
        return None  # (a kernel that returns them otherwise: miopen's, or another torch's)
    if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
            or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))) or not all(
            t is None or t.is_contiguous() for t in (weight, bias)):
        return None
    key = (kernel, x.device, x.dtype, x.shape, x.stride(), weight is None, bias is None, cudnn, running)
    equal = _ONE_PASS_EQUAL.get(key)
    if equal is None:
        if len(_ONE_PASS_EQUAL) >= _ONE_PASS_MAX_KEYS or capturing(x):
            return None  # (a probe per new shape of a workload whose shapes never stop changing; a CUDA graph being
            # captured, where the comparison's wait for the GPU is an error)
        equal = _ONE_PASS_EQUAL[key] = _same_bits(x, weight, bias, kernel, running, eps, cudnn)
    return _one_pass(x, weight, bias, mean, invstd, eps) if equal else None


def _same_bits(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, kernel: int, running: bool,
               eps: float, cudnn: bool) -> bool:
    """Whether the one-pass rebuild gives the forward's output bit for bit for tensors laid out as these, on a probe
    (NOTE [ the one-pass rebuild ]); ``running``: the forward updated running statistics (scratch ones here)."""
    generator = torch.Generator(device=x.device)
    generator.manual_seed(0)
    channels = x.shape[1]

    def magnitudes() -> torch.Tensor:  # per channel, from 1e-2 to 1e2, either sign
        u = torch.rand(2, channels, generator=generator, device=x.device, dtype=x.dtype)
        return (10.0 ** (4 * u[0] - 2)) * torch.where(u[1] < 0.5, -1.0, 1.0)

    def probe(t: torch.Tensor, offset: bool = False) -> torch.Tensor:
        # laid out as t, each channel at its own scale (and, for x, around its own mean): a kernel that rounds its
        # per-channel terms otherwise differs there where values near 0 and 1 would not show it
        found = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).uniform_(-1, 1,
                                                                                                  generator=generator)
        shape = [1, channels] + [1] * (t.dim() - 2) if t.dim() > 1 else [channels]
        found.mul_(magnitudes().abs().view(shape))
        return found.add_(magnitudes().view(shape)) if offset else found

    # a probe that fails keeps the two-pass rebuild instead of failing the backward: no one-pass kernel for these
    # dtypes or this layout on this device, or no memory for the probe's three tensors (a GPU at its limit)
    try:
        xp = probe(x, offset=True)
        wp, bp = None if weight is None else probe(weight), None if bias is None else probe(bias)
        # (the running statistics have x's dtype: a BatchNorm of another dtype than its input runs as torch's)
        zeros, ones = ((torch.zeros(x.shape[1], dtype=x.dtype, device=x.device),
                        torch.ones(x.shape[1], dtype=x.dtype, device=x.device)) if running else (None, None))
        out, mean, invstd, _, used = torch._batch_norm_impl_index(xp, wp, bp, zeros, ones, True, 0.0, eps, cudnn)
        return used == kernel and torch.equal(out, _one_pass(xp, wp, bp, mean, invstd, eps))
    except (RuntimeError, NotImplementedError):  # (torch.OutOfMemoryError is a RuntimeError)
        return False


def _one_pass(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
              invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) * invstd * weight + bias, in one pass over ``x``, as the device's batch_norm kernel computes it
    (NOTE [ the one-pass rebuild ])."""
    if x.device.type == "cuda":
        return torch.batch_norm_elemt(x, weight, bias, mean, invstd, eps)
    alpha = invstd if weight is None else invstd * weight
    beta = torch.addcmul(torch.zeros_like(mean) if bias is None else bias, mean, alpha, value=-1)
    shape = [1, -1] + [1] * (x.dim() - 2)
    return torch.addcmul(beta.view(shape), x, alpha.view(shape))


def rebuilds_bitwise(bn: nn.Module) -> bool:
    """Whether ``bn``'s rebuilt output is known to be its forward's bit for bit where its tensors are: on the CPU
    (tested); on CUDA only some kernel paths were checked (NOTE [ BatchNorm + ReLU, recomputed ])."""
    return all(t.device.type == "cpu" for t in (*bn.parameters(recurse=False), *bn.buffers(recurse=False)))


_FUNCTION_MODE = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: False)


def _copy_as(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (``clone`` makes a strided 1-D tensor contiguous)."""
    return t.clone() if t.is_contiguous() else torch.empty_strided(t.size(), t.stride(), dtype=t.dtype,
                                                                   device=t.device).copy_(t)


def _batchnorm_relu(bn: _BatchNormReLU, x: torch.Tensor) -> torch.Tensor:
    """torch's own BatchNorm and an in-place ReLU whose output is kept as a recipe. Autograd's nodes are the native
    ones: no Python in backward but the unpacking. This runs at every call of every converted BatchNorm: its
    parameters are read from their dict once (``bn.weight`` is nn.Module.__getattr__'s slow path)."""
    factor, bn_training, running_mean, running_var = batchnorm_arguments(bn, x)
    params, cudnn = bn._parameters, torch.backends.cudnn.enabled
    # a weight that pruning or a parametrization computes is no entry of the dict: read as torch's forward reads it
    weight = params["weight"] if "weight" in params else bn.weight
    bias = params["bias"] if "bias" in params else bn.bias
    running = running_mean is not None and running_var is not None
    # (torch's CPU kernel normalises by another formula where the running statistics are not contiguous, also in
    # training, where it updates them: found by an adversarial pass, 2.2e-8 off)
    strided = bn_training and running_mean is not None and running_var is not None and not (
        running_mean.is_contiguous() and running_var.is_contiguous())
    saved = None
    # torch.batch_norm's own op, which returns the batch statistics too (NOTE [ the one-pass rebuild ]); under a user's
    # TorchFunctionMode torch.batch_norm itself, the op such a mode sees (found by an adversarial pass)
    if bn_training and not _FUNCTION_MODE():
        out, mean, invstd, _, kernel = torch._batch_norm_impl_index(x, weight, bias, running_mean, running_var, True,
                                                                    factor, bn.eps, cudnn)
        saved = None if strided else (mean, invstd, kernel, running)
    else:
        out = torch.batch_norm(x, weight, bias, running_mean, running_var, bn_training, factor, bn.eps, cudnn)
    # what the rebuild reads: the parameters, and in eval the running statistics (in training the batch's), copied:
    # a training forward of the same module before the backward updates them in place without a version bump; copied
    # with their strides (7.5e-9 off with contiguous copies of strided ones in eval), and so in training where they
    # are strided, for the kernel's formula only (updated with momentum 0 by the rebuild, which normalises with the
    # batch's statistics)
    stats = ([_copy_as(running_mean), _copy_as(running_var)]
             if running_mean is not None and running_var is not None and (not bn_training or strided) else [])
    tensors = [t for t in (weight, bias) if t is not None] + stats
    rebuild = functools.partial(_rebuild, layout=(weight is not None, bias is not None, bool(stats)),
                                training=bn_training, eps=bn.eps, cudnn=cudnn, saved=saved)
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
    """``nn.BatchNorm`` + ReLU keeping only the BatchNorm's input. See NOTE [ BatchNorm + ReLU, recomputed ].

    It saves memory only where :func:`memtrim.convert` puts it: the layers after it then rebuild its output from that
    input instead of keeping it. Used by hand before torch's layers (a convolution keeps the ReLU's output), it keeps
    what torch's BatchNorm and ReLU keep, no less (an adversarial pass measured 524,416 B for both)."""


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
    """``target`` (a BatchNormReLU or BatchNormAct class) that is still a ``base`` (timm's ``BatchNormAct2d``, which
    holds its activation as ``act``) to ``isinstance``: tools that rebuild such modules by class (timm's
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
    from .norm_act import BatchNormAct1d, BatchNormAct2d, BatchNormAct3d

    for target in (BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d, BatchNormAct1d, BatchNormAct2d, BatchNormAct3d):
        for where, base_name in KNOWN_BATCHNORM_ACT:
            if name == _keeping_name(target.__name__, base_name):
                return keeping_class(target, getattr(importlib.import_module(where), base_name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The values of a fake trace's small tensors, computed for real beside it, so that model code reading a value takes
the branch the real run takes.

NOTE [ known values ]
A fake tensor has no data: ``bool(t)`` or ``t.item()`` on one raises, and libraries that must not read values under
tracing ask "is this tensor fake?" and take a tracing branch instead. HF transformers does: ``is_tracing(tensor)``
is true for a ``FakeTensor``, so ``find_packed_sequence_indices`` cannot see that ``position_ids`` hold one
sequence and keeps a packed-sequence mask, ``create_causal_mask`` then builds the 4-D mask that the real run skips
(it relies on SDPA's ``is_causal``), and SDPA saves a float copy of that mask per layer for backward: an HF Llama
was over-predicted by exactly those copies (1,048,576 B of 95,765,924 B in ``benchmarks/plan_accuracy.py``).

:class:`KnownValues` sits just above ``FakeTensorMode`` and gives a fake tensor a value wherever one can be
computed without the weights' data: the example batch and a copied model's buffers and vector parameters (given by
the caller), the outputs of ops with no tensor argument (``arange``, ``ones``...), and the outputs of every op whose
tensor arguments all have values. The op runs for real on those values (on the CPU whatever the fake device, Python
dispatch and autocast off), after the fake op, and only when each output's storage is at most ``LIMIT`` bytes: a
trace allocates position ids and masks, never a tensor the size of a weight matrix or an activation. An op that
draws random numbers gives no value (running it would also move the caller's generator). An op that writes an
argument with something it cannot compute (another argument has no value) makes that argument's value stale, with
every view of it (they share the value's storage), but for a *pinned* value: a copied model's vector parameters
(norm weights and biases) keep their values as given through the optimizer's gradient steps. Such a value has then
*drifted* from the real run's, and so has every value computed from it: an op whose output shape depends on values
(``nonzero``: memtrim's converted norms choosing per feature which keep their input, NOTE [ when a norm keeps its
input ]) still gets fake outputs of the shapes its values give, counted in ``approximate_decisions`` (the plan's
notes say the step may decide a feature near the bound differently), but a scalar read (``bool``, ``item``: the
model's own branch) of a drifted value raises as a fake tensor does: a branch is never guessed. An op that fails on
the values leaves its outputs without one.

An op that returns no tensor (``aten._local_scalar_dense``, behind ``bool`` and ``item``) is answered from the
values when all its tensor arguments have one; otherwise it goes to ``FakeTensorMode``, which raises as before.
No fake tensor is weakly referenced: ``Module._apply`` swaps a fake parameter for its moved or cast copy (a factory
``lambda: Model().cuda()`` or ``.to(torch.bfloat16)``), and ``torch.utils.swap_tensors`` refuses a tensor that is. So
a value lives on its fake tensor (an attribute naming the :class:`KnownValues` that computed it), and each op's fake
outputs are taken out of the fake mode's memo of converted tensors, which holds them weakly (``FakeTensorMode`` puts
an op's output there when its dispatch cache misses; nothing looks an output up there again: the memo is keyed by the
meta tensor the output was made from, which is dead by then).
:func:`reading_values` then makes transformers' ``is_fake_tensor`` (the test inside its ``is_tracing``) false for a
fake tensor with a value, only while a trace runs: transformers reads the value and takes the eager branch.
"""

from __future__ import annotations

import contextlib
import math
import sys
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

LIMIT = 16 * 2**20
"""The largest storage, in bytes, whose value a trace computes."""

_VALUE = "_memtrim_known_value"  # the attribute of a fake tensor that holds its _Known


class _Known:
    """A fake tensor's value and the :class:`KnownValues` that computed it."""

    __slots__ = ("owner", "value")

    def __init__(self, owner: KnownValues, value: torch.Tensor) -> None:
        self.owner, self.value = owner, value


def _small(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() <= LIMIT


_OPS: dict[Any, tuple[bool, bool, bool]] = {}  # op -> (deterministic, returns no tensor, writes an argument)


def _forget_memo(fakes: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """Take ``fakes``, an op's outputs, out of their fake mode's memo of converted tensors (NOTE [ known values ]):
    the newest entries, where the op's cache miss has just put them. An output that is one of the op's ``inputs``
    (an in-place op returns its argument) is no new entry: a real tensor's conversion stays memoised."""
    if not fakes or not isinstance(fakes[0], torch._subclasses.FakeTensor):
        return
    memo = getattr(fakes[0].fake_mode.fake_tensor_converter, "tensor_memo", None)
    entries = getattr(memo, "data", None) if isinstance(memo, weakref.WeakValueDictionary) else None
    ids = {id(t) for t in fakes} - {id(t) for t in inputs}
    while entries and ids:
        newest = next(reversed(entries))
        if id(entries[newest]()) not in ids:
            return
        del entries[newest]


_SAME_DTYPE: dict[Any, tuple[int, int]] = {  # op -> the two arguments whose dtypes its real kernels require equal
    torch.ops.aten.mm.default: (0, 1), torch.ops.aten.addmm.default: (1, 2), torch.ops.aten.bmm.default: (0, 1),
    torch.ops.aten.baddbmm.default: (1, 2), torch.ops.aten.convolution.default: (0, 1),
    # (a float32 target for a bfloat16 output under autocast: "Found dtype Float but expected BFloat16"; planned until
    # 2026-12-03, an adversarial pass)
    torch.ops.aten.binary_cross_entropy.default: (0, 1),
}


def _refuse_mixed_dtypes(func: Any, args: tuple[Any, ...], pair: tuple[int, int]) -> None:
    """Raise as the real kernels do where a matmul's or convolution's two operands differ in dtype: torch's fake
    kernels do not check, and a float64 batch (``torch.from_numpy``) into a float32 model got plans for a step that
    fails when run (found by an adversarial pass)."""
    a, b = (args[i] if i < len(args) else None for i in pair)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype != b.dtype:
        raise RuntimeError(
            f"{func} got operands of two dtypes, {a.dtype} and {b.dtype}, which its real kernels refuse (torch's "
            "fake kernel does not check). Expected the example inputs in the model's dtype, and a loss's target in "
            "its output's: cast them (x.float(), x.to(model's dtype), target.to(output.dtype)), or pass integer "
            "token ids to an embedding, not to a Linear."
        )


def _refuse_norm_dtypes(func: Any, args: tuple[Any, ...]) -> None:
    """Raise as the CPU kernels do where a norm's parameters and running statistics are not all of one dtype, or
    that dtype is neither the input's nor float32 under a bfloat16 or float16 input: the fake kernels do not check,
    and a BatchNorm with bfloat16 parameters and float32 running statistics got plans for a step that fails when
    run (checked against the CPU kernels over every combination of four dtypes; found by an adversarial pass)."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or x.device.type not in ("cpu", "meta"):
        return
    dtypes = {a.dtype for a in args[_NORM_PARAMETERS[func]] if isinstance(a, torch.Tensor)}
    low = x.dtype in (torch.bfloat16, torch.float16)
    if not dtypes or dtypes == {x.dtype} or (low and dtypes == {torch.float32}):
        return
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
    raise RuntimeError(
        f"{func} got a {str(x.dtype).removeprefix('torch.')} input with parameters or running statistics in "
        f"{names}, which its CPU kernels refuse (torch's fake kernel does not check): a norm's weight, bias and "
        "running statistics take one dtype, the input's or float32. Cast the norm as a whole (module.float(), "
        "module.to(dtype)), not its parameters or buffers alone."
    )


def _op_facts(func: Any) -> tuple[bool, bool, bool]:
    if not isinstance(func, torch._ops.OpOverload):  # a higher-order op: no value, and no write it can see
        facts = (False, False, False)
    else:
        schema = func._schema
        facts = (torch.Tag.nondeterministic_seeded not in func.tags,
                 not any("Tensor" in str(r.type) for r in schema.returns), schema.is_mutable)
    _OPS[func] = facts
    return facts


# NOTE [ storages of CPU kernels ]: some CPU kernels return a tensor whose storage is larger than its shape, which
# their fake kernels do not: the real step holds the difference while the tensor lives. The trace gives such fake
# outputs the real storage (a meta trace of a CPU step too). Found by adversarial passes on 2026-12-03, with torch
# 2.13's CPU kernels (an op-by-op sweep of OpInfo's samples and the losses, norms, attention, convolutions and pooling
# used in training, real against fake):
# - mse_loss, smooth_l1_loss, binary_cross_entropy and soft_margin_loss compute the unreduced loss into their output
#   and reduce it in place: the 0-d loss keeps a storage the size of the input (16,384 B for a (512, 8) float32
#   input; a plan with F.mse_loss was that much below the measured peak; l1_loss, huber_loss, cross_entropy and the
#   other losses return 4 B);
# - col2im (F.fold, and F.unfold's backward) returns its output in a storage the size of its input's columns
#   (1,179,648 B for an (8, 16, 16, 16) float32 output of 131,072 B);
# - native_batch_norm, native_layer_norm and native_group_norm on a bfloat16 or float16 input with float32 parameters
#   (CPU autocast before a BatchNorm or GroupNorm, or norms kept in float32) save their mean and inverse deviation in
#   float32, the fake kernels in the input's dtype (2 x 2 B per channel and layer low for a BatchNorm); and
#   native_group_norm_backward returns its input's gradient in the input's dtype, the fake kernel in float32 (a
#   plan with GroupNorms under autocast was up to 130,880 B high; an adversarial pass).
# (Not modelled: the oneDNN LSTM's workspace and EmbeddingBag's offsets, which the plan's notes name.)
def _unreduced(args: tuple[Any, ...], kwargs: dict[str, Any], func: Any) -> torch.Size | None:
    position = [a.name for a in func._schema.arguments].index("reduction")
    if kwargs.get("reduction", args[position] if position < len(args) else 1) == 0:  # none: the loss itself
        return None
    return torch.broadcast_shapes(args[0].shape, args[1].shape)


_LARGER_STORAGE: dict[Any, Callable[[tuple[Any, ...], dict[str, Any], Any], torch.Size | None]] = {
    **{op: _unreduced for op in (torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                                 torch.ops.aten.binary_cross_entropy.default, torch.ops.aten.soft_margin_loss.default)},
    torch.ops.aten.col2im.default: lambda args, kwargs, func: args[0].shape,
}
"""Op -> the shape whose storage its CPU kernel's output keeps (None: its own), NOTE [ storages of CPU kernels ]."""


_NORM_PARAMETERS = {torch.ops.aten.native_batch_norm.default: slice(1, 5),
                    torch.ops.aten.native_layer_norm.default: slice(2, 4),
                    torch.ops.aten.native_group_norm.default: slice(1, 3)}
"""A norm op -> where its weight, bias (and running statistics) lie in its arguments."""


def _norm_dtypes(func: Any, args: tuple[Any, ...], out: Any) -> Any:
    """A norm's saved statistics in its parameters' dtype, and GroupNorm's input gradient in its input's, as the CPU
    kernels return them (NOTE [ storages of CPU kernels ])."""
    if out[0] is None or out[0].device.type not in ("cpu", "meta"):
        return out
    if func is torch.ops.aten.native_group_norm_backward.default:
        grad = out[0]
        if grad.dtype == args[1].dtype:
            return out
        return (torch.empty_like(grad, dtype=args[1].dtype), *out[1:])
    params = next((a for a in args[_NORM_PARAMETERS[func]] if isinstance(a, torch.Tensor)), None)
    low = out[0].dtype in (torch.bfloat16, torch.float16)
    if params is None or not low or out[1].dtype == params.dtype:
        return out
    return (out[0], *(torch.empty_like(t, dtype=params.dtype) for t in out[1:3]))


def _as_cpu_kernel(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
    """``out`` with the storage the CPU kernel gives it (NOTE [ storages of CPU kernels ])."""
    if func in _NORM_PARAMETERS or func is torch.ops.aten.native_group_norm_backward.default:
        return _norm_dtypes(func, args, out)
    storage = _LARGER_STORAGE.get(func)
    if storage is None or not isinstance(out, torch.Tensor) or out.device.type not in ("cpu", "meta"):
        return out
    shape = storage(args, kwargs, func)
    if shape is None or math.prod(shape) <= out.numel():
        return out
    return torch.empty(shape, dtype=out.dtype, device=out.device).resize_(out.shape)


class KnownValues(TorchDispatchMode):
    """Tracks values of fake tensors; see NOTE [ known values ]. Enter it inside ``FakeTensorMode``."""

    def __init__(self) -> None:
        super().__init__()
        self._stale: set[StorageWeakRef] = set()  # value storages an op overwrote with what it could not compute
        self._pinned: set[StorageWeakRef] = set()  # value storages that writes without a value leave as they are
        # pinned values such a write has been to, and every value computed from them: read by a shape decision only
        self._drifted: set[StorageWeakRef] = set()
        self.approximate_decisions = 0  # shapes decided from drifted values (NOTE [ known values ])

    def add(self, fake: torch.Tensor, real: torch.Tensor, *, pinned: bool = False) -> None:
        """Give ``fake`` the value of ``real`` (copied), when it is small enough. ``pinned``: an op that writes
        ``fake`` with something it cannot compute leaves the value as it was instead of dropping it (a parameter's
        value as given, through the optimizer's steps: NOTE [ known values ])."""
        if _small(real) and not real.is_meta and not isinstance(real, torch._subclasses.FakeTensor):  # no data
            value = real.detach().to("cpu", copy=True)
            setattr(fake, _VALUE, _Known(self, value))
            if pinned:
                self._pinned.add(StorageWeakRef(value.untyped_storage()))

    def value(self, t: torch.Tensor) -> torch.Tensor | None:
        """The value of ``t``: itself when it is a plain real tensor, None for a fake tensor whose value is not known
        or a tensor subclass."""
        if type(t) is torch.Tensor:
            return t
        known = getattr(t, _VALUE, None) if isinstance(t, torch._subclasses.FakeTensor) else None
        v = known.value if known is not None and known.owner is self else None
        if v is None or (self._stale and StorageWeakRef(v.untyped_storage()) in self._stale):
            return None
        return v

    def _run(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        def cpu(key: str, value: Any) -> Any:
            return torch.device("cpu") if key == "device" else False if key == "pin_memory" else value

        args, kwargs = tree_map_only(torch.Tensor, self.value, (args, kwargs))
        with no_dispatch(), torch.autocast("cpu", enabled=False):
            return func(*args, **{k: cpu(k, v) for k, v in kwargs.items()})

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        pair = _SAME_DTYPE.get(func)
        if pair is not None:
            _refuse_mixed_dtypes(func, args, pair)
        elif func in _NORM_PARAMETERS:
            _refuse_norm_dtypes(func, args)
        deterministic, scalar, mutable = _OPS.get(func) or _op_facts(func)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        knowable = deterministic and all(self.value(t) is not None for t in tensors)
        drifted = knowable and self._drifted_in(tensors)
        try:
            out = _as_cpu_kernel(func, args, kwargs, func(*args, **kwargs))
        except DataDependentOutputException:
            if knowable and scalar and tensors and not drifted:  # a drifted value is never a branch's answer
                with contextlib.suppress(Exception):
                    return self._run(func, args, kwargs)  # a scalar read from the values, as the real run reads it
            raise
        except DynamicOutputShapeException:  # nonzero and the like: the shape the values give
            if not (knowable and tensors):
                raise
            self.approximate_decisions += drifted
            return self._shaped_by_values(func, args, kwargs, tensors[0].device, drifted)
        fakes = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        _forget_memo(fakes, tensors)
        if knowable and (fakes or mutable) and all(_small(t) for t in fakes):
            try:
                reals = [t for t in tree_leaves(self._run(func, args, kwargs)) if isinstance(t, torch.Tensor)]
            except Exception:
                reals = []
            if len(reals) == len(fakes) and all(r.shape == f.shape for r, f in zip(reals, fakes)):
                for fake, real in zip(fakes, reals):
                    self._keep(fake, real, drifted)
                return out
        if mutable:
            self._written(func, args, kwargs)
        return out

    def _keep(self, fake: torch.Tensor, real: torch.Tensor, drifted: bool) -> None:
        setattr(fake, _VALUE, _Known(self, real))
        if drifted:
            self._drifted.add(StorageWeakRef(real.untyped_storage()))

    def _drifted_in(self, tensors: list[torch.Tensor]) -> bool:
        if not self._drifted:
            return False
        values = [self.value(t) for t in tensors]
        return any(v is not None and StorageWeakRef(v.untyped_storage()) in self._drifted for v in values)

    def _shaped_by_values(self, func: Any, args: Any, kwargs: dict[str, Any], device: torch.device,
                          drifted: bool) -> Any:
        """An op whose output shape depends on its arguments' values, run on the values: fake outputs of the real
        outputs' shapes (made by the fake mode below), each with its value."""
        real = self._run(func, args, kwargs)

        def fake(r: torch.Tensor) -> torch.Tensor:
            t = torch.empty_strided(r.shape, r.stride(), dtype=r.dtype, device=device)
            self._keep(t, r, drifted)
            return t

        return tree_map_only(torch.Tensor, fake, real)

    def _written(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Make stale the values of the arguments ``func`` wrote without a value computed for them."""
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            given = kwargs.get(argument.name) if argument.kwarg_only or i >= len(args) else args[i]
            for t in tree_leaves(given):
                v = self.value(t) if isinstance(t, torch._subclasses.FakeTensor) else None
                if v is not None:
                    key = StorageWeakRef(v.untyped_storage())
                    (self._drifted if key in self._pinned else self._stale).add(key)


@contextlib.contextmanager
def reading_values(values: KnownValues) -> Iterator[None]:
    """While inside, transformers (when imported) reads a fake tensor that has a value instead of treating it as
    tracing; see NOTE [ known values ]. Restored on exit; nothing happens without transformers."""
    module = sys.modules.get("transformers.utils.import_utils")
    original = getattr(module, "is_fake_tensor", None)
    if original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and values.value(x) is None

    module.is_fake_tensor = is_fake_tensor  # type: ignore[union-attr]
    try:
        yield
    finally:
        module.is_fake_tensor = original  # type: ignore[union-attr]

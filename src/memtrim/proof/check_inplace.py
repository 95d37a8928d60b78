"""``check_inplace``: check twice, by machine, that hand-written in-place code computes what it should.

NOTE [ what check_inplace checks ]
The seed's ``input * torch.sigmoid_(input)`` returns sigmoid(x)^2 and still passes ``gradcheck`` (the gradient
is right for the wrong function). Only a comparison with an out-of-place reference catches it, so each trial:

1. draws fresh random inputs (the examples give shapes and dtypes; float64 is added, unless the reference raises
   on it: it may close over float32 weights; a note says so),
2. runs ``fn`` and ``reference`` on separate non-leaf copies, from the same state of the global generators (an
   in-place dropout draws the reference's mask), and compares the outputs (shape, dtype, values: the values are
   compared in float64, where another dtype could pass),
3. back-propagates the same random output gradient through both and compares the gradients of every input and
   of every tensor requiring grad that either output depends on (found in its autograd graph, so a weight that a
   closure or a global reaches counts too): the modules' parameters paired by name, else by position and shape,
   any other tensor with itself (both use it; one output alone depending on it is a problem); where each output
   depends on tensors the other's does not and nothing pairs them, the call is refused,
4. records, with a dispatch mode, every storage an op writes in place: ``fn`` may write into storages it
   created and into an input it returns (that is what in place means); writing into an input it does not
   return, or into anything else (a parameter, a global), corrupts the caller's tensors,
5. feeds ``fn`` the output of ``torch.sigmoid`` and of ``torch.exp`` (both keep their output for backward):
   ``fn`` must then give the right gradient or raise autograd's in-place error, never a silently wrong one.

Memory comes from the tracker on the examples: bytes autograd keeps for backward after the call, and the
peak of new storages during it.

When fn's backward fails because a tensor saved for backward was changed in place (autograd's version-counter
error), fn is run once more under :class:`_SaveTracer` to say which op kept the tensor and which in-place op
overwrote it: a ``TorchFunctionMode`` names each torch call fn makes (``torch.sigmoid_``, ``x *= y`` as
``mul_``); autograd packs a saved tensor *during* the call that saves it (before the kernel for an input, after
it for an output), so the call in progress when the pack hook runs is the one that keeps the tensor; a call that
bumps an argument's version counter wrote into it. A saved tensor whose version moved after it was packed names
both. Function level rather than dispatch level because the names are the ones the user wrote.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import InplaceCheckError, InvalidInputError
from ..measure import format_bytes, track
from ..measure.hooks import tensors_in
from .compare import bitwise_equal, compare_tensors

__all__ = ["InplaceCheck", "InplaceCheckError", "check_inplace"]

_DEFAULT_TOLERANCE = {  # (rtol, atol): a rewrite may reorder floating-point operations
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (1e-3, 1e-5),
}


@dataclass(frozen=True)
class InplaceCheck:
    """The outcome of :func:`check_inplace`.

    ``ok`` is True when no trial found a problem; ``problems`` holds one sentence per mismatch, naming the
    trial and the max error. Memory figures are from the tracker on the example inputs; ``activation_bytes``
    and ``peak_bytes`` are None when fn raised on them (not measured).
    """

    ok: bool
    problems: list[str]
    trials: int
    mutates_input: bool
    activation_bytes: int | None
    reference_activation_bytes: int
    peak_bytes: int | None
    reference_peak_bytes: int
    verdict: str
    notes: list[str] = field(default_factory=list)

    def assert_ok(self) -> None:
        """Raise :class:`InplaceCheckError` listing the problems (and the notes) unless ``ok``."""
        if not self.ok:
            raise InplaceCheckError("memtrim.check_inplace found problems:\n- " + "\n- ".join(self.problems)
                                    + "".join(f"\nnote: {n}" for n in self.notes))

    def __str__(self) -> str:
        head = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        lines = [f"check_inplace: {head} over {self.trials} trials; {self.verdict}"]
        lines += [f"  problem: {p}" for p in self.problems]
        lines += [f"  note: {n}" for n in self.notes]
        def show(value: int | None) -> str:
            return "not measured" if value is None else f"{value:,} B"

        lines.append(
            f"  kept for backward: {show(self.activation_bytes)} (reference {self.reference_activation_bytes:,} B); "
            f"peak of new storages: {show(self.peak_bytes)} (reference {self.reference_peak_bytes:,} B)"
        )
        return "\n".join(lines)


def check_inplace(
    fn: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    *example_inputs: torch.Tensor,
    draws: int = 3,
    dtypes: Sequence[torch.dtype] | None = None,
    shapes: Sequence[Sequence[tuple[int, ...]]] | None = None,
    inplace: bool | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> InplaceCheck:
    """Check that ``fn`` (typically an in-place rewrite) computes exactly what ``reference`` computes.

    Args:
        fn: the function or module under test, called as ``fn(*inputs)``; returns one tensor.
        reference: a trusted out-of-place implementation with the same signature.
        example_inputs: floating-point tensors giving the shapes and dtypes of the inputs.
        draws: random draws per (shape, dtype).
        dtypes: dtypes to try (default: the examples' dtypes, plus float64 unless fn or reference is a module with
            parameters, whose dtype is fixed).
        shapes: extra input shapes to try, one tuple of shapes per set of inputs.
        inplace: what ``fn`` claims: True, it returns its first input's storage; False, it never writes into
            its inputs; None (default), either, as long as an input it writes into is the one it returns.
        rtol, atol: tolerance (default per dtype: float64 1e-10, float32 1e-5, float16 1e-3, bfloat16 1.6e-2; a
            rewrite may reorder ops). One given alone is used with the other's default. A fn computed in half
            precision that passes the float64 trials gets a note on how to judge and accept its rounding.
        seed: seeds the draws.

    Returns:
        An :class:`InplaceCheck`; call ``.assert_ok()`` to fail loudly. ``fn`` raising (in forward or backward)
        is one of its problems, not an error of this call.

    Raises:
        InvalidInputError: an argument of the wrong kind (a non-callable fn or reference, no example inputs,
            non-tensor or non-floating inputs, draws not a positive int, ...), a reference that fails or
            returns no tensor on the examples (nothing to compare against), or fn and reference depending on
            different tensors that require grad which cannot be paired (their gradients would go unchecked).

    Example::

        def silu_inplace_1(x):           # the seed's: returns sigmoid(x)**2
            return x * torch.sigmoid_(x)
        memtrim.check_inplace(silu_inplace_1, torch.nn.functional.silu, torch.randn(64, 128)).ok   # False

    See NOTE [ what check_inplace checks ] in memtrim/proof/check_inplace.py.
    """
    # Over 60 lines for its docstring (Args, Returns, Raises, Example); the body is the trial loop, ~35 lines.
    _check_arguments(fn, reference, example_inputs, draws, dtypes, shapes, inplace, rtol, atol, seed)
    device = example_inputs[0].device
    base_shapes = [tuple(x.shape) for x in example_inputs]
    shape_sets = [base_shapes] + [[tuple(shape) for shape in s] for s in (shapes or [])]
    with _same_draws(device):  # the caller's stream untouched
        _check_reference(reference, example_inputs)
        notes: list[str] = []
        dtype_list = _dtypes_the_reference_runs(reference, example_inputs,
                                                _dtypes_to_try(fn, reference, example_inputs, dtypes), dtypes, notes)
        return _trials(fn, reference, example_inputs, device, shape_sets, dtype_list, draws, inplace, rtol, atol,
                       seed, notes)


def _trials(fn: Callable, reference: Callable, example_inputs: Sequence[torch.Tensor], device: torch.device,
            shape_sets: list[list[tuple[int, ...]]], dtype_list: list[torch.dtype], draws: int, inplace: bool | None,
            rtol: float | None, atol: float | None, seed: int, notes: list[str]) -> InplaceCheck:
    problems: list[str] = []
    mutated = False
    trials = 0
    generator = torch.Generator(device="cpu").manual_seed(seed)
    failed = dict.fromkeys(dtype_list, False)
    for shape_set in shape_sets:
        for dtype in dtype_list:
            tol = _tolerance(dtype, rtol, atol)
            for draw in range(draws):
                trials += 1
                where = f"trial {trials} (shapes {shape_set}, {dtype}, draw {draw + 1})"
                inputs = [torch.randn(s, generator=generator, dtype=torch.float64).to(device, dtype) for s in shape_set]
                found, wrote = _compare(fn, reference, inputs, tol, where, inplace, generator)
                problems += found
                mutated = mutated or wrote
                if found:
                    failed[dtype] = True
                    break  # the next draws of this dtype would repeat the same complaint
    notes += _half_rounding_notes(failed, rtol, atol)
    problems += _check_without_grad(fn, reference, example_inputs, _tolerance(example_inputs[0].dtype, rtol, atol))
    earlier_dtype = _earlier_dtype(fn, reference, example_inputs, dtype_list)
    problems += _check_saved_by_earlier_op(fn, reference, example_inputs, earlier_dtype,
                                           _tolerance(earlier_dtype, rtol, atol), generator)

    kept, peak, verdict, ref_kept, ref_peak = _memory_verdict(fn, reference, example_inputs, problems)
    return InplaceCheck(
        ok=not problems, problems=problems, trials=trials, mutates_input=mutated, activation_bytes=kept,
        reference_activation_bytes=ref_kept, peak_bytes=peak, reference_peak_bytes=ref_peak, verdict=verdict,
        notes=notes,
    )


def _check_arguments(fn: Any, reference: Any, example_inputs: Sequence[Any], draws: Any, dtypes: Any, shapes: Any,
                     inplace: Any, rtol: Any, atol: Any, seed: Any) -> None:
    """Every argument's kind, before anything runs (InvalidInputError naming what was expected and found)."""
    def fail(message: str) -> InvalidInputError:
        return InvalidInputError(f"memtrim.check_inplace: {message}")

    for name, value in (("fn", fn), ("reference", reference)):
        if not callable(value):
            raise fail(f"{name} must be callable (a function or a module), got {type(value).__name__}. Pass the "
                       "function itself, e.g. torch.nn.functional.silu, not its name or its result.")
    if not example_inputs:
        raise fail("give at least one example input, e.g. torch.randn(64, 128).")
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            raise fail(f"example input {i} is a {type(x).__name__}, not a tensor.")
        if not x.is_floating_point():
            raise fail(f"example input {i} has dtype {x.dtype}; in-place activations and their gradients need "
                       "floating-point inputs.")
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise fail(f"draws must be an int >= 1, got {draws!r}.")
    if dtypes is not None and (
        isinstance(dtypes, (str, torch.dtype)) or not isinstance(dtypes, Sequence)
        or not all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes)
    ):
        raise fail(f"dtypes must be floating-point torch.dtypes, e.g. [torch.float32, torch.float64], got {dtypes!r}.")
    if shapes is not None:
        if not isinstance(shapes, Sequence):
            raise fail(f"shapes must be a list with one tuple of shapes per set of inputs, got {shapes!r}.")
        for i, shape_set in enumerate(shapes):
            if not isinstance(shape_set, Sequence) or not all(
                isinstance(shape, Sequence) and all(isinstance(n, int) and n >= 0 for n in shape)
                for shape in shape_set
            ):
                raise fail(f"shapes[{i}] must be a sequence of shapes (one tuple of ints per input), got "
                           f"{shape_set!r}; e.g. shapes=[[(8, 16)]] for one input.")
            if len(shape_set) != len(example_inputs):
                raise fail(f"shapes[{i}] gives {len(shape_set)} shapes for {len(example_inputs)} input(s); give one "
                           "shape per example input.")
    if inplace is not None and not isinstance(inplace, bool):
        raise fail(f"inplace must be True, False or None, got {inplace!r}.")
    for name, value in (("rtol", rtol), ("atol", atol)):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                                  or not math.isfinite(value) or value < 0):
            raise fail(f"{name} must be a finite number >= 0 (or None for the dtype's default), got {value!r}.")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise fail(f"seed must be an int, got {seed!r}.")


def _dtypes_to_try(fn: Any, reference: Any, examples: Sequence[torch.Tensor],
                   dtypes: Sequence[torch.dtype] | None) -> list[torch.dtype]:
    """The caller's dtypes; else the examples', plus float64 unless parameters fix the dtype."""
    if dtypes:
        return list(dict.fromkeys(dtypes))
    if _params(fn) or _params(reference):
        return list(dict.fromkeys(x.dtype for x in examples))
    return list(dict.fromkeys([*(x.dtype for x in examples), torch.float64]))


def _dtypes_the_reference_runs(reference: Callable, examples: Sequence[torch.Tensor], dtype_list: list[torch.dtype],
                               asked: Sequence[torch.dtype] | None, notes: list[str]) -> list[torch.dtype]:
    """``dtype_list`` less the dtypes check_inplace added itself (float64) on which the reference raises (it closes
    over a float32 weight, say): a note says so. A dtype the caller asked for, on which it raises, is an
    InvalidInputError, as on the examples."""
    usable = []
    for dtype in dtype_list:
        if dtype in {x.dtype for x in examples}:
            usable.append(dtype)  # run by _check_reference already
            continue
        try:
            with torch.no_grad():
                reference(*[x.detach().to(dtype, copy=True) for x in examples])
        except Exception as e:
            if asked:
                raise InvalidInputError(
                    f"memtrim.check_inplace: the reference raised on {dtype} inputs ({type(e).__name__}: {e}); there "
                    f"is nothing to compare against there. Expected it to run on every dtype in dtypes; pass only "
                    "the dtypes it runs on."
                ) from e
            notes.append(f"{dtype} trials skipped: the reference raised on {dtype} inputs ({type(e).__name__}); it "
                         "may close over tensors of the examples' dtype. Pass dtypes= to choose.")
            continue
        usable.append(dtype)
    return usable


def _earlier_dtype(fn: Any, reference: Any, examples: Sequence[torch.Tensor], dtypes: list[torch.dtype]
                   ) -> torch.dtype:
    """The dtype of the check after an op that keeps its output: float64 where it is tried, else the examples'."""
    if torch.float64 in dtypes and not (_params(fn) or _params(reference)):
        return torch.float64
    return examples[0].dtype


def _check_reference(reference: Callable, examples: Sequence[torch.Tensor]) -> None:
    """The reference must return a tensor on the examples: otherwise there is nothing to compare against."""
    try:
        with torch.no_grad():
            ref_out = reference(*[x.detach().clone() for x in examples])
    except Exception as e:
        raise InvalidInputError(
            f"memtrim.check_inplace: the reference raised on the example inputs ({type(e).__name__}: {e}); "
            "there is nothing to compare against. Fix the reference or the examples."
        ) from e
    if not isinstance(ref_out, torch.Tensor):
        raise InvalidInputError(
            f"memtrim.check_inplace: the reference returned a {type(ref_out).__name__}, not a tensor, on the example "
            "inputs; it must return one tensor, like fn."
        )


def _memory_verdict(fn: Callable, reference: Callable, examples: Sequence[torch.Tensor], problems: list[str]
                    ) -> tuple[int | None, int | None, str, int, int]:
    """(kept, peak, verdict, reference kept, reference peak) on the examples; fn raising is one more problem."""
    kept: int | None
    peak: int | None
    try:
        kept, peak = _memory(fn, examples)
    except Exception as e:
        kept = peak = None
        problems.append(f"on the example inputs fn raised {type(e).__name__}: {e}")
    ref_kept, ref_peak = _memory(reference, examples)
    if kept is None or peak is None:
        return kept, peak, "memory not measured: fn raised on the example inputs", ref_kept, ref_peak
    return kept, peak, _verdict(kept, ref_kept, peak, ref_peak), ref_kept, ref_peak


def _half_rounding_notes(failed: dict[torch.dtype, bool], rtol: float | None, atol: float | None) -> list[str]:
    """A note for each half dtype whose trials failed where every float32/float64 trial passed: fn computes the
    right function, and what differs may be the rounding of fn's own half-precision arithmetic (torch's ops
    compute in float32 and round once). It stays a problem (fn is less accurate than the reference there); the
    note says how to tell and how to accept it."""
    wide = [d for d in failed if d in (torch.float32, torch.float64)]
    if not wide or any(failed[d] for d in wide):
        return []
    notes = []
    for dtype in (d for d in failed if failed[d] and d in (torch.float16, torch.bfloat16)):
        tol = _tolerance(dtype, rtol, atol)
        notes.append(
            f"fn passes every {' and '.join(map(str, wide))} trial but not the {dtype} ones: a difference in size "
            f"alone there may be the {dtype} rounding of fn's own arithmetic (torch's op computes in float32 and "
            "rounds once; a sum that cancels near 0, as in 1 + tanh(...), loses most digits), fn then being less "
            f"accurate than the reference in {dtype}, not another function. The tolerance was rtol {tol[0]:.1e}, "
            f"atol {tol[1]:.1e}; to accept that rounding pass atol= (the max abs error above), or compute in "
            "float32 inside fn.")
    return notes


def _tolerance(dtype: torch.dtype, rtol: float | None, atol: float | None) -> tuple[float, float]:
    """(rtol, atol): the caller's, each defaulting to the dtype's."""
    default = _DEFAULT_TOLERANCE.get(dtype, (1e-5, 1e-6))
    return (default[0] if rtol is None else rtol, default[1] if atol is None else atol)


def _verdict(kept: int, ref_kept: int, peak: int, ref_peak: int) -> str:
    if kept < ref_kept:
        return f"saves {ref_kept - kept:,} bytes of activations ({format_bytes(ref_kept - kept)})"
    if kept == ref_kept and peak < ref_peak:
        return f"saves only {ref_peak - peak:,} bytes of transient peak; it keeps the same activations"
    worse = []
    if kept > ref_kept:
        worse.append(f"keeps {kept - ref_kept:,} more bytes for backward")
    if peak > ref_peak:
        worse.append(f"peaks {peak - ref_peak:,} bytes higher")
    return "saves nothing" + (": it " + " and ".join(worse) if worse else "")


class _WriteRecorder(TorchDispatchMode):
    """Records the storages every op writes in place, and the storages ops create."""

    def __init__(self) -> None:
        super().__init__()
        self.written: list[tuple[str, torch.UntypedStorage]] = []
        self.created: list[torch.UntypedStorage] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {id(t.untyped_storage()) for t in tensors_in((args, kwargs))}
        out = func(*args, **kwargs)
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(argument.name)
                for t in tensors_in(value):
                    self.written.append((func.overloadpacket.__name__, t.untyped_storage()))
        for t in tensors_in(out):
            if id(t.untyped_storage()) not in seen:  # an in-place op returns its argument: not created here
                self.created.append(t.untyped_storage())
        return out

    def written_keys(self) -> set[int]:
        return {id(storage) for _, storage in self.written}


class _NotATensor(Exception):
    """fn returned something other than a tensor (a problem of fn, reported as such)."""


def _call(fn: Callable[..., Any], inputs: list[torch.Tensor], what: str) -> torch.Tensor:
    out = fn(*inputs)
    if not isinstance(out, torch.Tensor):
        if what == "fn":
            raise _NotATensor(f"fn returned a {type(out).__name__}, not a tensor.")
        raise InvalidInputError(f"memtrim.check_inplace: {what} returned a {type(out).__name__}, not a tensor.")
    return out


class _SaveTracer(TorchFunctionMode):
    """Names the torch call that keeps each saved tensor and the calls that write into tensors in place.

    See NOTE [ what check_inplace checks ]: a saved tensor is packed during the call that saves it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, set[int]]] = []  # (name, storages of its outputs), in call order
        self.current: int | None = None  # index of the call in progress
        self.writes: list[tuple[int, str, int]] = []  # (call index, name, storage) for each in-place write
        self.saved: list[tuple[int | None, torch.Tensor, int]] = []  # (saving call, tensor, its version then)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        name = _INPLACE_DUNDER.get(name, name)
        arguments = [t for t in tensors_in((args, kwargs))]
        versions = [t._version for t in arguments]
        index = len(self.calls)
        self.calls.append((name, set()))
        outer, self.current = self.current, index
        try:
            out = func(*args, **kwargs)
        finally:
            self.current = outer
        self.calls[index][1].update(_storage(t) for t in tensors_in(out))
        for t, version in zip(arguments, versions):
            if t._version != version:
                self.writes.append((index, name, _storage(t)))
        return out

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # detached: a saved output held as itself holds its own node, a cycle through C++ that gc cannot free (the
        # forward's graph then outlived every check that explained a backward error)
        detached = tensor.detach()
        self.saved.append((self.current, detached, tensor._version))
        return detached

    def explain(self) -> str | None:
        """'S keeps its output/input for backward, and W then overwrote it in place', for the first saved tensor
        whose version moved after it was saved; None if none did."""
        for call, tensor, version in self.saved:
            if tensor._version == version:
                continue
            storage = _storage(tensor)
            after = call if call is not None else -1
            writer = next((name for index, name, s in self.writes if s == storage and index > after), None)
            if call is None or writer is None:
                continue
            name, outputs = self.calls[call]
            role = "output" if storage in outputs else "input"
            return f"{name} keeps its {role} for backward, and {writer} then overwrote it in place"
        return None


_INPLACE_DUNDER = {"__iadd__": "add_", "__isub__": "sub_", "__imul__": "mul_", "__itruediv__": "div_",
                   "__ifloordiv__": "floor_divide_", "__ipow__": "pow_", "__imod__": "remainder_",
                   "__iand__": "bitwise_and_", "__ior__": "bitwise_or_", "__ixor__": "bitwise_xor_"}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _explain_backward_error(fn: Callable, inputs: list[torch.Tensor], error: Exception) -> str:
    """fn's backward raised: say why in memtrim's words (naming both ops for autograd's in-place error)."""
    text = f"{type(error).__name__}: {error}" if not isinstance(error, RuntimeError) else str(error)
    text = text.split(" Hint: enable anomaly detection")[0]  # memtrim names the ops itself
    if not (isinstance(error, RuntimeError) and "modified by an inplace operation" in str(error)):
        return f"fn's backward raised {text}"
    tracer = _SaveTracer()
    try:
        args = [x.clone().requires_grad_().clone() for x in inputs]
        with torch.autograd.graph.saved_tensors_hooks(tracer.pack, lambda t: t), tracer:
            fn(*args)
        explained = tracer.explain()
    except Exception:  # the explanation is a courtesy: never let it hide the problem itself
        explained = None
    if explained is None:
        return f"fn's backward fails: a tensor saved for backward was changed in place (torch: {text})"
    return (f"fn's backward fails: {explained}, so autograd cannot differentiate it (torch: {text}). Let the "
            "in-place op write into a tensor nothing keeps for backward (a copy), or use the out-of-place op.")


def _params(fn: Any) -> dict[str, torch.Tensor]:
    return dict(fn.named_parameters()) if isinstance(fn, torch.nn.Module) else {}


def _buffer_slots(fn: Any) -> list[tuple[str, dict[str, Any], str]]:
    """Each of a module's buffers as (its qualified name, the ``_buffers`` dict holding it, its key there), in
    ``named_buffers``' order (a buffer held under two names once, at its first)."""
    if not isinstance(fn, torch.nn.Module):
        return []
    seen: set[int] = set()
    found = []
    for prefix, m in fn.named_modules():
        for key, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                found.append((f"{prefix}.{key}" if prefix else key, m._buffers, key))
    return found


def _buffer_order(fn: Any, reference: Any) -> tuple[list[str], list[str]]:
    """Which of fn's buffers pairs with which of the reference's: by name where both hold the same names (in
    whatever order they were registered), else by position (fn and the reference may name them differently: a
    fused BatchNorm + ReLU against a Sequential of the two)."""
    names_fn = [name for name, _, _ in _buffer_slots(fn)]
    names_ref = [name for name, _, _ in _buffer_slots(reference)]
    if sorted(names_fn) == sorted(names_ref):
        return names_fn, names_fn
    return names_fn, names_ref


def _buffers(fn: Any, order: list[str]) -> dict[str, torch.Tensor]:
    """A module's buffers in ``order`` (from :func:`_buffer_order`), keyed by their position in it."""
    held = {name: slots[key] for name, slots, key in _buffer_slots(fn)}
    return {str(i): held[name] for i, name in enumerate(order) if name in held}


def _check_without_grad(fn: Callable, reference: Callable, examples: Sequence[torch.Tensor],
                        tol: tuple[float, float]) -> list[str]:
    """fn under ``torch.no_grad()`` on the examples, against the reference: the graded trials always ask for
    gradients, so a path of fn's own for inference, wrong only there, passed them (found by an adversarial pass)."""
    where = "without grad (torch.no_grad(), inputs that need no gradient)"
    args_ref = [x.detach().clone() for x in examples]
    args_fn = [x.detach().clone() for x in examples]
    with torch.no_grad():
        with _same_draws(examples[0].device):  # fn draws what the reference drew
            out_ref = _call(reference, args_ref, "the reference")
        try:
            out_fn = _call(fn, args_fn, "fn")
        except Exception as e:
            return [f"{where}: fn raised {type(e).__name__}: {e}"]
    if out_fn.shape != out_ref.shape:
        return [f"{where}: fn returns shape {tuple(out_fn.shape)} but the reference returns {tuple(out_ref.shape)}."]
    found = [f"{where}: {_another_dtype(out_fn, out_ref)}"] if out_fn.dtype != out_ref.dtype else []
    differ = _values_differ(out_fn, out_ref, tol, where)
    return found + ([] if differ is None else [differ + " (fn computes otherwise when no gradient is needed)."])


def _values_differ(out_fn: torch.Tensor, out_ref: torch.Tensor, tol: tuple[float, float], where: str) -> str | None:
    """The problem where fn's output differs from the reference's beyond ``tol``, or None."""
    error = _max_error(out_fn, out_ref, tol)
    if error is None:
        return None
    return (f"{where}: the values differ from the reference's: max abs error {error[0]:.3e}, max rel error "
            f"{error[1]:.3e}")


def _compare(fn: Callable, reference: Callable, inputs: list[torch.Tensor], tol: tuple[float, float], where: str,
             inplace: bool | None, generator: torch.Generator) -> tuple[list[str], bool]:
    problems: list[str] = []
    leaves_ref = [x.clone().requires_grad_() for x in inputs]
    leaves_fn = [x.clone().requires_grad_() for x in inputs]
    args_ref = [x.clone() for x in leaves_ref]  # non-leaf: an in-place op on them is legal
    args_fn = [x.clone() for x in leaves_fn]
    before = [x.detach().clone() for x in args_fn]
    params_fn = _params(fn)
    params_before = {n: p.detach().clone() for n, p in params_fn.items()}
    order_fn, order_ref = _buffer_order(fn, reference)
    buffers_fn, buffers_ref = _buffers(fn, order_fn), _buffers(reference, order_ref)
    paired = [b.shape for b in buffers_fn.values()] == [b.shape for b in buffers_ref.values()]
    if paired:  # the reference's state (running statistics) starts each trial as fn's is, to compare the update
        slots_ref = {name: (slots, key) for name, slots, key in _buffer_slots(reference)}
        for name, b in zip(order_ref, buffers_fn.values()):
            slots, key = slots_ref[name]
            slots[key] = b.detach().clone()  # (its dtype too: a float64 trial may have assigned one anew)
    nodes = [a.grad_fn for a in args_fn]  # an in-place op autograd knows of gives its input a node of its own
    with _same_draws(inputs[0].device):  # fn draws what the reference drew (an in-place dropout against torch's)
        out_ref = _call(reference, args_ref, "the reference")
    recorder = _WriteRecorder()
    try:
        with recorder:
            out_fn = _call(fn, args_fn, "fn")
    except _NotATensor as e:
        return [f"{where}: {e}"], False
    except Exception as e:
        return [f"{where}: fn raised {type(e).__name__}: {e}"], False
    if out_fn.shape != out_ref.shape:
        return [f"{where}: fn returns shape {tuple(out_fn.shape)} but the reference returns "
                f"{tuple(out_ref.shape)}; fn changes the shape."], False
    if out_fn.dtype != out_ref.dtype:  # the values are compared in float64, where another dtype can pass
        problems.append(f"{where}: {_another_dtype(out_fn, out_ref)}")
    differ = _values_differ(out_fn, out_ref, tol, where)
    if differ is not None:
        problems.append(differ + ".")
    found, wrote_input, returns_input = _writes(recorder, args_fn, out_fn, where, own=buffers_fn.values())
    problems += found
    if paired:  # read again: a forward may assign a buffer anew (self.ema = m * self.ema + ...)
        after_fn, after_ref = _buffers(fn, order_fn), _buffers(reference, order_ref)
        for name, b in after_fn.items():  # a module's own state (running statistics), updated as the reference's
            other = after_ref.get(name)
            if other is None or b.shape != other.shape or not bitwise_equal(b.detach(), other.detach().to(b.dtype)):
                problems.append(f"{where}: fn's buffer {order_fn[int(name)]!r} after the call differs "
                                "from the reference's.")
    elif any(key in {id(b.untyped_storage()) for b in buffers_fn.values()} for key in recorder.written_keys()):
        problems.append(f"{where}: fn updates its buffers, which the reference does not have to compare with.")
    for i, (a, b, node) in enumerate(zip(args_fn, before, nodes)):
        if a.grad_fn is node and not bitwise_equal(a.detach(), b):
            problems.append(
                f"{where}: fn changed its input {i} in place without autograd knowing (a custom Function without "
                "ctx.mark_dirty, or a write through .data): code that uses the input after the call gets the "
                "gradient of values the input no longer holds, where torch's in-place ops give it the op's history."
            )
    if inplace is True and not returns_input:
        problems.append(f"{where}: fn claims to work in place but its result does not share its input's storage.")
    if inplace is False and wrote_input:
        problems.append(f"{where}: fn claims to be out of place but writes into its input.")
    if not returns_input:
        for i, (a, b) in enumerate(zip(args_fn, before)):
            if not bitwise_equal(a.detach(), b) and not any("input" in p for p in problems):
                problems.append(f"{where}: fn changed its input {i} without returning it.")
    for name, p in params_fn.items():
        if not bitwise_equal(p.detach(), params_before[name]):
            problems.append(f"{where}: fn changed its parameter {name} during the forward.")
    # gradients: of every input, and of every tensor requiring grad that either output depends on
    grad_out = torch.randn(out_ref.shape, generator=generator, dtype=torch.float64).to(out_ref.device, out_ref.dtype)
    pairs = _parameter_pairs(fn, reference, _leaves_reached(out_fn, leaves_fn), _leaves_reached(out_ref, leaves_ref))
    try:
        grads_ref = _grads(out_ref, leaves_ref + [b for _, _, b in pairs], grad_out)
    except RuntimeError as e:
        return problems + [f"{where}: the reference's backward failed: {e}"], wrote_input
    try:
        grads_fn = _grads(out_fn, leaves_fn + [a for _, a, _ in pairs], grad_out)
    except Exception as e:
        return problems + [f"{where}: {_explain_backward_error(fn, inputs, e)}"], wrote_input
    names = [f"input {i}" for i in range(len(leaves_fn))] + [name for name, _, _ in pairs]
    problems += _gradient_problems(names, grads_fn, grads_ref, tol, where)
    return problems, wrote_input


def _leaves_reached(out: torch.Tensor, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors requiring grad, other than ``inputs``, whose gradient ``out``'s backward accumulates (its graph's
    ``AccumulateGrad`` nodes), in the order first met: a module's parameters, and any tensor a function reaches
    through a closure or a global (only module parameters of the same names were compared, so a closure's weight
    given a wrong gradient passed)."""
    skip = {id(x) for x in inputs}
    found: dict[int, torch.Tensor] = {}
    if out.grad_fn is None:
        return [out] if out.requires_grad and id(out) not in skip else []
    seen: set[Any] = set()
    stack: list[Any] = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor) and id(variable) not in skip:
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in reversed(node.next_functions))
    return list(found.values())


def _module_pairs(fn: Any, reference: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """fn's module parameters paired with the reference's: by name where both hold the same names, else by position
    where their counts and shapes agree (a fused module against a Sequential names them otherwise), else the names
    both hold (with the same shape)."""
    params_fn, params_ref = _params(fn), _params(reference)
    if set(params_fn) != set(params_ref) and (
        [p.shape for p in params_fn.values()] == [p.shape for p in params_ref.values()]
    ):
        return [(f"parameter {n} (the reference's {m})", p, params_ref[m])
                for (n, p), m in zip(params_fn.items(), params_ref)]
    # the same names; else those the two share (the others are paired as the tensors the outputs depend on)
    return [(f"parameter {n}", p, params_ref[n]) for n, p in params_fn.items()
            if n in params_ref and params_ref[n].shape == p.shape]


def _parameter_pairs(fn: Any, reference: Any, reached_fn: list[torch.Tensor], reached_ref: list[torch.Tensor]
                     ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, fn's tensor, the reference's tensor) for every gradient beyond the inputs': the modules' parameters
    (:func:`_module_pairs`), then each other tensor requiring grad that either output depends on, paired with
    itself (both close over one weight; where only one output depends on it, the other's gradient is missing and
    that is a problem).

    Raises:
        InvalidInputError: each output depends on tensors the other's does not, which pair neither as module
            parameters nor as the same tensor: which gradient to compare with which is unknown.
    """
    pairs = _module_pairs(fn, reference)
    paired_fn, paired_ref = {id(a) for _, a, _ in pairs}, {id(b) for _, _, b in pairs}
    only_fn = [t for t in reached_fn if id(t) not in paired_fn]
    only_ref = [t for t in reached_ref if id(t) not in paired_ref]
    ids_fn, ids_ref = {id(t) for t in only_fn}, {id(t) for t in only_ref}
    unknown_fn = [t for t in only_fn if id(t) not in ids_ref]
    unknown_ref = [t for t in only_ref if id(t) not in ids_fn]
    if unknown_fn and unknown_ref:
        raise InvalidInputError(
            f"memtrim.check_inplace: fn's output depends on {len(unknown_fn)} tensor(s) that require grad "
            f"({_described(unknown_fn, fn, reference)}) and the reference's on {len(unknown_ref)} other(s) "
            f"({_described(unknown_ref, fn, reference)}); expected each gradient to have a counterpart, paired as "
            "module parameters (by name, else by position and shape) or as the same tensor, and cannot tell which "
            "of these pairs with which, so their gradients would go unchecked. Let fn and the reference use the same "
            "tensors (close over one parameter), or pass modules whose parameters share names or order and shapes."
        )
    names = {id(p): f"parameter {n}" for n, p in _params(fn).items()}
    names.update({id(p): f"the reference's parameter {n}" for n, p in _params(reference).items()
                  if id(p) not in names})
    for t in [*only_fn, *(t for t in only_ref if id(t) not in ids_fn)]:
        if id(t) in ids_fn and id(t) in ids_ref:
            name = names.get(id(t), f"a tensor of shape {tuple(t.shape)} that fn and the reference both use")
        else:
            side = "fn" if id(t) in ids_fn else "the reference"
            name = (f"{names[id(t)]}, which only {side}'s output depends on," if id(t) in names
                    else f"a tensor of shape {tuple(t.shape)} that only {side}'s output depends on")
        pairs.append((name, t, t))
    return pairs


def _described(tensors: list[torch.Tensor], fn: Any, reference: Any) -> str:
    names = {id(p): f"fn's {n}" for n, p in _params(fn).items()}
    names.update({id(p): f"the reference's {n}" for n, p in _params(reference).items()})
    shown = [names.get(id(t), f"shape {tuple(t.shape)}") for t in tensors[:4]]
    return ", ".join(shown) + (", ..." if len(tensors) > 4 else "")


def _grads(out: torch.Tensor, tensors: list[torch.Tensor], grad_out: torch.Tensor) -> list[torch.Tensor | None]:
    """The gradient of each of ``tensors`` (None for one that is unused or needs no gradient: a frozen parameter,
    which ``torch.autograd.grad`` refuses)."""
    wanted = [t for t in tensors if t.requires_grad]
    found = dict(zip(map(id, wanted), torch.autograd.grad(out, wanted, grad_out, allow_unused=True)))
    return [found.get(id(t)) for t in tensors]


def _another_dtype(out_fn: torch.Tensor, out_ref: torch.Tensor) -> str:
    return (f"fn returns dtype {out_fn.dtype} but the reference returns {out_ref.dtype}; a caller gets other "
            "arithmetic and memory from there on. Return the reference's dtype.")


def _gradient_problems(names: list[str], grads_fn: Sequence[torch.Tensor | None],
                       grads_ref: Sequence[torch.Tensor | None], tol: tuple[float, float], where: str) -> list[str]:
    problems = []
    for name, a, b in zip(names, grads_fn, grads_ref):
        if (a is None) != (b is None):
            problems.append(f"{where}: the gradient of {name} is {'missing' if a is None else 'present'} for fn "
                            "but not for the reference.")
        elif a is not None and b is not None and a.dtype != b.dtype:
            problems.append(f"{where}: the gradient of {name} has dtype {a.dtype} for fn but {b.dtype} for the "
                            "reference.")
        elif a is not None and b is not None:
            error = _max_error(a, b, tol)
            if error is not None:
                problems.append(f"{where}: the gradient of {name} differs from the reference's: max abs error "
                                f"{error[0]:.3e}, max rel error {error[1]:.3e}.")
    return problems


def _writes(recorder: _WriteRecorder, args_fn: list[torch.Tensor], out_fn: torch.Tensor, where: str,
            own: Iterable[torch.Tensor] = ()) -> tuple[list[str], bool, bool]:
    """What fn wrote into: (problems, whether it wrote into an input, whether it returns an input's storage).
    ``own``: fn's buffers, its own state (compared with the reference's by the caller)."""
    problems: list[str] = []
    out_storage = out_fn.untyped_storage()
    created = {id(s) for s in recorder.created if s is not None} | {id(b.untyped_storage()) for b in own}
    input_storages = {id(a.untyped_storage()): i for i, a in enumerate(args_fn)}
    wrote_input = False
    for op, storage in recorder.written:
        key = id(storage)
        if key in input_storages:
            wrote_input = True
            if storage is not out_storage and storage.data_ptr() != out_storage.data_ptr():
                problems.append(f"{where}: fn writes into its input {input_storages[key]} in place ({op}) but "
                                "returns a different tensor: the caller's tensor is silently overwritten.")
        elif key not in created and storage.data_ptr() != out_storage.data_ptr():
            problems.append(f"{where}: fn writes in place ({op}) into a tensor it neither created nor received "
                            "as an input (a parameter, a buffer or a global): another caller's data is corrupted.")
    returns_input = any(out_storage.data_ptr() == a.untyped_storage().data_ptr() for a in args_fn)
    return problems, wrote_input, returns_input


def _check_saved_by_earlier_op(fn: Callable, reference: Callable, examples: Sequence[torch.Tensor],
                               dtype: torch.dtype, tol: tuple[float, float], generator: torch.Generator) -> list[str]:
    """fn applied to a tensor an earlier op keeps for backward: right gradient or autograd's error."""
    problems = []
    for name, earlier in (("torch.sigmoid", torch.sigmoid), ("torch.exp", torch.exp)):
        x = torch.randn(examples[0].shape, generator=generator, dtype=torch.float64).to(examples[0].device, dtype)
        others = [e.detach().to(dtype, copy=True) for e in examples[1:]]
        leaf_ref, leaf_fn = x.clone().requires_grad_(), x.clone().requires_grad_()
        with _same_draws(x.device):
            out_ref = reference(earlier(leaf_ref), *others)
        grad_out = torch.randn(out_ref.shape, generator=generator, dtype=torch.float64).to(out_ref.device, dtype)
        (expected,) = torch.autograd.grad(out_ref, leaf_ref, grad_out)
        try:
            out_fn = fn(earlier(leaf_fn), *others)
            (got,) = torch.autograd.grad(out_fn, leaf_fn, grad_out)
        except Exception as e:
            if isinstance(e, RuntimeError) and "inplace operation" in str(e):
                continue  # autograd caught it: loud, not silent
            problems.append(f"after {name} (which keeps its output for backward), fn raised {type(e).__name__}: {e}")
            continue
        error = _max_error(got, expected, tol)
        if error is not None:
            problems.append(f"after {name} (which keeps its output for backward), fn gives a silently wrong "
                            f"gradient: max abs error {error[0]:.3e}, max rel error {error[1]:.3e}.")
    return problems


def _same_draws(device: torch.device) -> Any:
    """torch's ``fork_rng`` for the CPU's global generator and ``device``'s: what runs inside draws, and the
    generators are put back after, so fn, run next, draws the same random numbers."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


def _memory(fn: Callable, examples: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(bytes autograd keeps after the call, peak of new storages during it), on the examples."""
    leaves = [x.detach().clone().requires_grad_() for x in examples]
    args = [x.clone() for x in leaves]
    with track() as tracker:
        out = fn(*args)
        kept = tracker.saved_for_backward_bytes()
    report = tracker.report()
    del out
    return kept, report.peak_bytes - report.timeline[0].total_bytes


def _max_error(a: torch.Tensor, b: torch.Tensor, tol: tuple[float, float]) -> tuple[float, float] | None:
    """(max abs, max rel) error if ``a`` differs from the reference ``b`` beyond ``tol`` = (rtol, atol), else None."""
    closeness = compare_tensors(a, b, rtol=tol[0], atol=tol[1])
    return None if closeness.within else (closeness.max_abs_error, closeness.max_rel_error)

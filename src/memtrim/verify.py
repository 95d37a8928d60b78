"""The equivalence harness: train a baseline and a transformed copy side by side and compare everything."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import InvalidInputError, VerifyError

__all__ = ["Divergence", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Divergence:
    """Where the transformed run first differed from the baseline."""

    step: int
    tensor: str  # "loss", "grad:<param name>", "param:<name>" or "buffer:<name>"
    max_abs_error: float
    max_rel_error: float

    def __str__(self) -> str:
        return (
            f"step {self.step}, {self.tensor}: max abs error {self.max_abs_error:.3e}, "
            f"max rel error {self.max_rel_error:.3e}"
        )


@dataclass(frozen=True)
class VerifyReport:
    """Result of :func:`verify`.

    ``ok``: every compared tensor stayed within (rtol, atol) for every step. ``bitwise``: every compared
    tensor was bit-for-bit identical. ``first_divergence``: the first tensor outside tolerance (None if ok);
    ``first_difference``: the first tensor not bitwise equal (None if bitwise).
    """

    ok: bool
    bitwise: bool
    steps: int
    first_divergence: Divergence | None
    first_difference: Divergence | None
    max_abs_error: float
    max_rel_error: float
    baseline_losses: list[float] = field(repr=False)
    transformed_losses: list[float] = field(repr=False)

    def assert_ok(self) -> None:
        """Raise :class:`VerifyError` naming the first divergence unless ``ok``."""
        if not self.ok:
            raise VerifyError(
                f"memtrim.verify: the transformed run diverged from the baseline at {self.first_divergence}."
            )

    def __str__(self) -> str:
        if self.bitwise:
            return f"equal: bitwise over {self.steps} steps"
        if self.ok:
            return (
                f"equal within tolerance over {self.steps} steps (max abs {self.max_abs_error:.3e}, "
                f"max rel {self.max_rel_error:.3e}; first difference at {self.first_difference})"
            )
        return f"DIVERGED at {self.first_divergence}"


def verify(
    make_model: Callable[[], torch.nn.Module],
    make_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer],
    batches: Iterable[tuple[Any, torch.Tensor]],
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    transform: Callable[[torch.nn.Module, torch.optim.Optimizer], tuple[torch.nn.Module, torch.optim.Optimizer]],
    *,
    steps: int | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    seed: int = 0,
    compare_grads: bool = True,
) -> VerifyReport:
    """Train a baseline and a transformed copy from the same seed on the same batches; compare each step.

    Why: a memory technique is only useful if it does not change training. After every step this compares
    the loss, every gradient (after backward) and every parameter and buffer (after the optimizer step).

    Args:
        make_model: builds the model; called after ``torch.manual_seed(seed)`` for each run.
        make_optimizer: ``make_optimizer(model)`` builds the optimizer for that model.
        batches: ``(inputs, targets)`` pairs (inputs a tensor or a tuple of tensors); both runs see the same.
        loss_fn: ``loss_fn(output, targets)`` returns a scalar.
        transform: ``transform(model, optimizer)`` returns the (model, optimizer) to train instead.
        steps: how many batches to use (default: all).
        rtol, atol: tolerance per element, ``|a - b| <= atol + rtol * |b|``. The default is exact equality.
        seed: the seed for building each model and, plus the step number, for each step (dropout etc.).
        compare_grads: compare ``.grad`` after backward (turn off for techniques that free gradients inside
            backward, e.g. an optimizer step fused into backward).

    Returns:
        A :class:`VerifyReport`. Training stops at the first divergence outside tolerance.

    Raises:
        InvalidInputError: an argument of the wrong kind, no batches, or models whose parameters cannot be
            matched by name or by position and shape.

    Example::

        report = memtrim.verify(SeedMLP, lambda m: torch.optim.Adam(m.parameters()), batches, F.nll_loss,
                                lambda m, o: (convert(m), o), steps=10)
        assert report.bitwise
    """
    for name, fn in (("make_model", make_model), ("make_optimizer", make_optimizer), ("loss_fn", loss_fn),
                     ("transform", transform)):
        if not callable(fn):
            raise InvalidInputError(f"memtrim.verify: {name} must be callable, got {type(fn).__name__}.")
    if rtol < 0 or atol < 0:
        raise InvalidInputError(f"memtrim.verify: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}.")
    batch_list = list(batches)
    if steps is not None:
        if steps < 1:
            raise InvalidInputError(f"memtrim.verify: steps must be >= 1, got {steps}.")
        if steps > len(batch_list):
            raise InvalidInputError(f"memtrim.verify: steps={steps} but only {len(batch_list)} batches were given.")
        batch_list = batch_list[:steps]
    if not batch_list:
        raise InvalidInputError("memtrim.verify: no batches given; pass a list of (inputs, targets) pairs.")

    base_model, base_opt = _build(make_model, make_optimizer, seed)
    model, opt = _build(make_model, make_optimizer, seed)
    result = transform(model, opt)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InvalidInputError("memtrim.verify: transform(model, optimizer) must return (model, optimizer).")
    model, opt = result
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.verify: transform returned a {type(model).__name__}, not an nn.Module.")
    params = _match(base_model.named_parameters(), model.named_parameters(), "parameters")
    buffers = _match(base_model.named_buffers(), model.named_buffers(), "buffers")
    base_model.train()
    model.train()

    tracker = _Comparison(rtol, atol)
    base_losses: list[float] = []
    losses: list[float] = []
    for step, (inputs, targets) in enumerate(batch_list):
        args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        base_loss = _forward_backward(base_model, base_opt, args, targets, loss_fn, seed + 1 + step)
        loss = _forward_backward(model, opt, args, targets, loss_fn, seed + 1 + step)
        base_losses.append(float(base_loss))
        losses.append(float(loss))
        if not tracker.compare(step, "loss", base_loss, loss):
            break
        if compare_grads and not all(
            tracker.compare(step, f"grad:{name}", a.grad, b.grad) for name, a, b in params
        ):
            break
        base_opt.step()
        opt.step()
        if not all(tracker.compare(step, f"param:{name}", a, b) for name, a, b in params):
            break
        if not all(tracker.compare(step, f"buffer:{name}", a, b) for name, a, b in buffers):
            break
        if not all(
            tracker.compare(step, f"state:{name}.{key}", a, b)
            for name, key, a, b in _optimizer_states(base_opt, opt, params)
        ):
            break
    return VerifyReport(
        ok=tracker.divergence is None,
        bitwise=tracker.difference is None,
        steps=len(losses),
        first_divergence=tracker.divergence,
        first_difference=tracker.difference,
        max_abs_error=tracker.max_abs,
        max_rel_error=tracker.max_rel,
        baseline_losses=base_losses,
        transformed_losses=losses,
    )


def _build(make_model: Callable, make_optimizer: Callable, seed: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = make_model()
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.verify: make_model returned a {type(model).__name__}, not an nn.Module.")
    optimizer = make_optimizer(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.verify: make_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    return model, optimizer


def _forward_backward(model: torch.nn.Module, optimizer: Any, args: tuple, targets: Any, loss_fn: Callable,
                      seed: int) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model(*args), targets)
    loss.backward()
    return loss.detach()


def _optimizer_states(
    base: torch.optim.Optimizer, other: torch.optim.Optimizer, params: list[tuple[str, torch.Tensor, torch.Tensor]]
) -> Iterator[tuple[str, str, torch.Tensor | None, torch.Tensor | None]]:
    """Per matched parameter, each tensor in the two optimizers' states (None where one side lacks it)."""
    for name, a, b in params:
        state_a, state_b = base.state.get(a, {}), other.state.get(b, {})
        for key in sorted(set(state_a) | set(state_b)):
            va, vb = state_a.get(key), state_b.get(key)
            if isinstance(va, torch.Tensor) or isinstance(vb, torch.Tensor):
                yield name, key, va, vb


def _match(base: Iterable[tuple[str, torch.Tensor]], other: Iterable[tuple[str, torch.Tensor]],
           what: str) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    base_list, other_list = list(base), list(other)
    other_by_name = dict(other_list)
    if [n for n, _ in base_list] and set(n for n, _ in base_list) == set(other_by_name):
        return [(name, tensor, other_by_name[name]) for name, tensor in base_list]
    if len(base_list) == len(other_list) and all(
        a.shape == b.shape for (_, a), (_, b) in zip(base_list, other_list)
    ):
        return [(name, a, b) for (name, a), (_, b) in zip(base_list, other_list)]
    raise InvalidInputError(
        f"memtrim.verify: the transformed model's {what} match the baseline's neither by name nor by position "
        f"and shape (baseline: {[n for n, _ in base_list][:5]}..., transformed: {[n for n, _ in other_list][:5]}...). "
        "A transform must keep the parameters it trains."
    )


class _Comparison:
    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.divergence: Divergence | None = None
        self.difference: Divergence | None = None
        self.max_abs = 0.0
        self.max_rel = 0.0

    def compare(self, step: int, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        if a is None and b is None:
            return True
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            found = Divergence(step, name, math.inf, math.inf)
            self.difference = self.difference or found
            self.divergence = found
            return False
        a, b = a.detach(), b.detach()
        if _bitwise_equal(a, b):
            return True
        diff = (a.double() - b.double()).abs()
        finite = torch.isfinite(diff)
        same_nonfinite = True  # inf and nan must sit at the same places with the same values
        if not finite.all():
            same_nonfinite = torch.equal(a[~finite].double().nan_to_num(), b[~finite].double().nan_to_num())
        max_abs = float(diff[finite].max()) if finite.any() else 0.0
        rel = diff / b.double().abs().clamp_min(torch.finfo(torch.float64).tiny)
        max_rel = float(rel[finite].max()) if finite.any() else 0.0
        if not same_nonfinite:
            max_abs = max_rel = math.inf
        found = Divergence(step, name, max_abs, max_rel)
        self.difference = self.difference or found
        self.max_abs, self.max_rel = max(self.max_abs, max_abs), max(self.max_rel, max_rel)
        within = same_nonfinite and bool(
            (diff[finite] <= self.atol + self.rtol * b.double().abs()[finite]).all()
        )
        if not within:
            self.divergence = found
        return within


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.is_floating_point() or a.is_complex():
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        a = a.contiguous().view(torch.uint8) if a.element_size() == 1 else a.contiguous()
        b = b.contiguous().view(torch.uint8) if b.element_size() == 1 else b.contiguous()
        int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.view(int_dtype), b.view(int_dtype))
    return torch.equal(a, b)

"""One training step run through memtrim's tracker and a cost counter, on fake tensors (a prediction: nothing is
allocated) or on real ones (a measurement), with a set of techniques applied.

NOTE [ predicting a step ]
A prediction builds the model inside ``FakeTensorMode`` (from a factory, or as a fake copy of a given model through
``FakeCopyMode``: no weight is copied), makes fake copies of the example batch, applies the techniques exactly as
:meth:`Plan.apply` does, runs one warm-up step (the optimizer creates its state) and then one tracked step. Fake
tensors on the CPU device take the same kernels and the same storages as real CPU tensors, so the tracker's peak
is the measured peak, byte for byte (``benchmarks/plan_accuracy.py`` checks it). Where model code reads a tensor's
value (``bool``, ``item``) or asks whether it is fake (HF transformers' ``is_tracing``), the trace knows the values
that do not depend on the weights and answers as the real run would (NOTE [ known values ] in ``_values.py``). The
step is the standard loop: ``zero_grad(set_to_none=True)``, forward, loss, backward, ``step()``; with a
:class:`Loop` of ``accumulation_steps`` micro-batches (the example batch each) and ``clip_grad_norm``, the loop as
memtrim's README writes it: each micro-batch's forward and backward (an ``OptimizerInBackward``'s earlier ones inside
``accumulate()``), then ``clip_grad_norm_`` over the model's parameters (an ``OptimizerInBackward`` built with
``clip_grad_norm=`` clips in its two-pass ``backward(loss)`` of the last micro-batch instead), then ``step()``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .._signatures import call_model, not_owned, scalar_loss
from ..errors import InvalidInputError, MemtrimError
from ..measure import Category, MemoryReport, track
from ..measure.hooks import tensors_in
from ..techniques.optim import OptimizerInBackward
from ._techniques import Applied, Blocks, Technique, block_candidates, blocks_of
from ._values import KnownValues, reading_values


@dataclass(frozen=True)
class Work:
    """The work of a step, for the time model: floating-point operations and bytes read and written on the device
    and on the host (offloaded state), and bytes copied between them."""

    flops: int = 0
    moved: int = 0
    host_flops: int = 0
    host_moved: int = 0
    transferred: int = 0

    def extrapolate(self, smaller: Work, times: int) -> Work:
        """This work plus ``times`` more of the difference to ``smaller`` (one more block each)."""
        return Work(*(b + (b - a) * times for a, b in zip(astuple(smaller), astuple(self))))


@dataclass(frozen=True)
class StepTrace:
    """What one traced step did: the tracker's report, and the work it did (for the time model)."""

    report: MemoryReport
    work: Work
    notes: tuple[str, ...]
    model_shape: tuple[tuple[str, tuple[int, ...], torch.dtype], ...] = ()  # each parameter's name, shape, dtype


def model_shape(model: nn.Module) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """What tells one model from another in a plan: each parameter's name, shape and dtype, as built."""
    return tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters(remove_duplicate=False))


class _CostMode(TorchDispatchMode):
    """Counts floating-point operations (torch's own flop formulas) and bytes read and written by every op but views,
    apart for ops on ``host`` (in a prediction the offloaded state's fake device) and copies between host and device.
    Views are left out: they move nothing, and hooks that alias a saved tensor (the tracker's) would otherwise count
    as traffic that a plan whose own hooks replace them (offloading) seems to save."""

    def __init__(self, host: str) -> None:
        super().__init__()
        self.host = host
        self.counts = [0, 0, 0, 0, 0]  # the fields of Work

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "is_view", False):  # a view (t, transpose, detach...) moves no data and does no work
            return out
        tensors = [t for t in (*tensors_in((args, kwargs)), *tensors_in(out)) if t.layout is torch.strided]
        on_host = [t.device.type == self.host for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if any(on_host) and not all(on_host):
            self.counts[4] += nbytes // 2  # a copy between host and device: what crosses once
            return out
        where = 2 if on_host and all(on_host) else 0
        packet = getattr(func, "overloadpacket", None)
        counter = flop_registry.get(packet) if packet is not None else None
        if counter is not None:
            self.counts[where] += int(counter(*args, **kwargs, out_val=out))
        self.counts[where + 1] += nbytes
        return out


@dataclass(frozen=True)
class Loop:
    """What the training loop does around a step: ``accumulation_steps`` micro-batches per step, and clipping of the
    gradients' global norm to ``clip_grad_norm`` before it (None: no clipping)."""

    accumulation_steps: int = 1
    clip_grad_norm: float | None = None


STANDARD_LOOP = Loop()  # one backward per step, no clipping


def _step(model: nn.Module, optimizer: Any, inputs: Any, targets: Any, loss_fn: Callable[..., Any],
          loop: Loop = STANDARD_LOOP) -> None:
    in_backward = isinstance(optimizer, OptimizerInBackward)
    optimizer.zero_grad(set_to_none=True)
    for micro in range(loop.accumulation_steps):
        last = micro == loop.accumulation_steps - 1
        with contextlib.nullcontext() if last or not in_backward else optimizer.accumulate():
            out = call_model(model, inputs)
            loss = scalar_loss("memtrim.plan", loss_fn(out, targets))
            del out
            if in_backward and last and loop.clip_grad_norm is not None:
                optimizer.backward(loss)  # two passes: the norm first
            else:
                loss.backward()
            del loss
    if loop.clip_grad_norm is not None and not in_backward:
        torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip_grad_norm)
    optimizer.step()


def _fake_mode() -> Any:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


@contextlib.contextmanager
def _faking(mode: Any, values: KnownValues) -> Iterator[None]:
    """``FakeTensorMode`` with the values it can know (NOTE [ known values ]); nothing for a real run."""
    if mode is None:
        yield
        return
    # torch logs every failing fake kernel with its traceback (ERROR, the planner's refusal follows it: a model the
    # inputs do not fit printed 19 lines of torch's traceback before memtrim's one-line error)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with mode, values, reading_values(values):
            yield
    finally:
        log.setLevel(level)


def _fake(mode: Any, values: KnownValues, t: torch.Tensor) -> torch.Tensor:
    fake = mode.from_tensor(t)
    values.add(fake, t)
    return fake


def _fake_copy(mode: Any, values: KnownValues, value: Any) -> Any:
    def one(t: Any) -> Any:
        return _fake(mode, values, t) if isinstance(t, torch.Tensor) else t

    return torch.utils._pytree.tree_map(one, value)


def _fake_copy_of(model: nn.Module, mode: Any, values: KnownValues) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake (the memo hands them to deepcopy: no weight is
    copied), the buffers and the vector parameters with their values (NOTE [ known values ]). Made outside the mode,
    which refuses real tensors."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(mode.from_tensor(p), requires_grad=p.requires_grad)
        if p.dim() <= 1:  # norm weights and biases: decisions made from them see the values as given
            values.add(memo[id(p)], p, pinned=True)
    for b in model.buffers():
        memo[id(b)] = _fake(mode, values, b)
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # (it was said as the user's step failing, which runs: found by an adversarial pass)
        raise InvalidInputError(
            f"memtrim.plan: a model passed itself is traced on a copy, and copy.deepcopy of this one raised "
            f"({type(e).__name__}: {' '.join(str(e).split())[:300]}): a tensor that is not a leaf held by a module "
            "(torch.nn.utils.prune's pruned weight, the old torch.nn.utils.weight_norm) does not copy. Expected a "
            "model torch can deepcopy; to fix: pass a factory that builds it (memtrim.plan(lambda: build(), ...)), "
            "which plan calls under FakeTensorMode, or use torch.nn.utils.parametrizations.weight_norm."
        ) from e


def _build(model_or_factory: nn.Module | Callable[[], nn.Module], fake: bool) -> nn.Module:
    if isinstance(model_or_factory, nn.Module):
        return copy.deepcopy(model_or_factory)
    try:
        model = model_or_factory()
    except Exception as e:  # under FakeTensorMode, a factory that copies or loads existing tensors: said as such
        if not fake or isinstance(e, MemtrimError):
            raise
        raise InvalidInputError(
            f"memtrim.plan: the model factory raised under FakeTensorMode ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:300]}). {_FAKE_FACTORY}"
        ) from e
    if not isinstance(model, nn.Module):
        raise InvalidInputError(
            f"memtrim.plan: the model factory must return a torch.nn.Module, got {type(model).__name__}."
        )
    if fake:  # a real tensor would make the fake mode refuse the step in its own words
        from torch._subclasses.fake_tensor import FakeTensor

        named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
        real = next((name for name, t in named if not isinstance(t, FakeTensor)), None)
        if real is not None:
            raise InvalidInputError(
                f"memtrim.plan: the model factory returned a model whose {real!r} is a real tensor: a model built "
                f"before the call (`lambda: model`), or a tensor made outside the factory. {_FAKE_FACTORY}"
            )
    return model


_FAKE_FACTORY = ("The factory is called under FakeTensorMode, so that no weight is allocated: it must build every "
                 "tensor itself (no copy or load of existing ones: `copy.deepcopy(model)`, `load_state_dict`). To "
                 "fix: pass the model itself (memtrim.plan(model, ...) copies it as fake tensors), or build the "
                 "model inside the factory.")


# A model wholly in eval mode is planned in training mode: HF's from_pretrained returns models in eval mode, and
# traced so, the plan missed dropout's masks and BatchNorm's batch statistics (an HF GPT-2's step 64,512 B above its
# prediction; a plan said it fit a budget the step then exceeded by 5.7 %, found by an adversarial pass). A model
# trained in eval mode on purpose peaks no higher than so planned. A module left in eval mode among training ones
# (a frozen BatchNorm) is the user's choice, planned as it is.
PLANNED_IN_TRAINING = (
    "the model was in eval mode (HF's from_pretrained returns models so): planned in training mode, as a loop runs "
    "it after model.train(); a step run in eval mode peaks no higher")


def _refuse_nothing_to_train(model: nn.Module) -> None:
    """A model with no parameter to train: said as such (torch's "optimizer got an empty parameter list" or "element
    0 of tensors does not require grad" came out of the step's trace; found by an adversarial pass)."""
    params = list(model.parameters())
    if not params:
        raise InvalidInputError("memtrim.plan: the model has no parameters: there is no training step to plan.")
    if not any(p.requires_grad for p in params):
        raise InvalidInputError(
            f"memtrim.plan: all {len(params)} parameters of the model are frozen (requires_grad=False): the step "
            "trains nothing. Expected the parameters you train to require grad; to fix: unfreeze them before "
            "planning (model.requires_grad_(True), or those of the layers you fine-tune).")


def _kernels_not_traced(model: nn.Module) -> list[str]:
    """Notes for modules whose real kernels keep other tensors than their fake kernels: the prediction misses it."""
    notes = []
    rnns = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.RNNBase)})
    if rnns:
        notes.append(f"{', '.join(rnns)}: traced through torch's generic RNN ops; a real step runs a fused kernel (the "
                     "CPU's oneDNN mkldnn_rnn_layer, cuDNN's RNN) that keeps other tensors for backward, so its peak "
                     "differs from this prediction (on the CPU it is above it): not modelled")
    if any(isinstance(m, nn.EmbeddingBag) for m in model.modules()):
        notes.append("EmbeddingBag: the CPU kernel's offset2bag holds one index more than the fake kernel's (8 B "
                     "per call): a peak during backward can be that much above this prediction")
    return notes


def block_candidates_of(model_or_factory: nn.Module | Callable[[], nn.Module]) -> list[Blocks]:
    """:func:`~memtrim.planner.block_candidates` of a model, or of the one a factory builds under ``FakeTensorMode``,
    by name (:func:`~memtrim.planner.class_names`; what the factory raises is the caller's to say)."""
    if isinstance(model_or_factory, nn.Module):
        model = model_or_factory
    else:
        with _faking(_fake_mode(), KnownValues()):
            model = _build(model_or_factory, fake=True)
    return [blocks_of(model, choice) for choice in block_candidates(model)]


def trace_step(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    inputs: Any,
    targets: Any,
    loss_fn: Callable[..., Any],
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    techniques: Sequence[Technique],
    *,
    fake: bool = True,
    loop: Loop = STANDARD_LOOP,
    blocks: Sequence[str | type[nn.Module]] = (),
    device: str | torch.device | None = None,
) -> StepTrace:
    """Run the steady-state training step of ``model`` with ``techniques`` applied; see NOTE [ predicting a step ].

    ``fake=False`` measures it for real instead (on a copy of the model, or a new one from the factory); ``loop``:
    the accumulation and clipping around it; ``blocks``: the classes checkpointing takes as the blocks, or their
    names (a :attr:`Plan.blocks <memtrim.planner.Plan.blocks>`; empty: the model's
    :func:`~memtrim.planner.repeated_block`); ``device``: the device the step is planned for, where the model is built
    on ``meta`` (planned for the CPU, the CPU tensors the step makes count as the device's: AdamW's step counters,
    which a meta trace left out, 4 B per parameter tensor low).
    """
    mode = _fake_mode() if fake else None
    values = KnownValues()
    model = None
    notes: list[str] = []
    if mode is not None:
        inputs, targets = _fake_copy(mode, values, (inputs, targets))
        if isinstance(model_or_factory, nn.Module):
            model = _fake_copy_of(model_or_factory, mode, values)
    with _faking(mode, values):
        if model is None:
            model = _build(model_or_factory, fake)
        _refuse_nothing_to_train(model)
        shape = model_shape(model)
        if not any(m.training for m in model.modules()):  # (a copy, or the factory's own model)
            model.train()
            notes.append(PLANNED_IN_TRAINING)
        optimizer = optimizer_factory(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidInputError(
                f"memtrim.plan: optimizer_factory(model) must return a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}."
            )
        stray = not_owned(model, optimizer)
        if stray:
            raise InvalidInputError(
                f"memtrim.plan: optimizer_factory(model) returned an optimizer stepping {len(stray)} parameters "
                "that are not the model's: build it from the model it is given, e.g. lambda m: "
                "torch.optim.AdamW(m.parameters()), not from a model captured from outside."
            )
        if fake:
            notes.extend(_kernels_not_traced(model))
        applied = Applied(model, optimizer, host="meta" if fake else "cpu", clip_grad_norm=loop.clip_grad_norm,
                          blocks=blocks)
        for technique in techniques:
            notes.extend(technique.apply(applied))
        _step(applied.model, applied.optimizer, inputs, targets, loss_fn, loop)
        cost = _CostMode(applied.host if fake else "")  # a real run here has no host apart from the device
        with track(applied.model, applied.inner_optimizer) as tracker:
            for tensor in tensors_in((inputs, targets)):
                tracker.label(tensor, Category.INPUTS)
            with cost:
                _step(applied.model, applied.optimizer, inputs, targets, loss_fn, loop)
        report = tracker.report()
        if report.device == "meta" and device is not None and torch.device(device).type == "cpu":
            report = tracker._report_across(("meta", "cpu"))
        applied.undo()
    if values.approximate_decisions:
        notes.append(f"{values.approximate_decisions} shape decisions made from vector parameters as given (memtrim's "
                     "converted norms): the optimizer's steps can move a feature across the bound and the real step "
                     "then keeps one column more or fewer (NOTE [ when a norm keeps its input ])")
    return StepTrace(report=report, work=Work(*cost.counts), notes=tuple(notes), model_shape=shape)

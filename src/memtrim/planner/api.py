"""``memtrim.plan``: which techniques make a training step fit a memory budget, predicted without allocating."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import numbers
import re
import textwrap
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

from .._signatures import accepts
from ..errors import InvalidInputError, MemtrimError, MemtrimStateError, PlanError
from ..measure import format_bytes, pyplot
from ..measure.hooks import compiled_module
from ..techniques.checkpoint import selective_available
from ._cost import DeviceCost, calibrate, device_cost
from ._techniques import EXCLUSIVE, TECHNIQUES, Applied, Blocks, NotApplicable, Technique, blocks_name
from ._trace import PLANNED_IN_TRAINING, STANDARD_LOOP, Loop, StepTrace, Work, block_candidates_of, trace_step
from ._workers import Failed, Tracer, default_workers

_API = "memtrim.plan"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str) -> int:
    """``24GiB``, ``1.5 GB``, ``500MB``, ``1000`` or an int → bytes.

    Raises:
        InvalidInputError: anything else, or a value <= 0.
    """
    if isinstance(value, bool):
        raise InvalidInputError(f"{_API}: a budget must be bytes or a size like '24GiB', got {value!r}.")
    if isinstance(value, numbers.Real):  # (NumPy's integers and floats too)
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*", value.lower())
        if match is None or match.group(2) not in _UNITS:
            raise InvalidInputError(
                f"{_API}: cannot read the size {value!r}; write e.g. '24GiB', '1.5GB', '800MiB' or a number of bytes."
            )
        number = float(match.group(1)) * _UNITS[match.group(2)]
    else:
        raise InvalidInputError(f"{_API}: a budget must be bytes or a size like '24GiB', got {type(value).__name__}.")
    if not math.isfinite(number) or number < 1:
        raise InvalidInputError(f"{_API}: a budget must be a finite size of at least 1 byte, got {value!r}.")
    return int(number)


@dataclass(frozen=True)
class Plan:
    """One combination of techniques and what it is predicted to do to a training step.

    Attributes:
        techniques: the technique names, in the order they are applied (``()`` is the plain step).
        peak_bytes: the predicted peak of a steady-state step; ``peak_by_category`` splits it.
        peak_phase: forward, backward or optimizer.
        time_ratio: predicted step time relative to the plain step (the cost model of ``memtrim.planner``).
        numerics: ``"bitwise"`` (training unchanged), ``"tolerance"`` (another kernel's rounding) or ``"changed"``
            (low-bit optimizer state: planned only where nothing else fits, NOTE [ numerics first ]).
        fits: whether ``peak_bytes <= budget``.
        notes: what each technique did on the traced model.
        clip_grad_norm: the loop's clipping it was planned with (``plan``'s), which :meth:`apply` gives an
            ``OptimizerInBackward`` it builds.
        blocks: the classes ``checkpoint`` and ``selective`` take as the model's blocks, every instance of them
            checkpointed, by name (``module.QualName``, with ``@`` and its first module's path where another class
            has that name: :func:`~memtrim.planner.class_names`; NOTE [ choosing the blocks ]); ``()`` where the plan
            checkpoints nothing, or where the choices could not be found (the notes say why; :meth:`apply` then
            checkpoints the model's :func:`~memtrim.planner.repeated_block`).
    """

    techniques: tuple[str, ...]
    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_phase: str
    time_ratio: float
    numerics: str
    fits: bool
    notes: tuple[str, ...] = ()
    clip_grad_norm: float | None = None  # the loop's, planned: apply builds an OptimizerInBackward clipping so
    blocks: Blocks = ()

    @property
    def name(self) -> str:
        """``plain`` or the techniques joined by ``+``."""
        return "+".join(self.techniques) or "plain"

    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
        """Apply the plan's techniques to a real ``(model, optimizer)``, in place where the technique is; returns
        the pair to train with (the optimizer may be an :class:`~memtrim.OptimizerInBackward`, a
        :class:`~memtrim.CPUOffloadOptimizer` or a :class:`~memtrim.LowBitAdamW`)."""
        found = _applied_already(model)
        if found is not None:  # the techniques' own errors would say to undo with handles apply does not return
            raise MemtrimStateError(
                f"{_API}: Plan.apply: expected a model as built; found a plan applied already ({found}). "
                "Apply a plan once: build the model and its optimizer again (a notebook cell run twice applies twice)."
            )
        marked = _marked(model)
        applied = Applied(model, optimizer, clip_grad_norm=self.clip_grad_norm, blocks=self.blocks)
        try:
            for name in self.techniques:
                try:
                    TECHNIQUES[name].apply(applied)
                except NotApplicable as e:
                    raise InvalidInputError(
                        f"{_API}: Plan.apply: {name} does not apply to this model and optimizer ({e}); plan with the "
                        "model and optimizer you train with."
                    ) from None
        except BaseException:
            applied.undo()  # the techniques applied before the one that failed: the model is as it was given
            raise
        if _marked(model) != marked:  # the plan changed the model (an optimizer alone is the caller's to replace)
            model.__dict__[_APPLIED] = self.name
        return applied.model, applied.optimizer


_APPLIED = "_memtrim_plan_applied"  # instance attribute on a model a plan changed: the plan's name


def _marked(model: nn.Module) -> set[int]:
    """The modules of ``model`` that are checkpointed or offloaded."""
    return {id(m) for m in model.modules()
            if "_memtrim_checkpointed" in m.__dict__ or "_memtrim_offloaded" in m.__dict__}


def _applied_already(model: nn.Module) -> str | None:
    """Which plan was applied to ``model`` already (None if none was). Techniques the user applied by hand (a
    ``checkpoint_modules`` of their own) are no plan: a plan's own technique refuses them where they clash."""
    name = model.__dict__.get(_APPLIED)
    return None if name is None else f"plan {name!r}"


class Plans(Sequence[Plan]):
    """The plans that fit the budget, those that keep the numbers first (bitwise, then tolerance, then changed: the
    least lossy optimizer state first), then fastest, then lowest peak (NOTE [ numerics first ]); ``rejected`` holds
    those that do not fit, lowest peak first. ``best`` is the first plan."""

    def __init__(self, fitting: list[Plan], rejected: list[Plan], budget: int, device: str, cost: DeviceCost,
                 notes: list[str]) -> None:
        self._plans = fitting
        self.rejected = rejected
        self.budget = budget
        self.device = device
        self.cost = cost
        self.notes = notes

    def __getitem__(self, i: Any) -> Any:
        return self._plans[i]

    def __len__(self) -> int:
        return len(self._plans)

    def __iter__(self) -> Iterator[Plan]:
        return iter(self._plans)

    @property
    def best(self) -> Plan:
        """The first plan that fits: the fastest of those with the least change to the numbers."""
        return self._plans[0]

    @property
    def all(self) -> list[Plan]:
        """Every plan traced: fitting ones first."""
        return [*self._plans, *self.rejected]

    def table(self) -> str:
        """The plans as a markdown table (rejected ones marked)."""
        rows = ["| plan | predicted peak | phase | time | numerics | fits |", "|---|---:|---|---:|---|---|"]
        for p in self.all:
            rows.append(f"| {p.name} | {format_bytes(p.peak_bytes)} | {p.peak_phase} | {p.time_ratio:.2f}x | "
                        f"{p.numerics} | {'yes' if p.fits else 'no'} |")
        return "\n".join(rows)

    def __str__(self) -> str:
        head = f"memtrim.plan: budget {format_bytes(self.budget)} on {self.device}; {len(self)} of " \
               f"{len(self.all)} plans fit"
        return "\n".join([head, self.table(), *self.notes])

    def plot(self, path: str) -> None:
        """A stacked bar per plan: its predicted peak by category, the budget as a line (needs matplotlib)."""
        plt = pyplot("Plans.plot")
        plans = self.all
        categories = [c for c in plans[0].peak_by_category if any(p.peak_by_category.get(c) for p in plans)]
        fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(plans)), 4.5))
        bottom = [0.0] * len(plans)
        for cat in categories:
            values = [p.peak_by_category.get(cat, 0) / 2**20 for p in plans]
            ax.bar(range(len(plans)), values, bottom=bottom, label=cat)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.axhline(self.budget / 2**20, color="black", linestyle="--", label="budget")
        ax.set_xticks(range(len(plans)), [p.name for p in plans], rotation=30, ha="right")
        ax.set_ylabel("predicted peak (MiB)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def combinations(names: Iterable[str]) -> list[tuple[str, ...]]:
    """Every subset of ``names`` that respects ``EXCLUSIVE``, each in ``TECHNIQUES`` order."""
    order = [n for n in TECHNIQUES if n in set(names)]
    out = []
    for r in range(len(order) + 1):
        for combo in itertools.combinations(order, r):
            if all(len(group & set(combo)) <= 1 for group in EXCLUSIVE):
                out.append(combo)
    return out


def _check(model_or_factory: Any, loss_fn: Any, optimizer_factory: Any, techniques: Any) -> list[str]:
    if not isinstance(model_or_factory, nn.Module) and not callable(model_or_factory):
        raise InvalidInputError(
            f"{_API}: model_or_factory must be an nn.Module or a function returning one, got "
            f"{type(model_or_factory).__name__}."
        )
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model_or_factory, DistributedDataParallel):  # found by an adversarial pass: the trace failed on
        raise InvalidInputError(                                 # DDP's buffers, blaming the user's step
            f"{_API}: the model is wrapped in DistributedDataParallel, whose reducer's buffers are real tensors the "
            "step cannot be traced on fake ones with. Expected the model itself; to fix: plan the module inside "
            "(memtrim.plan(ddp_model.module, ...)): the plan is one process's step."
        )
    compiled = compiled_module(model_or_factory) if isinstance(model_or_factory, nn.Module) else None
    if compiled is not None:  # (found by an adversarial pass on 2026-12-03: the eager step was planned, not the
        raise InvalidInputError(  # compiled one's peak, and the model ran eagerly ever after)
            f"{_API}: {compiled} was compiled (torch.compile or Module.compile()). The plan traces the step under a "
            "fake mode, where torch.compile skips every compiled frame and caches that skip: it would plan the eager "
            "step, not the compiled one, and the model would stay eager afterwards. Expected an uncompiled model; "
            "to fix: plan the model before compiling it (for torch.compile(model), its _orig_mod).")
    if isinstance(optimizer_factory, type) or not callable(optimizer_factory):
        raise InvalidInputError(
            f"{_API}: optimizer_factory must be a function of the model, e.g. lambda m: torch.optim.AdamW("
            f"m.parameters()), got {optimizer_factory!r}."
        )
    if not callable(loss_fn):
        raise InvalidInputError(f"{_API}: loss_fn must be callable (output, targets) -> loss, got {loss_fn!r}.")
    for name, fn, arity, what in (("optimizer_factory", optimizer_factory, 1, "one argument (the model)"),
                                  ("loss_fn", loss_fn, 2, "two arguments (output, targets)")):
        if not accepts(fn, arity):
            raise InvalidInputError(f"{_API}: {name} must accept {what}; its signature is {inspect.signature(fn)}.")
    if isinstance(techniques, str):
        raise InvalidInputError(f"{_API}: techniques must be a list of names, e.g. [{techniques!r}], got a str.")
    names = list(TECHNIQUES if techniques is None else techniques)
    unknown = [n for n in names if n not in TECHNIQUES]
    if unknown:
        raise InvalidInputError(f"{_API}: unknown techniques {unknown}; choose from {sorted(TECHNIQUES)}.")
    return names




def _device(device: Any, tensors: list[torch.Tensor]) -> torch.device:
    if device is None:
        return tensors[0].device if tensors else torch.device("cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidInputError(f"{_API}: cannot read the device {device!r} ({e}); write e.g. 'cuda' or 'cpu'.") from e


def plan(
    model_or_factory: nn.Module | Callable[[], nn.Module],
    example_inputs: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer_factory: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    budget: int | float | str,
    targets: Any = None,
    device: str | torch.device | None = None,
    techniques: Sequence[str] | None = None,
    calibrate_time: bool = False,
    depth: int | None = None,
    progress: Callable[[str], None] | None = None,
    workers: int | None = None,
    accumulation_steps: int = 1,
    clip_grad_norm: float | None = None,
) -> Plans:
    """Rank the combinations of memtrim's techniques that make one training step fit ``budget``: unchanged numerics
    first, then the fastest by the time model (NOTE [ numerics first ]).

    Why: "will it fit?" is the question people bring; this answers it before anything is allocated. Every plan is
    predicted by running the step on fake tensors through memtrim's tracker with the techniques applied (NOTE
    [ predicting a step ]): the predicted peak is what the tracker measures when the step runs for real, byte for
    byte on the CPU.

    Args:
        model_or_factory: a module (copied as fake tensors: no weight is allocated) or a function that builds one
            (called under ``FakeTensorMode``: a model larger than the machine plans fine).
        example_inputs: what the model is called with: a tensor, a tuple (or list) of arguments, unpacked, or a dict
            (``model(**batch)``); a forward that takes one list or dict is given ``(batch,)``.
        loss_fn: ``loss_fn(output, targets)`` → scalar loss (HF: ``lambda out, _: out.loss``).
        optimizer_factory: ``optimizer_factory(model)`` → a ``torch.optim`` optimizer.
        budget: bytes, or a size such as ``"24GiB"``.
        targets: passed to ``loss_fn``.
        device: the device the plan is for (default: the example inputs'). Tracing uses that device's kernels
            only when it is present; a CUDA plan made on a CPU-only machine traces CPU kernels (said in the notes).
        techniques: the names to combine (default all of ``memtrim.planner.TECHNIQUES``).
        calibrate_time: measure the device's throughput first (when present) instead of the default constants.
        depth: for a deep stack of identical blocks (a 7B decoder): ``model_or_factory`` is then a function of the
            number of blocks; each plan is traced at 2 and 3 blocks and every category of its peak, and its work, is
            extrapolated linearly to ``depth`` (exact where the peak sits at the same place in every block; the
            notes say it is an extrapolation, ``benchmarks/plan_llama.py`` measures the error against full traces).
        progress: called with a line per traced plan.
        workers: processes tracing plans side by side (default: the CPUs this process may use, at most 8; 1 traces
            them in turn here). Forked, and only where forking is safe (NOTE [ tracing plans in parallel ]); the
            plans are the same either way.
        accumulation_steps: micro-batches per optimizer step (``example_inputs`` is one): each step runs that many
            forwards and backwards (an ``OptimizerInBackward``'s earlier ones inside ``accumulate()``).
        clip_grad_norm: the loop clips the gradients' global norm to it before each step (``clip_grad_norm_``); an
            ``OptimizerInBackward`` clips itself in two passes (``optimizer.backward(loss)``), which costs more
            memory than one: plan with it where the loop clips.

    Returns:
        :class:`Plans`, the best fitting plan first; ``Plans.rejected`` the rest.

    Raises:
        InvalidInputError: a wrong argument.
        PlanError: no plan fits; the message names the closest plan and how much it is over.

    Example::

        plans = memtrim.plan(SmallGPT, x, lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()),
                             lambda m: torch.optim.AdamW(m.parameters()), targets=y, budget="64MiB")
        model, optimizer = plans.best.apply(model, optimizer)
    """
    # Over 60 lines for its docstring (Args, Returns, Raises, Example); the body is the two tracing passes, ~45 lines.
    names = _check(model_or_factory, loss_fn, optimizer_factory, techniques)
    limit = parse_bytes(budget)
    loop = _loop(accumulation_steps, clip_grad_norm)
    _check_depth(depth, model_or_factory)
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise InvalidInputError(f"{_API}: workers must be an int >= 1 (1 traces the plans in turn here), or None "
                                f"for the CPUs this process may use; got {workers!r}.")
    tensors = [t for t in torch.utils._pytree.tree_leaves((example_inputs, targets)) if isinstance(t, torch.Tensor)]
    dev = _device(device, tensors)
    notes: list[str] = []
    names = _usable(names, dev, depth, notes)
    cost = calibrate(dev) if calibrate_time else device_cost(dev)

    def estimate(combo: tuple[str, ...], given: Blocks = ()) -> _Estimate:
        return _estimate(model_or_factory, example_inputs, targets, loss_fn, optimizer_factory, combo, depth, loop,
                         given or _blocks_of(combo, blocks), dev)

    def traced(combo: tuple[str, ...], e: _Estimate) -> None:
        if progress is not None:
            progress(f"{'+'.join(combo) or 'plain'}: {format_bytes(e.peak_bytes)}")

    def trace(combos: list[tuple[str, ...]], failed: set[str]) -> dict[tuple[str, ...], _Estimate]:
        # one technique at a time first: one that has nothing to do on this model leaves out every combination
        # with it (NotApplicable)
        out = {}
        for wave in ([c for c in combos if len(c) == 1], [c for c in combos if len(c) > 1]):
            for combo, outcome in tracer.map(c for c in wave if not failed.intersection(c)):
                if isinstance(outcome, Failed):
                    if outcome.not_applicable:  # the technique has nothing to do on this model
                        left_out[combo] = f"{'+'.join(combo)}: left out ({outcome.message})"
                        failed.update(combo if len(combo) == 1 else ())
                    else:  # the plain step runs; this combination does not: leave it out and say why
                        left_out[combo] = (f"{'+'.join(combo)}: left out (tracing it raised {outcome.kind}: "
                                           f"{outcome.message})")
                    notes.append(left_out[combo])
                    continue
                out[combo] = outcome
                traced(combo, outcome)
        return out

    # NOTE [ numerics first ]: a technique that changes the numbers (low-bit state) is planned only when nothing that
    # keeps them fits; among fitting plans the ranking is numerics class, then predicted time, then peak
    changing = {n for n in names if TECHNIQUES[n].numerics == "changed"}
    failed: set[str] = set()
    left_out: dict[tuple[str, ...], str] = {}  # combination -> why it was left out (also in the notes)
    exact = [c for c in combinations(names) if not changing.intersection(c)]
    workers = default_workers() if workers is None else workers
    # (estimate is given the blocks there; the chosen blocks' traces are the plans' own)
    blocks, chosen = _choose_blocks(model_or_factory, depth, names, estimate, workers, cost, notes)
    with Tracer(estimate, workers, len(exact) - 1) as tracer:
        if tracer.parallel:
            notes.append(f"traced in {tracer.workers} worker processes")
        estimates: dict[tuple[str, ...], _Estimate] = {(): _plain(estimate, example_inputs)}  # the user's own error
        traced((), estimates[()])
        if PLANNED_IN_TRAINING in estimates[()].notes:
            notes.append(PLANNED_IN_TRAINING)
        for combo, e in chosen.items():
            estimates[combo] = e
            traced(combo, e)
        estimates.update(trace([c for c in exact[1:] if c not in chosen], failed))
        base = cost.step_seconds(estimates[()].work)
        aside = _aside_in_checkpoints(model_or_factory)
        plans = [_plan(combo, e, base, cost, limit, aside, loop, _blocks_of(combo, blocks))
                 for combo, e in estimates.items()]
        if changing and not any(p.fits for p in plans):
            notes.append(f"{', '.join(sorted(changing))}: traced because no plan with unchanged numerics fits")
            more = trace([c for c in combinations(names) if changing.intersection(c)], failed)
            plans += [_plan(combo, e, base, cost, limit, aside, loop, _blocks_of(combo, blocks))
                      for combo, e in more.items()]
        elif changing:
            notes.append(f"{', '.join(sorted(changing))}: not needed (a plan with unchanged numerics fits)")
    _check_one_model(estimates)
    advice = _sliced_inputs((example_inputs, targets))
    result = _ranked(plans, limit, dev, cost, notes, estimates[()].peak_bytes, advice)
    _warn_if_numbers_change(result, [why for combo, why in left_out.items() if not changing.intersection(combo)])
    return result


# NOTE [ choosing the blocks ]: `checkpoint` and `selective` checkpoint every instance of one class, the model's
# blocks, or of several (an encoder's and a decoder's layers). A class repeated in a ModuleList or Sequential is the
# usual one (a decoder layer); models that hold their blocks as attributes (timm's regnet: stages s1..s4 holding
# blocks b1, b2, ...), nest containers (timm's convnext: a Sequential of stages, each a Sequential of blocks) or hold
# two stacks (BART) offer several choices, of which the parameters they hold do not tell the best (the stages, which
# the largest-class rule chose for convnext until 2026-12-03, peaked 27 % above its blocks; BART's decoder layers
# alone 37 % above both stacks' layers: benchmarks/plan_blocks.py). Where the model offers more than one
# (block_candidates), each technique is traced with each and keeps the one with the lowest peak (ties: the fastest); a
# plan records it and Plan.apply checkpoints those classes. A choice whose trace raised is left out, said in the notes
# with why (a T5's blocks with their key/value cache: the next choice, its stacks, 42 % higher, was taken silently at
# first: a helper's run). The traces cost time: one more per choice and technique.
_BLOCKWISE = ("selective", "checkpoint")


def _choose_blocks(model_or_factory: Any, depth: int | None, names: list[str], estimate: Callable[..., _Estimate],
                   workers: int, cost: DeviceCost, notes: list[str]
                   ) -> tuple[dict[str, Blocks], dict[tuple[str, ...], _Estimate]]:
    """The blocks each of ``checkpoint`` and ``selective`` among ``names`` takes (none: no block), and the estimates
    of those techniques alone with them."""
    wanted = [n for n in _BLOCKWISE if n in names]
    if not wanted:
        return {}, {}
    try:
        candidates = block_candidates_of(model_or_factory if depth is None else functools.partial(model_or_factory, 3))
    except Exception as e:  # a factory that raised: its own trace says so again where it does
        notes.append(f"{' and '.join(wanted)}: the blocks of the model the factory built are not known (building it "
                     f"raised {type(e).__name__}: {_short(str(e))}); each trace checkpoints the repeated block class "
                     "of its own model (memtrim.planner.repeated_block)")
        return {}, {}
    if len(candidates) < 2:
        return {name: candidates[0] for name in wanted} if candidates else {}, {}
    jobs = [(name, str(i)) for name in wanted for i in range(len(candidates))]
    outcomes: dict[str, dict[Blocks, Any]] = {name: {} for name in wanted}
    with Tracer(lambda job: estimate((job[0],), candidates[int(job[1])]), workers, len(jobs)) as tracer:
        for (name, index), outcome in tracer.map(jobs):
            outcomes[name][candidates[int(index)]] = outcome
    chosen: dict[str, Blocks] = {}
    estimates: dict[tuple[str, ...], _Estimate] = {}
    for name in wanted:
        traced = {b: e for b, e in outcomes[name].items() if not isinstance(e, Failed)}
        failed = [f"{blocks_name(b)} ({e.kind}: {_short(e.message)})" for b, e in outcomes[name].items()
                  if isinstance(e, Failed)]
        if not traced:  # the plan's own trace of the technique says why, with the first; the others here
            chosen[name] = candidates[0]
            notes.append(f"{name}: each choice of blocks raised: {'; '.join(failed)}")
            continue
        # the lowest peak, and of equal peaks the fastest (Whisper's both stacks, its encoder layers alone and its
        # attention peaked alike, 1.22x, 1.05x and 1.15x: the first was taken, a helper's run)
        chosen[name] = min(traced, key=lambda b: (traced[b].peak_bytes, cost.step_seconds(traced[b].work)))
        estimates[(name,)] = traced[chosen[name]]
        said = [f"{blocks_name(b)} {format_bytes(e.peak_bytes)}" for b, e in traced.items()]
        said += [f"{what} left out" for what in failed]
        notes.append(f"{name}: blocks {blocks_name(chosen[name])}, the lowest predicted peak of {'; '.join(said)}")
    return chosen, estimates


def _short(message: str, width: int = 300) -> str:
    return textwrap.shorten(message, width, placeholder=" ...")


def _blocks_of(combo: tuple[str, ...], blocks: dict[str, Blocks]) -> Blocks:
    return next((blocks[name] for name in _BLOCKWISE if name in combo and name in blocks), ())


def _check_one_model(estimates: dict[tuple[str, ...], _Estimate]) -> None:
    """Every plan traced the same model: a factory building another one per call (a random width) had each plan
    traced on its own model and ranked against the others, silently (found by an adversarial pass on 2026-12-02)."""
    plain = estimates[()].model_shape
    for combo, estimate in estimates.items():
        if estimate.model_shape != plain:
            differ = next(((a, b) for a, b in zip(plain, estimate.model_shape) if a != b), None)
            detail = (f"{differ[0][0]} {list(differ[0][1])} {differ[0][2]} against {list(differ[1][1])} "
                      f"{differ[1][2]}" if differ is not None else
                      f"{len(plain)} parameters against {len(estimate.model_shape)}")
            raise InvalidInputError(
                f"{_API}: the model factory built another model for plan '{'+'.join(combo)}' than for the plain "
                f"step ({detail}). Expected the same model from every call: each plan is traced on a model of its "
                "own. To fix: make the factory build one architecture (seed or fix any choice it draws), or pass "
                "the model itself.")


def _warn_if_numbers_change(result: Plans, left: list[str]) -> None:
    """Say it where the best plan changes the numbers (low-bit state): shown only in the table's column and a note,
    it was applied unremarked, where a plan left out for a reason the user can fix (HF's default use_cache=True
    leaves checkpointing out) would have kept training bitwise in the same budget (found by an adversarial pass).
    ``left``: why each combination that keeps the numbers was left out."""
    best = result.best
    if best.numerics != "changed":
        return
    fix = (f" Left out, and maybe fixable: {'; '.join(left)}." if left else
           " A larger budget or a smaller batch keeps them.")
    warnings.warn(
        f"{_API}: the best plan that fits {format_bytes(result.budget)}, {best.name}, changes training's numbers "
        f"(low-bit optimizer state): no plan that keeps them fits.{fix}", UserWarning, stacklevel=3)


def _plain(estimate: Callable[[tuple[str, ...]], _Estimate], example_inputs: Any) -> _Estimate:
    """The plain step's estimate; its failure is the user's model, input, loss or optimizer, said as such."""
    try:
        return estimate(())
    except MemtrimError:
        raise
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise InvalidInputError(
            f"{_API}: the training step (the forward, the loss or the optimizer's step) reads values that a fake "
            f"trace does not have ({' '.join(str(e).split())}): a loss whose output shape depends on values "
            "(F.ctc_loss), an optimizer step that branches on a value (transformers' Adafactor), or the model. "
            "A trace knows the example batch, buffers and, for a model passed itself (not a factory), its vector "
            "parameters as given (memtrim.convert's LayerNorm, RMSNorm and BatchNorm+LeakyReLU decide from those), "
            "but not a branch on one after the optimizer's step has moved it, a weight matrix, anything a factory "
            "initialised, nor activations (memtrim's BatchNorm+ELU decides from its output), so a shape that depends "
            "on them (a mixture of experts routing tokens with nonzero or a boolean mask, a data-dependent loop) "
            "cannot be traced. Pass the model itself, or plan the model before converting it; a model whose own "
            "forward makes such shapes from its activations cannot be planned, nor a step whose loss or optimizer "
            "reads values (measure it with memtrim.track)."
        ) from e
    except Exception as e:
        outside = "convert all Tensors to FakeTensors" in str(e)
        called = ("model(**example_inputs)" if isinstance(example_inputs, dict) else
                  "model(*example_inputs)" if isinstance(example_inputs, (tuple, list)) else "model(example_inputs)")
        unpacked = (f"plan called {called}; a forward that takes the {type(example_inputs).__name__} as one "
                    "argument needs example_inputs=(batch,). " if isinstance(e, TypeError)
                    and isinstance(example_inputs, (dict, list)) else "")
        raise InvalidInputError(
            f"{_API}: the plain training step failed when traced on fake tensors: {type(e).__name__}: "
            f"{' '.join(str(e).split()).rstrip('.')}. " + (
                "The step read a real tensor that is not a parameter or buffer of the model nor part of the example "
                "batch: a tensor a module holds as a plain attribute (self.mask = torch.tril(...)), or a module or "
                "tensor the loss_fn or the forward holds from outside (a GAN's discriminator in the generator's "
                "loss). The trace makes the model's parameters and buffers and the batch fake, nothing else. To fix: "
                "register such a tensor as a buffer (self.register_buffer('mask', ..., persistent=False)), pass a "
                "factory that builds the model (it is built under FakeTensorMode), or make an outside module part "
                "of the planned model, e.g. memtrim.plan(nn.Sequential(G, D), z, loss_fn, lambda m: "
                "torch.optim.Adam(m[0].parameters()), ...)." if outside else
                unpacked + "Check that model(example_inputs), loss_fn(output, targets) and optimizer_factory(model) "
                "run for real. Where they do, an op's fake kernel refuses what its real kernel takes (torch's fake "
                "_grouped_mm takes bfloat16 only, where its CPU kernel takes float32: HF's mixture-of-experts "
                "layers): the planner cannot trace that model in that dtype; measure it with memtrim.track.")
        ) from e


_NUMERICS_ORDER = {"bitwise": 0, "tolerance": 1, "changed": 2}


def _sliced_inputs(example_inputs: Any) -> str:
    """What to do where no plan fits: lower the batch; or, where the example inputs are views of storages far larger
    than they read (a batch sliced from a preloaded dataset, counted whole: it is held), copy them first (a 200 KB
    batch of a 179 MiB dataset was told to lower the batch: an adversarial pass on 2026-12-03)."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor)]
    held = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors if t.layout == torch.strided}
    read = sum(t.numel() * t.element_size() for t in tensors)
    if sum(held.values()) > 2 * read + (1 << 20):
        return (f"The example inputs read {format_bytes(read)} but view storages of {format_bytes(sum(held.values()))}"
                ", which count whole (they are held: a batch sliced from a preloaded dataset?); copy the batch "
                "(x[i:j].clone()) to plan the step alone, or lower the batch or sequence length.")
    return "Lower the batch or sequence length, or add memory."


_LOSSIER = {"state_bf16": 1, "state_8bit": 2, "state_4bit": 3}  # the low-bit optimizer states, least lossy first


def _state_of(plan: Plan) -> str:
    """The low-bit optimizer state ``plan`` uses ("" for none)."""
    return next((t for t in plan.techniques if t in _LOSSIER), "")


def _ranked(plans: list[Plan], limit: int, dev: torch.device, cost: DeviceCost, notes: list[str],
            plain_peak: int, advice: str) -> Plans:
    # (among plans that change the numbers, the least lossy optimizer state first, then the fastest: the time model
    # ranked 8-bit state above bfloat16 where both fit, until 2026-12-03, found by an adversarial pass)
    fitting = sorted((p for p in plans if p.fits),
                     key=lambda p: (_NUMERICS_ORDER[p.numerics], _LOSSIER.get(_state_of(p), 0),
                                    round(p.time_ratio, 3), p.peak_bytes))
    rejected = sorted((p for p in plans if not p.fits), key=lambda p: p.peak_bytes)
    result = Plans(fitting, rejected, limit, str(dev), cost, notes)
    if not fitting:
        closest = rejected[0]
        raise PlanError(
            f"{_API}: no plan fits {format_bytes(limit)}. The closest, {closest.name}, peaks at "
            f"{format_bytes(closest.peak_bytes)} ({format_bytes(closest.peak_bytes - limit)} over; the plain step "
            f"{format_bytes(plain_peak)}). {advice}",
            plans=result,
        )
    return result


def _check_depth(depth: Any, model_or_factory: Any) -> None:
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 3
                              or isinstance(model_or_factory, nn.Module) or not accepts(model_or_factory, 1)):
        raise InvalidInputError(
            f"{_API}: depth must be an int >= 3 with model_or_factory a function of the number of blocks, got "
            f"depth={depth!r} and {_describe(model_or_factory)}."
        )
    if depth is None and not isinstance(model_or_factory, nn.Module) and not accepts(model_or_factory, 0):
        raise InvalidInputError(
            f"{_API}: a model factory must be callable with no arguments, got {_describe(model_or_factory)} (with "
            "depth=N it is called with the number of blocks)."
        )


def _describe(fn: Any) -> str:
    try:
        return f"{type(fn).__name__} with signature {inspect.signature(fn)}"
    except (TypeError, ValueError):
        return type(fn).__name__


def _usable(names: list[str], dev: torch.device, depth: int | None, notes: list[str]) -> list[str]:
    """The technique names that can be planned for ``dev``; notes say what was left out and how tracing differs."""
    if dev.type == "cuda" and not torch.cuda.is_available():
        notes.append(
            "traced with CPU kernels for a CUDA target: attention with dropout takes the math path on CPU and "
            "keeps the full score matrix, so such models are over-estimated; allocator rounding (512 B blocks) "
            "is not modelled"
        )
    if depth is not None:
        notes.append(f"peaks extrapolated linearly from traces with 2 and 3 blocks to {depth} blocks")
    out = list(names)
    for name in ("offload", "offload_state"):
        if name in out and dev.type in ("cpu", "meta"):
            out.remove(name)
            notes.append(f"{name}: left out; on {dev.type} host memory is the device's")
    if "selective" in out and not selective_available():
        out.remove("selective")
        notes.append(f"selective: left out; torch {torch.__version__} has no selective checkpointing (torch >= 2.5)")
    return out


@dataclass(frozen=True)
class _Estimate:
    peak_by_category: dict[str, int]
    peak_phase: str
    work: Work
    notes: tuple[str, ...]
    model_shape: tuple[Any, ...] = ()  # the traced model's parameters (StepTrace.model_shape)

    @property
    def peak_bytes(self) -> int:
        return sum(self.peak_by_category.values())

    @classmethod
    def of(cls, trace: StepTrace) -> _Estimate:
        report = trace.report
        return cls(dict(report.peak_by_category), report.peak_phase, trace.work, trace.notes, trace.model_shape)


def _estimate(model_or_factory: Any, inputs: Any, targets: Any, loss_fn: Any, optimizer_factory: Any,
              combo: tuple[str, ...], depth: int | None, loop: Loop = STANDARD_LOOP,
              blocks: Blocks = (), device: torch.device | None = None) -> _Estimate:
    techniques = [TECHNIQUES[n] for n in combo]
    if depth is None:
        return _Estimate.of(trace_step(model_or_factory, inputs, targets, loss_fn, optimizer_factory, techniques,
                                       loop=loop, blocks=blocks, device=device))
    two, three = (_Estimate.of(trace_step(functools.partial(model_or_factory, n), inputs, targets, loss_fn,
                                          optimizer_factory, techniques, loop=loop, blocks=blocks, device=device))
                  for n in (2, 3))
    more = depth - 3

    def grow(a: int, b: int) -> int:
        return b + (b - a) * more

    return _Estimate(
        {k: grow(two.peak_by_category.get(k, 0), v) for k, v in three.peak_by_category.items()},
        three.peak_phase, three.work.extrapolate(two.work, more), three.notes, three.model_shape,
    )


def _aside_in_checkpoints(model_or_factory: Any) -> list[str]:
    """The modules of a model passed itself that compute otherwise inside a checkpointed region: memtrim.convert's
    norms rebuilt from their output run as torch's own there (a rounding apart: guards.saves_checked). A factory's
    model is not built here (it is unconverted as a rule)."""
    if not isinstance(model_or_factory, nn.Module):
        return []
    from ..techniques.convert.norms import _FORMS
    from ..techniques.norms import LayerNorm, RMSNorm

    kinds = (LayerNorm, RMSNorm, *_FORMS.values())
    return [name for name, m in model_or_factory.named_modules() if isinstance(m, kinds)]


def _plan(combo: tuple[str, ...], estimate: _Estimate, base: float, cost: DeviceCost, limit: int,
          aside: list[str], loop: Loop = STANDARD_LOOP, blocks: Blocks = ()) -> Plan:
    numerics = max((TECHNIQUES[n].numerics for n in combo), key=_NUMERICS_ORDER.__getitem__, default="bitwise")
    notes = estimate.notes
    if aside and numerics == "bitwise" and {"checkpoint", "selective"}.intersection(combo):
        numerics = "tolerance"
        notes = (*notes, f"tolerance: the checkpointed blocks run memtrim.convert's rebuilt norms ({aside[0]}"
                         f"{f' and {len(aside) - 1} more' if len(aside) > 1 else ''}) as torch's own ops, a rounding "
                         "apart from the converted model's training")
    return Plan(
        techniques=combo,
        peak_bytes=estimate.peak_bytes,
        peak_by_category=estimate.peak_by_category,
        peak_phase=estimate.peak_phase,
        time_ratio=cost.step_seconds(estimate.work) / base,
        numerics=numerics,
        fits=estimate.peak_bytes <= limit,
        notes=notes,
        clip_grad_norm=loop.clip_grad_norm,
        blocks=blocks,
    )


def _loop(accumulation_steps: Any, clip_grad_norm: Any) -> Loop:
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise InvalidInputError(f"{_API}: accumulation_steps must be an int >= 1 (micro-batches per optimizer step), "
                                f"got {accumulation_steps!r}.")
    if clip_grad_norm is not None and (isinstance(clip_grad_norm, bool) or not isinstance(clip_grad_norm, (int, float))
                                       or not math.isfinite(clip_grad_norm) or clip_grad_norm <= 0):
        raise InvalidInputError(f"{_API}: clip_grad_norm must be a positive finite number (the max_norm the loop "
                                f"clips to) or None, got {clip_grad_norm!r}.")
    return Loop(accumulation_steps, None if clip_grad_norm is None else float(clip_grad_norm))


__all__ = ["Plan", "Plans", "Technique", "combinations", "parse_bytes", "plan"]

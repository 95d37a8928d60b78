"""``memtrim.convert``: swap in modules that keep less for backward, only where provably the same function and
nothing else uses the replaced tensor, and report what each change saved.

NOTE [ how convert decides ]
* Evidence (NOTE [ convert's evidence ] in evidence.py): a traced training-mode forward on ``example_inputs``
  (every call site, every op's storages, everything autograd saves), or, without example inputs, the torch.fx graph
  where the model traces.
* Rules (NOTE [ convert's rules ] in rules.py; the built-in ones in builtin.py and norms.py) match on that
  evidence and yield candidates: a change with its reason, or a skip with its reason. Pairs need evidence that the
  first module's output goes to the second and nowhere else; single modules are the same function whatever
  surrounds them; norms are recognised by their traced ops, whatever their class.
* Modules are converted in place by changing their class (same parameters, buffers, hooks and state_dict keys), so
  an optimizer built before ``convert`` keeps working and a state_dict loads into the unconverted class. A module
  absorbed into its neighbour becomes an :class:`Absorbed` identity the same way, so every name it is registered
  under and every reference to it see the change.
* Hooks: a pair is not fused when either module has forward, forward pre-, backward or backward pre-hooks; one
  added to a fused module later, where it would see a value fusion changed, raises at the call
  (``guards.refuse_later_hooks``).
* What breaks a converted module, and what convert checks: an output-keeping module's output must not be changed
  in place before backward (the traced forward sees every in-place write, and such modules are skipped; without
  example inputs backward raises ``ConvertError`` naming the module). Rebuilt norms have no second derivative
  (``Change.limits``). Under torch.compile and torch.func every converted module runs as torch's own ops (no graph
  break), and so do the rebuilt norms under autocast. Tracing and measuring leave the global (and
  CUDA) RNG, parameters and buffers as they were, and copy no parameter.
* Savings are measured, not estimated: the activation bytes autograd keeps after a forward on the example inputs,
  by the tracker, before and after each change, or after a built-in rule's changes together where they save what
  their trace expects (NOTE [ changes measured together ]). A change that saves nothing is undone and reported as
  skipped.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ...errors import InvalidInputError
from ...measure import track
from ...measure.hooks import compiled_module, tensors_in
from ...proof.compare import bitwise_equal
from .._generators import GeneratorsKept, cuda_devices, held_generators_kept, seeded
from .._modes import set_training_flags, training_flags
from ..guards import CONVERTED, DECISIONS_END, keep_hook_ids, module_hooks, register_end_hook
from ..norms._kernels import DecidedTogether
from ..offload._core import _MARK as _OFFLOADED
from . import builtin as _builtin  # noqa: F401  (registers the built-in rules)
from .evidence import buffers_kept, collect, fresh_inputs, fx_evidence, split_inputs
from .report import Change, ConversionReport, Skipped
from .rules import Candidate, Context, Undo, chain, registered_rules

__all__ = ["activation_bytes", "convert"]


def _no_gain(cand: Candidate, saved: int, how: str) -> str:
    """The skip reason of a change that saves nothing: how many bytes it would keep beyond what it drops."""
    gain = "would save nothing" if saved == 0 else f"would keep {-saved:,} B more than it drops"
    return f"{cand.before} -> {cand.after} {gain} ({how}): not applied"


def convert(
    model: nn.Module,
    *,
    example_inputs: torch.Tensor | tuple[Any, ...] | dict[str, Any] | None = None,
    example_kwargs: dict[str, Any] | None = None,
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> tuple[nn.Module, ConversionReport]:
    """Convert ``model`` in place to modules that keep less for backward; return it with a report.

    Why: most of a model's activation memory is what autograd keeps between forward and backward; replacing the
    modules that keep their input when their output is kept anyway (and fusing pairs) keeps less, computing the
    same function. Every change is proven on traced evidence and measured; ``memtrim.verify`` checks training stays
    equal (see tests).

    Args:
        model: any ``nn.Module``; converted in place (parameters, buffers and state_dict keys unchanged).
        example_inputs: a tensor, a tuple of arguments (``model(*example_inputs)``) or a dict of keyword arguments
            (``model(**example_inputs)``, as HF models take a batch); the evidence for the rules (else the torch.fx
            graph, where the model traces) and what each change's saving is measured on.
        example_kwargs: more keyword arguments for the example call (with a tensor or tuple ``example_inputs``).
        module_filter: ``module_filter(name, module)`` returning False leaves that module alone.

    Returns:
        ``(model, ConversionReport)``: every candidate a rule found is in the report, changed with its measured
        bytes or skipped with its reason.

    Raises:
        InvalidInputError: ``model`` is not a module, has uninitialized lazy parameters, was compiled (or holds a
            compiled module: convert first, then compile), offloaded (``offload_module``: convert first, then
            offload), wrapped by Opacus (convert first, then wrap) or TorchScript (convert first, then script), or
            the example inputs fail to run through it.

    Example::

        model, report = memtrim.convert(model, example_inputs={"input_ids": ids})
        print(report)

    See NOTE [ how convert decides ] in memtrim/techniques/convert/api.py.
    """
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"memtrim.convert: model must be an nn.Module, got {type(model).__name__}.")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise InvalidInputError(f"memtrim.convert: example_kwargs must be a dict, got {type(example_kwargs).__name__}.")
    refuse_lazy(model, "memtrim.convert")
    compiled = compiled_module(model)
    if compiled is not None:
        raise InvalidInputError(
            f"memtrim.convert: {compiled} was compiled (torch.compile or Module.compile()) before convert. The code "
            "torch.compile made before does not see the changed modules (a converted HF Llama then ran its norms "
            "outside the compiled graph, found by an adversarial pass). Expected an uncompiled model; to fix: "
            "convert first, then compile (model, report = memtrim.convert(model, ...); model.compile()).")
    scripted = next((name for name, m in model.named_modules() if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None:
        raise InvalidInputError(
            f"memtrim.convert: {'the model' if not scripted else f'the model module {scripted!r}'} is TorchScript "
            "(torch.jit.script or torch.jit.trace). Its code runs as TorchScript, which convert can neither trace "
            "(no hooks on a ScriptModule: torch raised \"register_forward_pre_hook is not supported\") nor change. "
            "Expected an eager model; to fix: convert the eager model first, then script or trace it (or use "
            "torch.compile).")
    offloaded = next((name for name, m in model.named_modules() if _OFFLOADED in m.__dict__), None)
    if offloaded is not None:
        raise InvalidInputError(
            f"memtrim.convert: {'the model' if not offloaded else f'the model module {offloaded!r}'} was offloaded "
            "(memtrim.offload_module) before convert. Its traced forward then shows offload's copies of what autograd "
            "saves, not the model's own ops, and convert would change nothing (HF Llama, GPT-2 and a ResNet: 0 "
            "changes, found by an adversarial pass). Expected a model without offloading; to fix: convert first, "
            "then offload (memtrim.convert(model, ...); memtrim.offload_module(model)), or call remove() on the "
            "offload handle, convert, and offload again.")
    opacus = _opacus(model)
    if opacus is not None:
        raise InvalidInputError(
            f"memtrim.convert: {opacus} comes from Opacus's per-sample-gradient machinery (GradSampleModule, "
            "PrivacyEngine.make_private). Opacus picks each module's per-sample-gradient rule by its class when it "
            "wraps the model; a module whose class convert changes afterwards has none there (Opacus then failed in "
            "backward with AttributeError '_forward_counter', found by an adversarial pass). Expected a model Opacus "
            "has not wrapped yet; to fix: convert first, then wrap (memtrim.convert(model, ...); "
            "GradSampleModule(model) or privacy_engine.make_private(module=model, ...)).")
    given = example_inputs is not None or bool(example_kwargs)
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    with as_training(model, args, kwargs):
        return _convert(model, args, kwargs, given, module_filter)


def refuse_lazy(model: nn.Module, api: str) -> None:
    """Raise where ``model`` has uninitialized lazy parameters: they have no shape to trace or measure yet."""
    lazy = [n for n, p in model.named_parameters() if is_lazy(p)]
    if lazy:
        raise InvalidInputError(f"{api}: {len(lazy)} parameters are uninitialized lazy parameters ({lazy[0]}, ...): "
                                f"run one forward of the model (which materialises them) before {api}.")


def _opacus(model: nn.Module) -> str | None:
    """What of ``model`` belongs to Opacus: a module of its classes (GradSampleModule, DPDDP), or hooks it registered
    on a module (a GradSampleModule's inner model passed alone), named for the message; None where nothing does."""
    def from_opacus(obj: Any) -> bool:
        while isinstance(obj, functools.partial):
            obj = obj.func
        return (getattr(obj, "__module__", None) or "").split(".")[0] == "opacus"

    for name, module in model.named_modules():
        where = f"the model's module {name!r}" if name else "the model"
        if from_opacus(type(module)):
            return f"{where} ({type(module).__name__})"
        if any(from_opacus(hook) for hook in module_hooks(module)):
            return f"a hook on {where}"
    return None


@contextlib.contextmanager
def as_training(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Tracing and measuring draw from no RNG (the global and CUDA generators, every torch.Generator the model passes
    to a torch call, Python's ``random`` and NumPy's global generator are restored after), and see what autograd keeps
    in training: grad on, even when called under torch.no_grad() or torch.inference_mode(). A forward that runs a
    backward of its own (a local loss) runs it here too: its gradients, and the hooks on them, see it (putting the
    gradients back broke a flat gradient buffer and a graph made with create_graph; README)."""
    numpy = sys.modules.get("numpy")  # imported by the user's code, or not at all
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=cuda_devices(model, (args, kwargs))), torch.inference_mode(False), \
                torch.enable_grad(), GeneratorsKept(), held_generators_kept(model):
            yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


def _refuse_collectives(evidence: Any, model: nn.Module) -> None:
    """Refuse a forward that runs torch.distributed collectives while ranks are running: convert's further forwards
    (one per batch of changes, more where one is measured again) are as many as the example's values make them, so
    the ranks' collectives would pair up wrongly (found by an adversarial pass: an MoE's expert-load all_reduce, 4
    forwards on one rank and 5 on the other; one rank trained on the other's convert-time values, silently)."""
    collectives = getattr(evidence, "collectives", None)
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if not collectives or not distributed or torch.distributed.get_world_size() < 2:
        return
    names = ", ".join(sorted(set(collectives)))
    from torch.nn.parallel import DistributedDataParallel

    wrapped = ("the model is a DistributedDataParallel, whose forward broadcasts its buffers: convert the module "
               "inside it (memtrim.convert(ddp_model.module, ...)); or " if isinstance(model, DistributedDataParallel)
               else "")
    raise InvalidInputError(
        f"memtrim.convert: the model's forward runs torch.distributed collectives ({names}) across "
        f"{torch.distributed.get_world_size()} ranks. convert runs the forward a number of times that "
        "depends on the example's values, so each rank's collectives would pair with another forward's on the other "
        "ranks (wrong values, silently, or a hang). Expected a forward without collectives; to fix: "
        f"{wrapped}convert before the collectives start (before wrapping the model in DistributedDataParallel or "
        "FSDP2's fully_shard, before SyncBatchNorm.convert_sync_batchnorm, or where the forward skips them without a "
        "process group), then wrap.")


# NOTE [ changes measured together ]
# Each change's saving is measured: the activation bytes a tracked forward on the example inputs leaves, before and
# after it. Measured after every change, that is a forward of the whole model per change, and convert's time grew with
# the square of the model's depth (benchmarks/convert_time.py: an HF Llama of 64 layers, d=64, 193 changes, 108.9 s at
# deb5f94; 4 layers 0.56 s; measured together, 3.9 s and 0.22 s). Most built-in rules know from the trace what their
# change drops (``Candidate.expected_bytes``); on the models of benchmarks/convert_zoo.py the measured saving equals
# it for every change but those whose bytes depend on an earlier change (the trace is of the unconverted model: HF
# Llama's embeddings, which its converted norms no longer keep). So a built-in rule's changes that expect a saving are
# applied one after another and measured together: once per rule, and before any change measured alone (a user's
# rule's; one with no expectation); where some of them must leave the training step alone (an in-place activation made
# out of place), the step is compared once for the batch too. Where the batch's measured saving is the sum of what its
# changes expected (and the step is the same), each is reported with its expected bytes. Where it is not, or the
# forward fails, the batch is undone and measured again one change at a time, each applied again and kept only where
# it saves bytes, as convert measures every change otherwise. The report is then the one measuring every change gives,
# except where a change other than a batch's last is undone there: the rule chose the changes after it with that one
# applied (a module it claimed, a class it swapped), so convert undoes everything and starts over, measuring each
# change alone (a rule's ``match`` then runs twice). What a batch's sum cannot tell: a change that saves nothing
# beside one that saves exactly that much more than its rule expected; both are kept and reported at their expected
# bytes.
class _StartOver(Exception):
    """A change measured again alone saved nothing, and its rule chose later changes of its batch with it applied:
    convert starts over, measuring each change alone (NOTE [ changes measured together ])."""


def _convert(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], given: bool,
             module_filter: Callable[[str, nn.Module], bool] | None) -> tuple[nn.Module, ConversionReport]:
    evidence = collect(model, args, kwargs) if given else fx_evidence(model)
    _refuse_collectives(evidence, model)
    measure = (lambda: activation_bytes(model, args, kwargs)) if given else None
    before = measure() if measure is not None else None
    conversion = _Conversion(model, evidence, measure, before, args, kwargs, module_filter, together=given)
    try:
        report = conversion.run()
    except _StartOver:
        for undo in reversed(conversion.undos):
            undo()
        report = _Conversion(model, evidence, measure, before, args, kwargs, module_filter, together=False).run()
    _decide_together(model)
    return model, report


class _Conversion:
    """One pass of every registered rule over the model: each candidate applied or skipped, its saving measured
    after it, or (``together``) with the others of its batch (NOTE [ changes measured together ])."""

    def __init__(self, model: nn.Module, evidence: Any, measure: Callable[[], int] | None, before: int | None,
                 args: tuple[Any, ...], kwargs: dict[str, Any],
                 module_filter: Callable[[str, nn.Module], bool] | None, together: bool) -> None:
        self.model, self.evidence, self.measure, self.args, self.kwargs = model, evidence, measure, args, kwargs
        self.module_filter, self.together = module_filter, together
        self.ctx = Context.of(model, evidence, measured=measure is not None)
        self.current = before
        self.before = before
        self.changes: list[Change] = []
        self.skipped: list[Skipped] = []
        self.undos: list[Undo] = []  # each applied change's undo, in order
        # applied since the last measure, expecting their bytes; with where a skip of each would stand in the report
        self.batch: list[tuple[Candidate, str, int]] = []
        self.at: int | None = None  # where _skip puts a skip (None: last); measured again alone, the change's place
        self.reference: list[torch.Tensor] | None = None  # a training step's outputs, buffers, gradients
        self.batch_reference = False  # the reference was made with some of the batch applied

    def run(self) -> ConversionReport:
        """Every rule's candidates, in order; the report."""
        ctx, earlier = self.ctx, _converted_earlier(self.model)
        for rule in registered_rules():
            builtin = rule.match.__module__.startswith("memtrim.")
            for cand in rule.match(ctx):
                if earlier.intersection(_touched(cand, ctx)):  # a second convert: say so, not what rules make of it
                    if not any(s.modules == cand.modules and s.reason == _EARLIER for s in self.skipped):
                        self.skipped.append(Skipped(cand.modules, _EARLIER, rule.name))
                    continue
                if cand.skip:
                    self.skipped.append(Skipped(cand.modules, cand.reason, rule.name))
                    continue
                if not ctx.free(*cand.targets, stacks_on=cand.stacks_on):
                    continue
                excluded = _excluded(cand, ctx.aliases, self.module_filter)
                if excluded is not None:
                    self.skipped.append(Skipped((excluded,), "excluded by module_filter", rule.name))
                    continue
                if self.measure is not None and cand.expected_bytes is not None and cand.expected_bytes <= 0:
                    reason = _no_gain(cand, cand.expected_bytes, "by the trace of the example inputs")
                    self.skipped.append(Skipped(cand.modules, reason, rule.name))
                    continue
                assert cand.apply is not None, f"rule {rule.name} yielded a change without apply"
                if cand.same_outputs and self.measure is None:
                    self.skipped.append(Skipped(cand.modules, f"{cand.before} -> {cand.after} is checked on "
                                                              "example_inputs, and none were given: not applied",
                                                rule.name))
                    continue
                if self.together and builtin and cand.expected_bytes is not None:
                    if cand.same_outputs and self.reference is None:
                        if not self._step_before(cand, rule.name):
                            continue
                        self.batch_reference = True
                    self._accept(cand, rule.name, cand.apply(), cand.expected_bytes)
                    self.batch.append((cand, rule.name, len(self.skipped)))
                    continue
                self._measure_batch()
                self._apply_alone(cand, rule.name)
            self._measure_batch()
        notes = []
        if earlier:
            notes.append(f"{len(earlier)} modules were changed by an earlier memtrim.convert and are left as they are")
        if self.measure is None:
            notes.append("no example_inputs: pairs " + ("proven from the torch.fx graph" if self.evidence is not None
                                                         else "skipped (the model does not trace with torch.fx)")
                         + "; savings not measured; in-place changes of outputs found only at backward")
        return ConversionReport(self.changes, self.skipped, self.before, self.current, notes)

    def _accept(self, cand: Candidate, rule: str, undo: Undo, saved: int | None) -> None:
        """Keep an applied change: its targets claimed and marked converted, its undo (which forgets both) kept."""
        claims = [(t, self.ctx.claimed.get(id(t)), t.__dict__.get(CONVERTED)) for t in cand.targets]
        self.ctx.claimed.update((id(t), rule) for t in cand.targets)
        for target in cand.targets:
            target.__dict__[CONVERTED] = rule
        self.undos.append(chain(undo, functools.partial(_unclaim, self.ctx, claims)))
        self.changes.append(Change(cand.modules, cand.before, cand.after, saved, cand.limits, rule, cand.bitwise))

    def _measure_batch(self) -> None:
        """Measure the changes applied since the last measure together; where they did not save what they
        expected, measure them again one at a time (NOTE [ changes measured together ])."""
        batch, self.batch = self.batch, []
        made_in_batch, self.batch_reference = self.batch_reference, False
        if not batch:
            return
        assert self.measure is not None and self.current is not None
        expected = sum(cand.expected_bytes for cand, _, _ in batch)  # type: ignore[misc]
        after: int | None
        try:
            after = self.measure()
            if any(cand.same_outputs for cand, _, _ in batch):
                assert self.reference is not None
                if not _bitwise_same(self.reference, step_effects(self.model, self.args, self.kwargs)):
                    after = None
        except Exception:  # (measured again alone, the failing change says why)
            after = None
        if after is not None and self.current - after == expected:
            self.current = after
            return
        if made_in_batch:  # made again where measuring alone makes it
            self.reference = None
        for _ in batch:
            self.undos.pop()()
            self.changes.pop()
        for i, (cand, rule, at) in enumerate(batch):
            assert cand.apply is not None
            self.at = at  # (a skip here is the last change's: the skips the rule made after it follow it)
            try:
                kept = self._apply_alone(cand, rule)
            finally:
                self.at = None
            if not kept and i < len(batch) - 1:
                raise _StartOver

    def _skip(self, skipped: Skipped) -> None:
        """Report a change left alone: last, or where measuring every change alone would have put it."""
        if self.at is None:
            self.skipped.append(skipped)
        else:
            self.skipped.insert(self.at, skipped)

    def _step_before(self, cand: Candidate, rule: str) -> bool:
        """Make the reference a change that must leave the training step alone is compared with: the step of the
        model with every change so far. False, with ``cand`` skipped and why, where that step fails."""
        try:
            self.reference = step_effects(self.model, self.args, self.kwargs)
        except Exception as e:  # the model's own step fails (autograd's in-place check): nothing to match
            self._skip(Skipped(cand.modules, f"{cand.before} -> {cand.after} is checked against a training "
                                                      "step and an evaluation forward on the example inputs, which "
                                                      f"failed ({type(e).__name__}: {e}): not applied", rule))
            return False
        return True

    def _apply_alone(self, cand: Candidate, rule: str) -> bool:
        """Apply ``cand`` and measure it (with a training step compared, where it asks for one); keep it where it
        saves bytes, else undo it and say why. Whether it was kept."""
        assert cand.apply is not None
        measure, args, kwargs = self.measure, self.args, self.kwargs
        if cand.same_outputs and self.reference is None and not self._step_before(cand, rule):
            return False
        undo = cand.apply()
        if measure is None:
            self._accept(cand, rule, undo, None)
            return True
        try:
            after = measure()
        except Exception as e:  # a change must never leave the model broken: undo it and say why
            undo()
            self._skip(Skipped(cand.modules, f"{cand.before} -> {cand.after} failed on the example inputs "
                                                      f"({type(e).__name__}: {e}): not applied", rule))
            return False
        if cand.same_outputs:
            assert self.reference is not None
            try:
                same = _bitwise_same(self.reference, step_effects(self.model, args, kwargs))
            except Exception:  # the changed model's step fails where the model's own did not
                same = False
            if not same:
                undo()
                self._skip(Skipped(cand.modules, f"{cand.before} -> {cand.after} changed the model's "
                                                          "outputs, buffers or gradients on the example inputs "
                                                          "(something reads the activation's input after it, or its "
                                                          "in-place op takes the gradient from its output, as torch's "
                                                          "elu_ does): not applied", rule))
                return False
        saved = self.current - after  # type: ignore[operator]
        if saved <= 0:
            undo()
            self._skip(Skipped(cand.modules, _no_gain(cand, saved, "measured on the example inputs"), rule))
            return False
        self.current = after
        self._accept(cand, rule, undo, saved)
        return True


def _unclaim(ctx: Context, claims: list[tuple[nn.Module, str | None, str | None]]) -> None:
    """Give ``ctx``'s claims and the converted marks of a change's targets back as they were before it."""
    for target, claimed, mark in reversed(claims):
        if claimed is None:
            ctx.claimed.pop(id(target), None)
        else:
            ctx.claimed[id(target)] = claimed
        if mark is None:
            target.__dict__.pop(CONVERTED, None)
        else:
            target.__dict__[CONVERTED] = mark


_DECISIONS = "_memtrim_keep_decisions"


def _decide_together(model: nn.Module) -> None:
    """Where ``model`` has norms that decide which features keep their input, let them decide together once per
    forward of ``model`` (NOTE [ keep decisions made together ] in norms/_kernels.py): one wait for the GPU a forward
    instead of one a norm. Once per model (a second convert adds nothing)."""
    if _DECISIONS in model.__dict__ or not any(getattr(m, "memtrim_keep_decisions", False) for m in model.modules()):
        return
    decisions = model.__dict__[_DECISIONS] = DecidedTogether()
    keep_hook_ids(model)
    model.register_forward_pre_hook(decisions.enter)
    register_end_hook(model, decisions.leave, DECISIONS_END)


_EARLIER = "changed by an earlier memtrim.convert: left as it is"


def _converted_earlier(model: nn.Module) -> set[int]:
    """The ids of ``model``'s modules an earlier :func:`convert` changed (copies and pickles keep the mark)."""
    return {id(m) for m in model.modules() if CONVERTED in m.__dict__}


def _touched(cand: Candidate, ctx: Context) -> set[int]:
    """The ids of the modules a candidate names or targets (a call site ``path#k`` names its module)."""
    named = (ctx.modules.get(name.split("#")[0]) for name in cand.modules)
    return {id(m) for m in (*cand.targets, *named) if m is not None}


def _excluded(cand: Candidate, aliases: dict[int, list[str]],
              module_filter: Callable[[str, nn.Module], bool] | None) -> str | None:
    """The first name of the first target (or module it touches) ``module_filter`` refuses (under any of its names),
    or None."""
    if module_filter is None:
        return None
    for module in (*cand.targets, *cand.touches):
        names = aliases.get(id(module), [])
        if not all(module_filter(n, module) for n in names):
            return names[0] if names else type(module).__name__
    return None


@contextlib.contextmanager
def _example_forward(model: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Iterator[tuple[tuple[Any, ...], dict[str, Any]]]:
    """Fresh copies of the example inputs, for a training-mode forward whose dropout is drawn from a fixed seed and
    whose buffer updates are undone after."""
    args, kwargs = fresh_inputs(args, kwargs)
    with buffers_kept(model), seeded(model, args, kwargs):
        model.train()
        yield args, kwargs


def step_effects(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """What a training step of ``model`` on the example inputs makes: the forward's outputs, every buffer and every
    plain tensor a module keeps as an attribute after it, and every trainable parameter's gradient of a fixed random
    weighting of the outputs (dropout and the weights drawn from fixed seeds; buffers restored after, ``.grad`` left
    alone), detached; then the outputs of an evaluation forward under ``no_grad`` (a dropout returns its input itself
    there: an alias of the activation's input, read after it, showed in evaluation only; found by an adversarial pass
    on 2026-12-03)."""
    params = [p for p in model.parameters() if p.requires_grad]
    with _example_forward(model, args, kwargs) as (args, kwargs):
        outputs = tensors_in(model(*args, **kwargs))
        found = [t.detach().clone() for t in (*outputs, *model.buffers(), *_kept_by_modules(model))]
        differentiable = [t for t in outputs if t.requires_grad]
        if differentiable and params:
            weights = [torch.randn_like(t) if t.is_floating_point() else torch.ones_like(t) for t in differentiable]
            grads = torch.autograd.grad(differentiable, params, weights, allow_unused=True)
            found += [g if g is not None else torch.zeros(0) for g in grads]
        flags = training_flags(model.modules())
        try:
            model.eval()
            with torch.no_grad():
                found += [t.detach().clone() for t in tensors_in(model(*args, **kwargs))]
        finally:
            set_training_flags(flags)
    return found


def _kept_by_modules(model: nn.Module) -> list[torch.Tensor]:
    """The plain tensors the modules keep as attributes after a forward (``self.last = out``: a feature extractor's
    store, which an in-place activation after it overwrote; out of place it kept the values before the activation,
    silently, until 2026-12-03: an adversarial pass)."""
    return [value for module in model.modules() for name, value in vars(module).items()
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not name.startswith("_")]


def _bitwise_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(bitwise_equal(x, y) for x, y in zip(a, b))


def activation_bytes(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """Activation bytes autograd keeps after one training-mode forward of ``model(*args, **kwargs)`` (tracker's
    "activations"); buffers restored after, parameters never copied, dropout drawn from a fixed seed."""
    with _example_forward(model, args, kwargs) as (args, kwargs):
        with track(model) as tracker:
            out = model(*args, **kwargs)
            held = tracker.live_by_category()["activations"]
        del out
    return held

"""The equivalence harness: train a baseline and a transformed copy side by side and compare everything."""

from __future__ import annotations

import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.parameter import is_lazy

from .._signatures import accepts, call_model, not_owned, scalar_loss
from ..errors import InvalidInputError, MemtrimError, VerifyError
from .compare import compare_tensors

__all__ = ["Divergence", "VerifyReport", "verify"]


@dataclass(frozen=True)
class Divergence:
    """Where the transformed run first differed from the baseline."""

    step: int
    tensor: str  # "loss", "batch:<i>" (what the step left in its batch), "grad:<param>", "rng:cpu" (the generator
    # after the step), "param:<name>", "buffer:<name>"
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
    ``first_difference``: the first tensor not bitwise equal (None if bitwise). ``grads_compared``: whether
    ``.grad`` was compared after each backward (not with :class:`~memtrim.OptimizerInBackward`, which frees
    gradients inside backward by design); ``notes`` says what was left out and why.
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
    grads_compared: bool = True
    notes: tuple[str, ...] = ()

    def assert_ok(self) -> None:
        """Raise :class:`VerifyError` naming the first divergence unless ``ok``."""
        if not self.ok:
            raise VerifyError(
                f"memtrim.verify: the transformed run diverged from the baseline at {self.first_divergence}."
            )

    def __str__(self) -> str:
        steps = f"{self.steps} step{'' if self.steps == 1 else 's'}"
        if self.bitwise:
            text = f"equal: bitwise over {steps}"
        elif self.ok:
            text = (
                f"equal within tolerance over {steps} (max abs {self.max_abs_error:.3e}, "
                f"max rel {self.max_rel_error:.3e}; first difference at {self.first_difference})"
            )
        else:
            text = f"DIVERGED at {self.first_divergence}"
        return text + "".join(f" ({note})" for note in self.notes)


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
    compare_grads: bool | None = None,
) -> VerifyReport:
    """Train a baseline and a transformed copy from the same seed on the same batches; compare each step.

    Why: a memory technique is only useful if it does not change training. After every step this compares
    the loss, every gradient (after backward) and every parameter, buffer and optimizer-state tensor (after
    the optimizer step).

    Args:
        make_model: builds a new model on each call (a class or a function); called after seeding with ``seed``
            for each run (the CPU generator, and CUDA's once it has started). The two models must share no parameter
            or buffer.
        make_optimizer: ``make_optimizer(model)`` builds the optimizer for that model. One whose step needs a
            closure (``torch.optim.LBFGS``) is stepped with one that runs the step's forward and backward again.
        batches: ``(inputs, targets)`` pairs (inputs a tensor, a tuple of positional arguments or a dict of keyword
            arguments: ``model(**inputs)``); both runs see the same.
        loss_fn: ``loss_fn(output, targets)`` returns a scalar.
        transform: ``transform(model, optimizer)`` returns the (model, optimizer) to train instead.
        steps: how many batches to use (default: all).
        rtol, atol: tolerance per element, ``|a - b| <= atol + rtol * |b|``. The default is exact equality.
        seed: the seed for building each model and, plus the step number, for each step (dropout etc.).
        compare_grads: compare ``.grad`` after backward. ``None`` (default): yes, unless the transformed
            optimizer is a :class:`~memtrim.OptimizerInBackward` (it frees each gradient inside backward by
            design, so its updates are compared through the parameters and optimizer state instead; the
            report says so). Its backward is ``optimizer.backward(loss)``, which also covers clipping by norm.

    Returns:
        A :class:`VerifyReport`. Training stops at the first divergence outside tolerance.

    Raises:
        InvalidInputError: an argument of the wrong kind (a model instead of a factory, an optimizer class,
            batches that are not pairs, ...), no batches, models or optimizers shared between the two runs, or
            models whose parameters cannot be matched by name or by position and shape.

    Example::

        report = memtrim.verify(SeedMLP, lambda m: torch.optim.Adam(m.parameters()), batches, F.nll_loss,
                                lambda m, o: (memtrim.convert(m)[0], o), steps=10)
        assert report.bitwise
    """
    # Over 60 lines for its docstring (Args, Returns, Raises, Example); the body is the step loop, ~40 lines.
    batch_list = _check_arguments(make_model, make_optimizer, batches, loss_fn, transform, steps, rtol, atol, seed,
                                  compare_grads)
    # the caller's generators are left as they were (a CUDA one that starts during verify is left seeded by it)
    with torch.random.fork_rng(devices=range(torch.cuda.device_count()) if torch.cuda.is_initialized() else []):
        return _verify(make_model, make_optimizer, batch_list, loss_fn, transform, rtol, atol, seed, compare_grads)


def _verify(make_model: Callable, make_optimizer: Callable, batch_list: list[tuple[Any, Any]], loss_fn: Callable,
            transform: Callable, rtol: float, atol: float, seed: int, compare_grads: bool | None) -> VerifyReport:
    base_model, base_opt, model, opt = _build_pair(make_model, make_optimizer, transform, seed)
    params = _match(base_model.named_parameters(), model.named_parameters(), "parameters")
    buffers = _match(base_model.named_buffers(), model.named_buffers(), "buffers", extra_allowed=True)
    compare_grads, notes = _grads_compared(compare_grads, _is_in_backward(opt))
    base_names, names = {n for n, _ in base_model.named_buffers()}, {n for n, _ in model.named_buffers()}
    if base_names < names:  # a technique's own buffers
        extra = sorted(names - base_names)
        notes.append(f"the transformed model's own buffers ({', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}) "
                     "have no baseline counterpart and are not compared")
    base_model.train()
    model.train()

    comparison = _Comparison(rtol, atol)
    base_losses: list[float] = []
    losses: list[float] = []
    for step, (inputs, targets) in enumerate(batch_list):
        try:
            # each run gets its own copy of the batch: a model that writes into its input (an in-place first
            # activation) would otherwise hand the second run another batch; what each left there is compared
            base_batch, batch = _fresh((inputs, targets)), _fresh((inputs, targets))
            base_loss, base_rng = _forward_backward(base_model, base_opt, base_batch[0], base_batch[1], loss_fn,
                                                    seed + 1 + step)
        except MemtrimError:
            raise
        except Exception as e:  # the user's model, loss or batch, before any technique: said as such
            raise InvalidInputError(
                f"memtrim.verify: the baseline's step {step} failed ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:300]}). The model, loss_fn and batches must train without the transform "
                "first."
            ) from e
        loss, rng = _forward_backward(model, opt, batch[0], batch[1], loss_fn, seed + 1 + step)
        base_losses.append(float(base_loss))
        losses.append(float(loss))
        if not comparison.compare(step, "loss", base_loss, loss):
            break
        # a run that writes into its batch where the other does not changes the caller's data (batches that are
        # views of one dataset tensor, a batch used again)
        if not all(comparison.compare(step, f"batch:{i}", a, b)
                   for i, (a, b) in enumerate(zip(_tensors(base_batch), _tensors(batch)))):
            break
        if compare_grads and not all(
            comparison.compare(step, f"grad:{name}", a.grad, _gradient(b)) for name, a, b in params
        ):
            break
        # each run's step goes on from its own backward's generators, as in a loop of its own (an optimizer may
        # draw: gradient noise; OptimizerInBackward draws inside backward), and they must end alike
        base_rng = _stepped(base_opt, base_rng, _closure(base_model, base_opt, base_batch, loss_fn))
        if not comparison.same_rng(step, base_rng, _stepped(opt, rng, _closure(model, opt, batch, loss_fn))):
            break
        # matched again at each step: a module that assigns a buffer anew (self.ema = 0.9 * self.ema + ...) leaves
        # the tensors matched before training behind
        buffers = _match(base_model.named_buffers(), model.named_buffers(), "buffers", extra_allowed=True)
        if not _states_agree(comparison, step, params, buffers, base_opt, opt):
            break
    return VerifyReport(
        ok=comparison.divergence is None,
        bitwise=comparison.difference is None,
        steps=len(losses),
        first_divergence=comparison.divergence,
        first_difference=comparison.difference,
        max_abs_error=comparison.max_abs,
        max_rel_error=comparison.max_rel,
        baseline_losses=base_losses,
        transformed_losses=losses,
        grads_compared=compare_grads,
        notes=tuple(notes),
    )


def _build_pair(make_model: Callable, make_optimizer: Callable, transform: Callable, seed: int
                ) -> tuple[torch.nn.Module, Any, torch.nn.Module, Any]:
    """The baseline's (model, optimizer) and the transformed one's, each built from ``seed``; refuses any object
    the two runs would share."""
    cuda_started = torch.cuda.is_initialized()
    base_model, base_opt = _build(make_model, make_optimizer, seed)
    if not cuda_started and torch.cuda.is_initialized():  # CUDA started in make_model, unseeded: again, seeded
        base_model, base_opt = _build(make_model, make_optimizer, seed)
    model, opt = _build(make_model, make_optimizer, seed)
    if model is base_model:
        raise InvalidInputError(
            f"memtrim.verify: make_model returned the same {type(model).__name__} object twice; the baseline and "
            "the transformed run need a model each, or they train one model and always agree. Build a new model "
            "on each call (pass the class, or a function that constructs it)."
        )
    if opt is base_opt:
        raise InvalidInputError(
            "memtrim.verify: make_optimizer returned the same optimizer object twice; build a new optimizer for "
            "the model it is given, e.g. lambda m: torch.optim.Adam(m.parameters())."
        )
    model, opt = _check_transformed(transform(model, opt))  # its optimizer may step copies (CPUOffloadOptimizer)
    if opt is base_opt:
        raise InvalidInputError(
            "memtrim.verify: transform returned the baseline's optimizer; it must return an optimizer of the "
            "model it was given (or that model's own optimizer)."
        )
    _check_nothing_shared(base_model, model)
    return base_model, base_opt, model, opt


def _grads_compared(compare_grads: bool | None, in_backward: bool) -> tuple[bool, list[str]]:
    """Whether ``.grad`` is compared after backward, and the report's note when it is not by default."""
    if compare_grads is None:
        if in_backward:
            return False, ["gradients not compared: the transformed optimizer is an OptimizerInBackward, which "
                           "frees each gradient inside backward by design; the loss, parameters, buffers and "
                           "optimizer state are compared after every step"]
        return True, []
    if compare_grads and in_backward:
        raise InvalidInputError(
            "memtrim.verify: compare_grads=True, but the transformed optimizer is an OptimizerInBackward, which "
            "frees each gradient inside backward by design, so there are none to compare. Leave compare_grads "
            "at None (its updates are then checked through the parameters and optimizer state)."
        )
    return compare_grads, []


def _states_agree(comparison: _Comparison, step: int, params: list[tuple[str, torch.Tensor, torch.Tensor]],
                  buffers: list[tuple[str, torch.Tensor, torch.Tensor]], base_opt: torch.optim.Optimizer,
                  opt: torch.optim.Optimizer) -> bool:
    """After the optimizer step: every parameter, then every buffer, then every optimizer-state tensor (stops at
    the first divergence)."""
    return (all(comparison.compare(step, f"param:{name}", a, b) for name, a, b in params)
            and all(comparison.compare(step, f"buffer:{name}", a, b) for name, a, b in buffers)
            and all(comparison.compare(step, f"state:{name}.{key}", a, b)
                    for name, key, a, b in _optimizer_states(base_opt, opt, params)))


def _check_arguments(make_model: Any, make_optimizer: Any, batches: Any, loss_fn: Any, transform: Any, steps: Any,
                     rtol: Any, atol: Any, seed: Any, compare_grads: Any) -> list[tuple[Any, Any]]:
    """Every argument's kind, before anything runs; returns the batches to use."""
    if isinstance(make_model, torch.nn.Module):
        raise InvalidInputError(
            f"memtrim.verify: make_model must build a new model on each call (a class or a function), got a "
            f"{type(make_model).__name__} instance. Pass its class, or lambda: {type(make_model).__name__}(...)."
        )
    if isinstance(make_optimizer, type) and issubclass(make_optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.verify: make_optimizer must be a function of the model, got the class "
            f"{make_optimizer.__name__}. Pass e.g. lambda m: torch.optim.{make_optimizer.__name__}(m.parameters(), "
            "lr=1e-3)."
        )
    if isinstance(make_optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.verify: make_optimizer must be a function of the model, got a {type(make_optimizer).__name__} "
            "instance (built for one model only). Pass e.g. lambda m: torch.optim.Adam(m.parameters())."
        )
    for name, fn, arity, what in (("make_model", make_model, 0, "with no arguments"),
                                  ("make_optimizer", make_optimizer, 1, "one argument (the model)"),
                                  ("loss_fn", loss_fn, 2, "two arguments (output, targets)"),
                                  ("transform", transform, 2, "two arguments (model, optimizer)")):
        if not callable(fn):
            raise InvalidInputError(f"memtrim.verify: {name} must be callable, got {type(fn).__name__}.")
        if not accepts(fn, arity):
            verb = "be callable" if arity == 0 else "accept"
            raise InvalidInputError(
                f"memtrim.verify: {name} must {verb} {what}; its signature is {inspect.signature(fn)}."
            )
    for name, value in (("rtol", rtol), ("atol", atol)):
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise InvalidInputError(f"memtrim.verify: {name} must be a finite number >= 0, got {value!r}.")
    if not _is_int(seed):
        raise InvalidInputError(f"memtrim.verify: seed must be an int, got {seed!r}.")
    if compare_grads is not None and not isinstance(compare_grads, bool):
        raise InvalidInputError(
            f"memtrim.verify: compare_grads must be True, False or None (automatic), got {compare_grads!r}."
        )
    if steps is not None and (not _is_int(steps) or steps < 1):
        raise InvalidInputError(f"memtrim.verify: steps must be a positive int or None, got {steps!r}.")
    if isinstance(batches, (torch.Tensor, str, bytes)) or not isinstance(batches, Iterable):
        raise InvalidInputError(
            f"memtrim.verify: batches must be an iterable of (inputs, targets) pairs, got {type(batches).__name__}."
        )
    batch_list = list(itertools.islice(batches, steps)) if steps is not None else list(batches)
    if steps is not None and steps > len(batch_list):
        raise InvalidInputError(f"memtrim.verify: steps={steps} but only {len(batch_list)} batches were given.")
    if not batch_list:
        raise InvalidInputError("memtrim.verify: no batches given; pass a list of (inputs, targets) pairs.")
    for i, batch in enumerate(batch_list):
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            found = (f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list))
                     else f"a {type(batch).__name__}")
            raise InvalidInputError(
                f"memtrim.verify: batch {i} must be an (inputs, targets) pair, got {found}. Give each batch as "
                "(inputs, targets), with inputs a tensor, a tuple of the model's positional arguments or a dict of "
                "its keyword arguments."
            )
    return batch_list




def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _gradient(param: torch.Tensor) -> torch.Tensor | None:
    """``param``'s gradient where it is: on ``param``, or where a wrapper keeps it (CPUOffloadOptimizer's host copy;
    NOTE [ gradients held elsewhere ]), brought to ``param``'s device."""
    from ..techniques.optim.held_elsewhere import gather_gradient, holder_of  # here: techniques import this module

    gather_gradient(param)
    holder = holder_of(param)
    if holder is None or holder.grad is None:
        return param.grad
    if param.device.type == "cuda":
        torch.cuda.synchronize(param.device)  # the gradient was copied to the host asynchronously
    return holder.grad.to(param.device)


def _is_in_backward(optimizer: Any) -> bool:
    from ..techniques.optim import OptimizerInBackward  # here: techniques import this module

    return isinstance(optimizer, OptimizerInBackward)


def _check_transformed(result: Any) -> tuple[torch.nn.Module, Any]:
    if not (isinstance(result, tuple) and len(result) == 2):
        raise InvalidInputError(
            f"memtrim.verify: transform(model, optimizer) must return (model, optimizer), got "
            f"{type(result).__name__}."
        )
    model, opt = result
    if isinstance(model, tuple) and model and isinstance(model[0], torch.nn.Module):
        raise InvalidInputError(
            f"memtrim.verify: transform returned a tuple ({', '.join(type(m).__name__ for m in model)}) where the "
            "model belongs. memtrim.convert returns (model, report): use lambda m, o: (memtrim.convert(m)[0], o)."
        )
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.verify: transform returned a {type(model).__name__}, not an nn.Module.")
    if not isinstance(opt, torch.optim.Optimizer):
        hint = (" memtrim.convert returns (model, report), not (model, optimizer): use lambda m, o: "
                "(memtrim.convert(m)[0], o)." if type(opt).__name__ == "ConversionReport" else "")
        raise InvalidInputError(
            f"memtrim.verify: transform must return a torch.optim.Optimizer, got {type(opt).__name__}.{hint}"
        )
    return model, opt


def _check_nothing_shared(base: torch.nn.Module, other: torch.nn.Module) -> None:
    """The two runs must own their tensors: a parameter or buffer both use would train once for both."""
    owners: dict[tuple[str, int], str] = {}
    for name, tensor in (*base.named_parameters(), *base.named_buffers()):
        key = _storage_key(tensor)
        if key is not None:
            owners.setdefault(key, name)
    for name, tensor in (*other.named_parameters(), *other.named_buffers()):
        key = _storage_key(tensor)
        if key is not None and key in owners:
            raise InvalidInputError(
                f"memtrim.verify: the baseline and the transformed model share {owners[key]!r} (transformed: "
                f"{name!r}): one tensor trained by both runs makes any comparison meaningless. Build every "
                "parameter and buffer inside make_model (copy.deepcopy a shared module there)."
            )


def _storage_key(tensor: torch.Tensor) -> tuple[str, int] | None:
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:  # empty or meta: nothing to share
        return None
    return str(tensor.device), storage.data_ptr()


def _build(make_model: Callable, make_optimizer: Callable, seed: int) -> tuple[torch.nn.Module, Any]:
    _seed(seed)
    model = make_model()
    if not isinstance(model, torch.nn.Module):
        raise InvalidInputError(f"memtrim.verify: make_model returned a {type(model).__name__}, not an nn.Module.")
    lazy = next((name for name, p in model.named_parameters() if is_lazy(p)), None)
    if lazy is not None:
        raise InvalidInputError(
            f"memtrim.verify: make_model returned a model whose {lazy!r} is not initialized yet (a lazy module); the "
            "two runs are matched and checked for sharing by their parameters. Run one forward on an example batch "
            "inside make_model (as torch asks before building an optimizer on a lazy module)."
        )
    optimizer = make_optimizer(model)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidInputError(
            f"memtrim.verify: make_optimizer must return a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    _check_owned(model, optimizer)
    return model, optimizer


def _check_owned(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer steps is the model's: else a run trains something else (an optimizer built on a
    model captured from outside trains neither run, and any transform compares equal)."""
    stray = not_owned(model, optimizer)
    if stray:
        total = sum(len(group["params"]) for group in optimizer.param_groups)
        raise InvalidInputError(
            f"memtrim.verify: make_optimizer(model) returned an optimizer stepping {len(stray)} of its {total} "
            "parameters that are not the model's. "
            "Build it from the model it is given, e.g. lambda m: torch.optim.Adam(m.parameters()), not from a "
            "model captured from outside."
        )


def _seed(seed: int) -> None:
    """``torch.manual_seed`` for the CPU and the CUDA devices started: not for CUDA not started yet, where it would
    queue a seed that the caller's fork cannot take back."""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def _rng_states() -> list[torch.Tensor]:
    """The CPU generator's state and every started CUDA device's."""
    started = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else range(0)
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(i) for i in started)]


def _stepped(optimizer: Any, states: list[torch.Tensor], closure: Callable[[], torch.Tensor] | None
             ) -> list[torch.Tensor]:
    """``optimizer.step()`` (``step(closure)`` where it needs one) from the generators' ``states``; their states
    after it."""
    torch.set_rng_state(states[0])
    for index, state in enumerate(states[1:]):
        torch.cuda.set_rng_state(state, index)
    if closure is None:
        optimizer.step()
    else:
        optimizer.step(closure)
    return _rng_states()


def _closure(model: torch.nn.Module, optimizer: Any, batch: tuple[Any, Any], loss_fn: Callable
             ) -> Callable[[], torch.Tensor] | None:
    """The closure for an optimizer whose step cannot do without one (``LBFGS`` re-evaluates the loss, up to
    ``max_iter`` times a step), else None: another forward and backward of the step's batch, as a training loop
    writes it (zero the gradients, the loss, backward, return the loss). Each run's draws go on from where its
    step's first backward left the generators, as in a loop of its own; optimizers that take a closure only if
    given one (SGD, Adam) get none, so their step stays one forward and one backward."""
    from ..techniques.optim.wrapping import needs_closure  # here: techniques import this module

    if not needs_closure(type(optimizer)):
        return None

    def closure() -> torch.Tensor:
        with torch.enable_grad():  # step runs under no_grad
            optimizer.zero_grad(set_to_none=True)
            loss = scalar_loss("memtrim.verify", loss_fn(call_model(model, batch[0]), batch[1]))
            loss.backward()
        return loss

    return closure


def _forward_backward(model: torch.nn.Module, optimizer: Any, inputs: Any, targets: Any, loss_fn: Callable,
                      seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's loss and the generators' states after its backward."""
    optimizer.zero_grad(set_to_none=True)
    _seed(seed)
    loss = scalar_loss("memtrim.verify", loss_fn(call_model(model, inputs), targets))
    if _is_in_backward(optimizer):
        optimizer.backward(loss)  # its usual form: one pass, or two where clipping by norm needs them
    else:
        loss.backward()
    return loss.detach(), _rng_states()


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


def _fresh(value: Any) -> Any:
    """A copy of a batch's tensors (inside tuples, named tuples, lists and dicts, their subclasses kept); anything
    else as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone().requires_grad_(value.requires_grad)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*(_fresh(v) for v in value))
    if isinstance(value, (tuple, list)):
        return _rebuilt(value, [_fresh(v) for v in value])
    if isinstance(value, dict):
        return _rebuilt(value, {k: _fresh(v) for k, v in value.items()})
    return value


def _rebuilt(value: Any, items: Any) -> Any:
    """``items`` in ``value``'s container type (an OrderedDict stays one), or the plain type where it cannot be."""
    try:
        return type(value)(items)
    except TypeError:
        return items if isinstance(items, dict) else type(items)(items)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The dense tensors of a batch, in order (inside tuples, lists and dicts; a sparse one is not compared)."""
    if isinstance(value, torch.Tensor):
        if value.layout is torch.strided:
            yield value.detach()
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _match(base: Iterable[tuple[str, torch.Tensor]], other: Iterable[tuple[str, torch.Tensor]],
           what: str, extra_allowed: bool = False) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """The two models' tensors paired by name, else by position and shape. ``extra_allowed``: the transformed
    model may hold more (a technique's own buffers), paired by name with every baseline one."""
    base_list, other_list = list(base), list(other)
    other_by_name = dict(other_list)
    names = set(n for n, _ in base_list)
    if names and (names == set(other_by_name) or (extra_allowed and names <= set(other_by_name))):
        return [(name, tensor, other_by_name[name]) for name, tensor in base_list]
    if len(base_list) == len(other_list) and all(
        a.shape == b.shape for (_, a), (_, b) in zip(base_list, other_list)
    ):
        return [(name, a, b) for (name, a), (_, b) in zip(base_list, other_list)]
    if extra_allowed and names:  # a transform that wraps the model (names under a prefix) and adds buffers of its own
        wrapped = {n: [o for o in other_by_name if o.endswith("." + n)] for n in names}
        if all(len(found) == 1 and other_by_name[found[0]].shape == t.shape
               for n, t in base_list for found in [wrapped[n]]):
            return [(name, tensor, other_by_name[wrapped[name][0]]) for name, tensor in base_list]
    raise InvalidInputError(
        f"memtrim.verify: the transformed model's {what} match the baseline's neither by name nor by position "
        f"and shape (baseline: {[n for n, _ in base_list][:5]}..., transformed: {[n for n, _ in other_list][:5]}...). "
        f"A transform must keep the model's {what}: their names (under a wrapper's prefix too, where it may add "
        "buffers of its own), or their order and shapes."
    )


class _Comparison:
    """Compares each named tensor of the two runs; remembers the first difference, the first divergence (outside
    tolerance) and the largest errors seen."""

    def __init__(self, rtol: float, atol: float) -> None:
        self.rtol, self.atol = rtol, atol
        self.divergence: Divergence | None = None
        self.difference: Divergence | None = None
        self.max_abs = 0.0
        self.max_rel = 0.0

    def same_rng(self, step: int, base: list[torch.Tensor], other: list[torch.Tensor]) -> bool:
        """The generators after both runs' step: a step that draws more, fewer or other numbers (a replay that
        rewinds the generator) trains differently from its next step on, whatever the tolerance."""
        for index, (a, b) in enumerate(zip(base, other)):
            if not torch.equal(a, b):
                found = Divergence(step, "rng:cpu" if index == 0 else f"rng:cuda:{index - 1}", math.inf, math.inf)
                self.difference = self.difference or found
                self.divergence = found
                return False
        return True

    def compare(self, step: int, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
        if a is None and b is None:
            return True
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
            found = Divergence(step, name, math.inf, math.inf)
            self.difference = self.difference or found
            self.divergence = found
            return False
        closeness = compare_tensors(a, b, rtol=self.rtol, atol=self.atol)
        if closeness.bitwise:
            return True
        found = Divergence(step, name, closeness.max_abs_error, closeness.max_rel_error)
        self.difference = self.difference or found
        self.max_abs, self.max_rel = max(self.max_abs, found.max_abs_error), max(self.max_rel, found.max_rel_error)
        if not closeness.within:
            self.divergence = found
        return closeness.within

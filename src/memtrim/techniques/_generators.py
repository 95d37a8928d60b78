"""Draws from explicitly passed ``torch.Generator`` objects, recorded in a forward and replayed in its recomputation.

``torch.utils.checkpoint`` (and so :func:`memtrim.checkpoint_modules`) and :class:`memtrim.ReversibleSequential`
restore the global CPU and accelerator generators around a recomputation. A generator passed to an op explicitly
(``torch.rand(..., generator=self.gen)``, a module's own generator) is not reachable from outside the function, so
a torch-function mode (:class:`GeneratorDraws`) sees every torch call of the forward and records, per call given a
generator, that generator's state before the call; the recomputation sets each such call's generator to its recorded
state, in order, and puts every generator back after, so the same numbers are drawn and backward draws nothing.
Calls are matched by position, so a generator shared by several functions is replayed right. A torch-function mode
rather than a dispatch mode: a Python generator reaches an op only through a Python call (``torch.*``, a Tensor
method, ``torch.ops``), which the mode sees, and it costs about a quarter of a dispatch mode per op (measured: +25 us
vs +100 us per call of a Linear-ReLU-Linear on width 64). Code the mode cannot see (TorchScript) is not replayed.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import MemtrimError, MemtrimStateError, OptimizerInBackwardError
from ..measure.hooks import tensors_in

__all__ = ["GeneratorDraws", "GeneratorsKept", "SeededOps", "TwoPassDraws", "cuda_devices", "held_generators_kept",
           "seeded", "unwatched"]

# NOTE [ another thread's draws ]: a recomputation replays the forward's draws from the process-wide generators by
# setting them to their state before the forward, as torch's checkpoint does. Another thread drawing from them
# meanwhile (a data-augmentation or prefetching thread's torch.rand) lands between the forward's draws or the
# recomputation's, and the masks rebuilt are not the forward's: the gradient was silently wrong (an adversarial pass
# on 2026-12-02: a reversible stack with dropout beside a thread calling torch.rand, 60 of 200 steps, gradients up to
# 15.9 off; checkpoint_modules too). Where another Python thread runs when the forward starts, GeneratorDraws reads
# the global generators (the CPU's state, each initialised CUDA device's offset) as each torch call of the forward
# starts, and at its end. Each stretch between two reads is named by the call that began it; where the generators
# changed over it, (name, state before, state after) is kept, in order, and the recomputation must make the same
# changes in the same order. The state before counts (a dropout drawing from the state another thread's draw of as
# many numbers left made the very state the recomputation's dropout made from the start), and so does the name (a
# draw only the forward made, of as many numbers as the dropout after it). A stretch begins at a call, not after
# one: code between two calls (a reseed, the end of torch.random.fork_rng) belongs to the earlier call's stretch in
# both runs, whatever calls the recomputation adds before a module's (memtrim's hook reading a parameter's version:
# named by the call after, a reseed in the forward was a false error beside any idle thread, tqdm's monitor; found by
# an adversarial pass on 2026-12-02). Changes past the forward's last are not compared (another thread's draw after
# the recomputation's last), nor are the forward's past an early end (torch stops a recomputation from inside the
# call that saved its last tensor: that call's stretch is compared); a recomputation that runs to its end must make
# every change the forward made, so another thread's draw after the function's own last draw raises too
# (conservative). One thread alone pays nothing; otherwise one read per torch call (a copy of the CPU state's 5,056
# bytes, 3.7 us here: benchmarks/thread_watch.py); a thread started between a forward and its recomputation is not
# watched.
RACED_DRAWS = (
    "another thread drew from the same global random generator meanwhile (between the forward's draws or the "
    "recomputation's), so the dropout masks the recomputation rebuilds may not be the forward's and the gradient "
    "would be silently wrong (torch's own checkpoint has this race and does not see it). Expected: while this model "
    "trains, no other thread draws from torch's global generators. To fix: give the other threads a "
    "torch.Generator of their own (torch.rand(..., generator=g)), or train while no other thread draws"
)


# what torch's non-reentrant checkpoint raises to stop a recomputation early (torch >= 2.1)
_STOP_RECOMPUTATION: type[BaseException] = getattr(torch.utils.checkpoint, "_StopRecomputationError",
                                                   type("_NeverRaised", (Exception,), {}))


def generator_bytes(generator: torch.Generator) -> bytes:
    """A generator's state as bytes, read without an op: a planner's fake mode (where ``.numpy()``'s detach failed
    with torch's "convert all Tensors to FakeTensors"), a tracker (which counted each read's tensor) and the
    torch-function modes below this one do not see it."""
    with torch._C.DisableTorchFunction():  # (data_ptr is a Tensor method: the modes below this one would see it)
        state = generator.get_state()
        return ctypes.string_at(state.data_ptr(), state.numel())


def _global_generators() -> tuple[bytes, tuple[int, ...]]:
    """The process-wide generators' state: the CPU's bytes, each initialised CUDA device's offset (read as
    :func:`generator_bytes` reads)."""
    cpu = generator_bytes(torch.default_generator)
    if not torch.cuda.is_initialized():
        return cpu, ()
    return cpu, tuple(g.get_offset() for g in torch.cuda.default_generators)


class SeededOps(TorchDispatchMode):
    """Sees whether an op that draws random numbers ran (``drew``): an aten op tagged ``nondeterministic_seeded``
    (dropout, bernoulli, rand, SDPA's kernels, ...) that draws with the arguments it got (not a dropout in evaluation
    or of p = 0). At the dispatcher, so TorchScript's ops, a custom Function's, ``torch.ops`` calls and those a
    ``torch.random.fork_rng`` hides from the generators' state are all seen."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.drew and torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = _draws_with(func, args, kwargs)
        return func(*args, **kwargs)


def _draws_with(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op draws with these arguments: not with ``train``/``training`` false or a dropout
    probability of 0, as passed or, where the dispatcher left one out, as the schema's default (SDPA's
    ``dropout_p=0.0``, ``rrelu_with_noise``'s ``training=False``: both counted as draws until 2026-12-03)."""
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            value = args[position]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        elif argument.has_default_value():
            value = argument.default_value
        else:
            continue
        if argument.name in ("train", "training") and value is False:
            return False
        if argument.name in ("p", "dropout_p", "dropout") and isinstance(value, (int, float)) and value == 0:
            return False
    return True


class GeneratorDraws(TorchFunctionMode):
    """Records (forward) or replays (recomputation) the draws of every torch call given an explicit generator.

    Recording keeps, per such call in order, the generator's state before it (``states``). Replaying sets the
    generator of the ``k``-th such call to the ``k``-th recorded state; on exit every generator it touched is put
    back, latest first, so each ends where the caller left it. ``strict``: the replayed computation must draw exactly
    as often as the recorded one (a forward's recomputation that runs to its end), else ``error`` is raised, naming
    ``where`` (the API and the function) and ending with ``advice`` (what to do instead).
    """

    def __init__(self, where: str, advice: str, error: type[MemtrimError], replay: list[torch.Tensor] | None = None,
                 strict: bool = True, changes: list[int] | None = None) -> None:
        super().__init__()
        self.where, self.advice, self.error, self.replay, self.strict = where, advice, error, replay, strict
        self.states: list[torch.Tensor] = []  # recorded states (forward)
        self.restore: list[tuple[torch.Generator, torch.Tensor]] = []  # the caller's states (replay)
        # NOTE [ another thread's draws ]: each change of the global generators in the forward, in order, as a
        # hash of (the call whose stretch it was in, state before, after); recorded where another thread runs
        # (None: not watched), then compared by the replay
        self.changes = changes
        self.watching = changes is not None  # (a bool: NOTE [ under torch.compile ])
        self.matched = 0
        self.stopped = False  # torch ended the recomputation early
        self.last: tuple[bytes, tuple[int, ...]] | None = None
        self.stretch = "the start"  # the call whose stretch runs now

    def __enter__(self) -> GeneratorDraws:
        if self.replay is None and threading.active_count() > 1:
            self.changes = []
            self.watching = True
        if self.changes is not None:
            self.last = _global_generators()
        return super().__enter__()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) or not isinstance(value, torch.Generator):  # (the tensors first: a
                continue                                                                 # Python instancecheck)
            if self.replay is None:
                self.states.append(value.get_state())
                continue
            position = len(self.restore)
            if position >= len(self.replay):
                if self.strict:
                    raise self._mismatch(f"more (at {getattr(func, '__name__', func)})")
                continue
            self.restore.append((value, value.get_state()))
            value.set_state(self.replay[position])
        if self.watching and not torch.compiler.is_compiling():  # NOTE [ under torch.compile ]
            self._watch(getattr(func, "__name__", repr(func)))
        try:
            return func(*args, **kwargs)
        except _STOP_RECOMPUTATION:
            # torch's checkpoint ends its recomputation early, from inside the call that saved its last tensor
            # (a dropout's mask, after its draw): that call's draw is still compared
            if self.changes is not None:
                self._watch("the end")
                self.stopped = True
            raise

    def _watch(self, call: str) -> None:
        """As ``call`` starts: the stretch since the last read ends; where the generators changed over it, keep the
        change (forward) or check it (replay)."""
        now = _global_generators()
        stretch, self.stretch = self.stretch, call
        if now == self.last:
            return
        assert self.changes is not None and self.last is not None
        change = hash((stretch, self.last, now))
        self.last = now
        if self.replay is None:
            self.changes.append(change)
        elif self.matched < len(self.changes):  # (past the forward's last: its masks are drawn)
            if self.changes[self.matched] != change:
                raise self._raced(f"at {stretch}")
            self.matched += 1

    def _raced(self, where: str) -> MemtrimError:
        # not a TypeError (InvalidInputError is one): a Tensor operator (==, +) turns a TypeError raised inside it
        # into NotImplemented, and `out == 0` then said False instead of raising (found by this test's run)
        error = MemtrimStateError if issubclass(self.error, TypeError) else self.error
        return error(f"{self.where} drew other random numbers in its recomputation than in its forward ({where}): "
                     f"{RACED_DRAWS}; or {self.advice}.")

    def __exit__(self, *exc: object) -> None:
        for generator, state in reversed(self.restore):
            generator.set_state(state)
        super().__exit__(*exc)
        if self.changes is not None and exc[0] is None and not self.stopped:
            self._watch("the end")  # the last call's stretch
            if self.replay is not None and self.strict and self.matched < len(self.changes):
                raise self._raced("it made fewer changes")
        if exc[0] is None and self.replay is not None and self.strict and len(self.restore) != len(self.replay):
            raise self._mismatch(str(len(self.restore)))

    def replaying(self, strict: bool = True) -> GeneratorDraws:
        """A mode replaying what this one recorded."""
        return GeneratorDraws(self.where, self.advice, self.error, self.states, strict, self.changes)

    def _mismatch(self, found: str) -> MemtrimError:
        return self.error(
            f"{self.where} drew from an explicitly passed torch.Generator {len(self.replay or ())} time(s) in forward "
            f"but {found} when recomputed in backward; it must compute the same function again. Draw the same numbers "
            f"in every call (no draws that depend on a call count), or {self.advice}."
        )


# NOTE [ under torch.compile ]: a compiled child of a checkpointed module runs with this mode on.
# - Dynamo traces the mode into the child's graph. The watch's read of the global generators is not traceable:
#   it broke the graph at every op, and each piece recompiled per op signature (5 graphs and 28 frames in 12 steps,
#   then torch's recompile limit). While dynamo traces, the watch now stands aside. The graph's draws from the global
#   generators still show, at the next op run eagerly or at the end, in the forward and in the replay alike. An
#   explicitly passed generator still breaks the graph there, and is recorded and replayed (that break is dynamo's).
#   The traced code reads only the ``watching`` flag, the same in the forward and its recomputation, so they run one
#   graph (reading the list ``changes`` there made dynamo guard on its length, which grows: tried on 2026-12-03, it
#   gave them two graphs that save their tensors in other orders, torch's CheckpointError). The flag is read first:
#   without another thread, no other call is made per op.
# - Where dynamo compiles no frame of the child (torch.nn's own modules), it compiled ``__torch_function__`` as a
#   frame of its own, once per op signature. It compiles none now; it still traces it inside a compiled caller.
(getattr(torch._dynamo.eval_frame, "skip_code", None) or torch._C._dynamo.eval_frame.skip_code)(  # type: ignore[attr-defined]
    GeneratorDraws.__torch_function__.__code__)


# NOTE [ a backward run twice ]: OptimizerInBackward's clipping and GradScaler run the backward twice (a measuring
# pass, then the updating one), and a backward that draws (a gradient-noise hook, a custom Function's stochastic
# rounding) must draw the same numbers in both, ending where one pass leaves the generators.
# - A generator passed explicitly (``torch.randn(..., generator=g)``): at each of its calls in the second pass it is
#   set to the state it had at the same call (per generator, in order, the same function on the same shapes) in the
#   first. It drew on from where the first pass left it, and the norm was measured on other noise than the update
#   applied (0.0078 off after 3 SGD steps; found 2026-12-02). A generator that moved otherwise between its calls or
#   since the first pass (another thread drawing from it: setting it back would give that thread its numbers twice),
#   or a call the first pass did not make before the ones it did (another model's hooks, reached by the second pass
#   only: a GAN's discriminator), raises; calls after all of the first pass's draw on.
# - The global generators (the CPU's, each initialised CUDA device's) are put back to their state before the first
#   pass where it moved them, as torch.random.fork_rng did; the second pass must then leave them where the first did,
#   else it raises, its updates done (the step is lost, as for any error in it). It catches another thread drawing
#   from them during the passes (its draws in the first were set back and may come again; 20,334 of 53,363 dropout
#   masks of such a thread repeated an earlier one beside clip_grad_norm=, with no error, until 2026-12-02), and a
#   second pass drawing otherwise (a GAN's discriminator hooks drawing before the generator's). Watching the
#   backward's draws op by op instead (tried, 2026-12-02) missed TorchScript's and C++ code's, which then went
#   silently wrong beside an idle thread, and cost 1.5x a step with checkpointing beside one (an adversarial pass).
_UNWATCHED = threading.local()  # .on: OptimizerInBackward's own work runs (the mode below another one)


class unwatched:  # (lower case: used as a function is, `with unwatched():`)
    """OptimizerInBackward's own work inside a pass (measuring a gradient, the optimizer's update): not the
    backward's draws. The mode is taken off the stack where it is on top, the usual case: every torch call under it,
    a tensor's attribute read included, costs a Python call (a flag alone left 100 Linear layers' AdamW step with
    clipping 2x slower). Nothing to do, at the cost of one call, where no torch-function mode is in force."""

    __slots__ = ("popped", "outer")

    def __enter__(self) -> None:
        self.popped, self.outer = None, None
        depth = torch._C._len_torch_function_stack()
        if not depth:
            return
        if isinstance(torch._C._get_function_stack_at(depth - 1), TwoPassDraws):
            self.popped = torch._C._pop_torch_function_stack()
            return
        self.outer = getattr(_UNWATCHED, "on", False)
        _UNWATCHED.on = True

    def __exit__(self, *exc: object) -> None:
        if self.popped is not None:
            torch._C._push_on_torch_function_stack(self.popped)
        elif self.outer is not None:
            _UNWATCHED.on = self.outer


class TwoPassDraws(TorchFunctionMode):
    """Around each pass of a backward run twice (NOTE [ a backward run twice ]): the first (``first=None``) records;
    :meth:`conclude` puts the global generators back where the first pass moved them; the second (``first=`` the
    first's) replays each explicitly passed generator's draws, and :meth:`check` compares where the global ones
    ended."""

    _WHERE = "OptimizerInBackward.backward (clip_grad_norm= or scaler=, which run backward twice)"
    _FIX = ("To fix: no other thread draws from these generators while the step's backward runs (give it a "
            "torch.Generator of its own), and a backward reaching another model's parameters (a GAN's generator "
            "loss through the discriminator) draws from a generator of their own, or not at all.")

    def __init__(self, first: TwoPassDraws | None = None) -> None:
        super().__init__()
        self.first = first
        # per explicitly passed generator: it, then its state and the call's (function, shapes) at each call
        self.calls: dict[int, tuple[torch.Generator, list[tuple[torch.Tensor, Any]]]] = {}
        self.ended: dict[int, torch.Tensor] = {}  # (first pass) each one's state at its end
        self.replayed: dict[int, int] = {}
        self.start = _global_generators()
        self.moved = False  # (first pass) the global generators were put back
        self.end: Any = None  # (first pass) where it left the global generators
        self.error: OptimizerInBackwardError | None = None  # (second pass) what it raised
        # what conclude() puts back (the first pass's)
        self.kept = None if first is not None else (
            torch.get_rng_state(),
            [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_initialized()
            else [])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_UNWATCHED, "on", False):
            return func(*args, **kwargs)
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator):
                self._draw(value, (getattr(func, "__name__", repr(func)),
                                   tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)),
                                   tuple(a for a in args if isinstance(a, (int, tuple, list, torch.Size)))))
        return func(*args, **kwargs)

    def _draw(self, generator: torch.Generator, call: Any) -> None:
        if self.first is None:
            self.calls.setdefault(id(generator), (generator, []))[1].append((generator.get_state(), call))
            return
        recorded = self.first.calls.get(id(generator), (generator, []))[1]
        done = self.replayed.get(id(generator), 0)
        if done >= len(recorded):
            return  # past the first pass's calls: draws on
        state, expected = recorded[done]
        if call != expected:
            raise self._raised(
                f"{self._WHERE}: its second pass drew from a torch.Generator in a call its first did not make there "
                f"({call[0]} where the first pass's next draw from it was {expected[0]}), so the second cannot draw "
                f"the first's numbers again. {self._FIX}")
        now = generator.get_state()
        if not torch.equal(now, self.first.ended[id(generator)] if done == 0 else state):
            raise self._raised(
                f"{self._WHERE}: a torch.Generator the backward draws from moved between its draws (another thread "
                f"drawing from it): setting it back for the second pass would give that thread its numbers twice. "
                f"{self._FIX}")
        generator.set_state(state)
        self.replayed[id(generator)] = done + 1

    def conclude(self) -> None:
        """After the first pass: the global generators go back to the state it began at, where it moved them."""
        self.ended = {key: generator.get_state() for key, (generator, _) in self.calls.items()}
        self.end = _global_generators()
        if self.end == self.start:
            return
        assert self.kept is not None  # (the first pass's)
        cpu, cuda = self.kept
        torch.set_rng_state(cpu)
        for index, state in enumerate(cuda):
            torch.cuda.set_rng_state(state, index)
        self.moved = True

    def check(self) -> None:
        """After the second pass: it left the generators where the first did."""
        first = self.first
        assert first is not None
        astray = any(self.replayed.get(key, 0) != len(calls) or not torch.equal(generator.get_state(), first.ended[key])
                     for key, (generator, calls) in first.calls.items())
        if astray or (first.moved and _global_generators() != first.end):
            what = ("a torch.Generator ended elsewhere" if astray else
                    "the global generator ended elsewhere")
            raise self._raised(
                f"{self._WHERE}: its second pass drew other random numbers than its first ({what}): another thread "
                "drew from the generator meanwhile (its numbers may come again), or the second pass reached hooks "
                "the first did not (another model's parameters), so the norm was measured on other numbers than "
                f"the update applied; this step's updates are done. {self._FIX}")

    def _raised(self, message: str) -> OptimizerInBackwardError:
        """The second pass's error, kept: OptimizerInBackward then counts the step as lost."""
        self.error = OptimizerInBackwardError(message)
        return self.error


class GeneratorsKept(TorchFunctionMode):
    """Every ``torch.Generator`` passed to a torch call inside is put back on exit to its state before its first such
    call: :func:`memtrim.convert`'s traces and measurements run the model's forward, and must leave a model's own
    generator (``torch.rand(..., generator=self.gen)``) where it was, as they leave the global ones."""

    def __init__(self) -> None:
        super().__init__()
        self.first: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator) and id(value) not in self.first:
                self.first[id(value)] = (value, value.get_state())
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for generator, state in self.first.values():
                generator.set_state(state)


# ---------------------------------------------------------------------- the forwards memtrim.convert runs
def cuda_devices(model: nn.Module, inputs: Any) -> list[int]:
    """The CUDA devices the model and the example inputs live on: their RNG is saved and restored around tracing."""
    found = {t.device.index or 0 for t in (*model.parameters(), *model.buffers(), *tensors_in(inputs))
             if t.device.type == "cuda"}
    return sorted(found)


_HELD = threading.local()  # .put_back: what puts the model convert runs back to its generators' states at the call


@contextlib.contextmanager
def held_generators_kept(model: nn.Module) -> Iterator[None]:
    """Every random generator a module of ``model`` holds (:func:`_held_generators`) is put back on exit to its state
    now, and :func:`seeded` starts each forward inside from that state. convert's forwards drew from them and left
    them advanced, so the converted model trained on other draws than the plain one (1.1e-3 off after 4 steps; found
    by an adversarial pass)."""
    put_back, outer = _held_generators(model), getattr(_HELD, "put_back", ())
    _HELD.put_back = put_back
    try:
        yield
    finally:
        _HELD.put_back = outer
        for back in put_back:
            back()


@contextlib.contextmanager
def seeded(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[None]:
    """Every forward convert runs (the trace, each measurement, each check) draws from the same seeds: torch's
    generators (the global one and those of the CUDA devices the model or inputs are on, restored after), Python's
    ``random`` and NumPy's (restored by convert's ``as_training``, around it all), and the model's own from where
    they were at convert's call (:func:`held_generators_kept`). A forward that draws its path (HF's LayerDrop skips
    layers by ``torch.rand``; MusicGen by ``random``, Wav2Vec2's adapter by NumPy) then takes one path in all of them:
    a trace under the caller's state took another than the measurements, which found the layers it skipped saving
    nothing and converted otherwise at each caller's seed (found by an adversarial pass)."""
    devices = cuda_devices(model, (args, kwargs))
    with torch.random.fork_rng(devices=devices):
        # not torch.manual_seed: it seeds every CUDA device, and only these are restored after
        torch.default_generator.manual_seed(0)
        for index in devices:
            torch.cuda.default_generators[index].manual_seed(0)
        random.seed(0)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed(0)
        for back in getattr(_HELD, "put_back", ()):
            back()
        yield


def _held_generators(model: nn.Module) -> list[Callable[[], Any]]:
    """For each random generator a module of ``model`` holds (a ``torch.Generator``, a ``random.Random``, a NumPy
    ``Generator`` or ``RandomState``: a model's own random scale or drop path; :func:`_held`), what puts it back to
    its state now."""
    numpy = sys.modules.get("numpy")
    found: list[Callable[[], Any]] = []
    seen: set[int] = set()
    for module in model.modules():
        for value in _held(module):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, random.SystemRandom):  # (no state: it draws from the system)
                continue
            if isinstance(value, torch.Generator):
                found.append(functools.partial(value.set_state, value.get_state()))
            elif isinstance(value, random.Random):
                found.append(functools.partial(value.setstate, value.getstate()))
            elif numpy is not None and isinstance(value, numpy.random.Generator):
                found.append(functools.partial(setattr, value.bit_generator, "state", value.bit_generator.state))
            elif numpy is not None and isinstance(value, numpy.random.RandomState):
                found.append(functools.partial(value.set_state, value.get_state()))
    return found


def _held(module: nn.Module) -> Iterator[Any]:
    """What ``module`` holds where a generator is kept: its attributes, its class's (up to ``nn.Module``), and one
    level inside those that are lists, tuples, dicts or plain objects (``self.rngs = {"scale": rng}``, a helper
    holding ``self.rng``); not what a property returns or a global."""
    found = list(vars(module).values())
    for klass in type(module).__mro__:
        if klass is nn.Module:
            break
        found += [v for v in vars(klass).values() if not callable(v)]
    for value in found:
        yield value
        if isinstance(value, dict):
            yield from value.values()
        elif isinstance(value, (list, tuple)):
            yield from value
        elif (not isinstance(value, (nn.Module, torch.Tensor, type)) and hasattr(value, "__dict__")
                and type(value).__module__ not in ("builtins", "functools")):
            yield from vars(value).values()


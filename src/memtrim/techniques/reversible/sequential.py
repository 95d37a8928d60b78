"""``ReversibleSequential``: a stack of invertible blocks whose activation memory does not grow with depth.

NOTE [ reversible without backward inside backward ]
The forward runs the blocks normally, so autograd records the ordinary graph of the whole stack, but every tensor
an op inside a block saves for backward is packed (saved-tensor hooks) as a small handle; nothing inside the stack
is kept except the stack's output. When backward first unpacks a handle of block ``i`` (blocks are reached last to
first), the block is *materialised*: its input is reconstructed from its output (the stack output, or the input
reconstructed for block ``i + 1``) and the computations whose saved tensors the graph needs are re-run, recording
what they save, in the forward's order; each handle then returns its tensor and is released with its node.

* For an :class:`AdditiveCoupling` the inversion ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)`` evaluates ``g`` and ``f``
  exactly where the forward did, so it is run with grad enabled and recorded: each of f and g runs once in backward.
  Any other block with an ``inverse`` is inverted without grad and re-run once (f and g twice).
* Between two couplings the stream stays split (:class:`_Halves`): the forward does not concatenate a block's
  halves for the next block to split again, and backward does not join their gradients; only the stack's output
  is concatenated.
* No backward inside backward: the graph is the ordinary one and is traversed once, so ``autograd.grad``, DDP
  (each parameter's gradient accumulated once) and an enclosing non-reentrant checkpoint work.
* Replay: the RNG states (CPU and the CUDA device) before each of f and g, and the autocast state, are recorded in
  forward and restored for the recomputation, then the caller's states are put back (the global generator is never
  reseeded or advanced; a generator f or g drew nothing from is not touched at all); module buffers (BatchNorm's
  running statistics) are restored after it, so they are updated once per forward.
* A ``torch.Generator`` passed to an op explicitly (``torch.rand(..., generator=self.gen)``, a module's own
  generator) is not reachable from outside f or g, so a torch-function mode (:class:`_GeneratorDraws`) sees every
  torch call in their forward and records, per call given a generator, that generator's state before the call; the
  recomputation sets each such call's generator to its recorded state, in order, and puts every generator back
  after, so the same numbers are drawn and backward draws nothing. Calls are matched by position, so a generator
  shared by several functions is replayed right. A recomputation that draws from explicit generators a different
  number of times than the forward raises :class:`ReversibleError`. A torch-function mode rather than a dispatch
  mode: a Python generator reaches an op only through a Python call (``torch.*``, a Tensor method, ``torch.ops``),
  which the mode sees, and it costs about a quarter of a dispatch mode per op (measured: +25 us vs +100 us per
  call of a Linear-ReLU-Linear f on width 64). Code the mode cannot see (TorchScript) is not replayed.
* The caller's tensors are never freed or modified. If the stack output, or a block's parameter, is modified in
  place before backward, reconstruction would be wrong: that raises (version counters, as autograd's own check).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ...errors import InvalidInputError, ReversibleError
from ...measure.hooks import hold_for_backward
from .coupling import AdditiveCoupling, AffineCoupling, _checked, _split

__all__ = ["ReversibleSequential", "ReversibleError"]


class _Handle:
    """What autograd keeps instead of a tensor saved inside the stack."""

    __slots__ = ("frame", "block", "tensor", "__weakref__")

    def __init__(self, frame: _Frame, block: int) -> None:
        self.frame, self.block = frame, block
        self.tensor: torch.Tensor | None = None  # filled when backward materialises the block


class _Replay:
    """What the forward of one function (f, g, or a whole block) ran under."""

    __slots__ = ("cpu_rng", "cuda_rng", "cuda_device", "autocast", "requires_grad", "generator_states", "where")


class _GeneratorDraws(TorchFunctionMode):
    """Records (forward) or replays (recomputation) the draws of every torch call given an explicit generator.

    Recording keeps, per such call in order, the generator's state before it. Replaying sets the generator of the
    ``k``-th such call to the ``k``-th recorded state; on exit every generator it touched is put back, latest first,
    so each ends where the caller left it. ``strict``: the replayed computation must draw exactly as often as the
    recorded one (a forward's recomputation); a block's ``inverse`` is replayed leniently.
    See NOTE [ reversible without backward inside backward ].
    """

    def __init__(self, where: str, replay: list[torch.Tensor] | None = None, strict: bool = True) -> None:
        super().__init__()
        self.where, self.replay, self.strict = where, replay, strict
        self.states: list[torch.Tensor] = []  # recorded states (forward)
        self.restore: list[tuple[torch.Generator, torch.Tensor]] = []  # the caller's states (replay)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.Generator):
                continue
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
        return func(*args, **kwargs)

    def __exit__(self, *exc: object) -> None:
        for generator, state in reversed(self.restore):
            generator.set_state(state)
        super().__exit__(*exc)
        if exc[0] is None and self.replay is not None and self.strict and len(self.restore) != len(self.replay):
            raise self._mismatch(str(len(self.restore)))

    def _mismatch(self, found: str) -> ReversibleError:
        return ReversibleError(
            f"memtrim.ReversibleSequential: {self.where} drew from an explicitly passed torch.Generator "
            f"{len(self.replay or ())} time(s) in forward but {found} when recomputed in backward; it must compute "
            "the same function again. Draw the same numbers in every call (no draws that depend on a call count), "
            "or keep this module out of the reversible stack."
        )


@contextmanager
def _captured(replays: dict[str, _Replay], name: str, x: torch.Tensor, where: str) -> Iterator[None]:
    """Around a function's forward (f, g, or a whole block, reading ``x``): record in ``replays[name]`` what its
    recomputation must replay. A generator it drew nothing from is not replayed (the common case, no dropout):
    drawing any random number advances a generator's state, so an unchanged state means nothing was drawn.
    ``where`` names the function in errors ("block 3's f")."""
    replay = replays[name] = _Replay()
    replay.where = where
    replay.requires_grad = x.requires_grad
    replay.cpu_rng = torch.get_rng_state()
    replay.cuda_device = x.device if x.device.type == "cuda" else None
    replay.cuda_rng = torch.cuda.get_rng_state(x.device) if replay.cuda_device is not None else None
    replay.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                       if d == "cpu" or replay.cuda_device is not None] if hasattr(torch, "get_autocast_dtype") else []
    with _GeneratorDraws(where) as draws:
        yield
    replay.generator_states = draws.states or None
    if torch.equal(torch.get_rng_state(), replay.cpu_rng):
        replay.cpu_rng = None
    if replay.cuda_device is not None and torch.equal(torch.cuda.get_rng_state(replay.cuda_device), replay.cuda_rng):
        replay.cuda_rng = None


@contextmanager
def _replayed(replay: _Replay, strict: bool = True) -> Iterator[None]:
    """Run under the forward's random-number state and autocast state; restore the caller's generators after, as
    ``torch.random.fork_rng`` does (inlined: this runs twice per block in backward). ``strict=False`` for a
    block's ``inverse``, which need not draw what the forward drew."""
    cpu_state = cuda_state = None
    if replay.cpu_rng is not None:
        cpu_state = torch.get_rng_state()
        torch.set_rng_state(replay.cpu_rng)
    if replay.cuda_rng is not None:
        cuda_state = torch.cuda.get_rng_state(replay.cuda_device)
        torch.cuda.set_rng_state(replay.cuda_rng, replay.cuda_device)
    try:
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in replay.autocast:
                now = torch.is_autocast_enabled(device)
                if now != enabled or (enabled and torch.get_autocast_dtype(device) != dtype):  # else already in it
                    stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            if replay.generator_states is not None:
                stack.enter_context(_GeneratorDraws(replay.where, replay.generator_states, strict=strict))
            yield
    finally:
        if cpu_state is not None:
            torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, replay.cuda_device)


class _Halves(NamedTuple):
    """A block boundary rebuilt by a coupling, kept as its two halves: the block before splits it the same way, so
    it is never concatenated."""

    first: torch.Tensor
    second: torch.Tensor
    dim: int

    def whole(self) -> torch.Tensor:
        return torch.cat([self.first, self.second], dim=self.dim)


def _whole(x: torch.Tensor | _Halves) -> torch.Tensor:
    return x.whole() if isinstance(x, _Halves) else x


def _split_halves(block: AdditiveCoupling | AffineCoupling, x: torch.Tensor | _Halves
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(x, _Halves) and x.dim == block.split_dim:
        return x.first, x.second
    return _split(block, _whole(x), block.split_dim)


class _Frame:
    """One forward of the stack: the output, the handles per block, and what backward rebuilt."""

    def __init__(self, stack: ReversibleSequential) -> None:
        self.stack = stack
        self.blocks = list(stack.blocks)
        self.handles: list[list[weakref.ref]] = [[] for _ in self.blocks]
        self.replays: list[dict[str, _Replay]] = [{} for _ in self.blocks]
        self.outputs: dict[int, torch.Tensor | _Halves] = {}  # block index -> its output (the next block's input)
        self.output_version = 0
        self.materialised: set[int] = set()
        self.exact = stack.exact
        self.scale = float(2 ** stack.fraction_bits)
        self.dtype = torch.float32  # what f and g compute in (exact mode): the stack input's dtype
        self.probes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (indices, values) of its input
        self.kept_inputs: dict[int, torch.Tensor] = {}  # blocks whose drift exceeded the tolerance before
        self.parameter_versions: list[list[tuple[torch.Tensor, int]]] = [[] for _ in self.blocks]

    def set_output(self, output: torch.Tensor) -> None:
        self.outputs[len(self.blocks) - 1] = output.detach()  # detached: no cycle through the output's grad_fn
        self.output_version = output._version

    def unpack(self, handle: _Handle) -> torch.Tensor:
        if handle.tensor is None:
            self.materialise(handle.block)
        tensor = handle.tensor
        if tensor is None:
            raise ReversibleError(
                f"memtrim.ReversibleSequential: block {handle.block} saved a tensor in forward that its "
                "recomputation did not save again: the block is not deterministic in what it computes (data-"
                "dependent control flow?). Keep such a block out of the reversible stack."
            )
        return tensor

    def output_of(self, index: int) -> torch.Tensor:
        return _whole(self._stored_output(index))

    def _stored_output(self, index: int) -> torch.Tensor | _Halves:
        if index not in self.outputs:
            self.materialise(index + 1)  # reconstructs block index + 1's input, which is this block's output
        y = self.outputs.get(index)
        if y is None:
            raise ReversibleError(f"memtrim.ReversibleSequential: block {index}'s output is gone (internal error).")
        if index == len(self.blocks) - 1 and _whole(y)._version != self.output_version:
            raise ReversibleError(
                "memtrim.ReversibleSequential: the stack's output was modified in place after the forward, so the "
                "blocks' inputs cannot be reconstructed from it. Clone the output before changing it."
            )
        return y

    def materialise(self, index: int) -> None:
        if index in self.materialised:
            return
        block = self.blocks[index]
        self._check_parameters(index, block)
        recorded: list[torch.Tensor] = []
        saved_buffers = [(b, b.detach().clone()) for b in block.buffers()]
        try:
            if index in self.kept_inputs:  # drift fallback: the input was kept, recompute forward from it
                x = self.kept_inputs.pop(index)
                self._recompute_forward(index, block, x, recorded)
            elif type(block) is AdditiveCoupling:
                x = self._rebuild_additive(index, block, *_split_halves(block, self._stored_output(index)), recorded)
            elif type(block) is AffineCoupling and not self.exact:
                x = self._rebuild_affine(index, block, *_split_halves(block, self._stored_output(index)), recorded)
            else:
                x = self._rebuild_generic(index, block, self.output_of(index), recorded)
        finally:
            with torch.no_grad():
                for buffer, value in saved_buffers:
                    buffer.copy_(value)  # running statistics: updated once, by the forward
        handles = self.handles[index]
        if len(recorded) != len(handles):
            raise ReversibleError(
                f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) saved {len(handles)} tensors "
                f"in forward but {len(recorded)} when recomputed; its computation must not depend on anything but "
                "its input (and the replayed random numbers)."
            )
        for ref, tensor in zip(handles, recorded):
            handle = ref()
            if handle is not None:
                handle.tensor = tensor
        self.materialised.add(index)
        if index in self.probes:
            self.stack._measure_drift(index, _whole(x), *self.probes.pop(index))
        if index > 0:
            self.outputs[index - 1] = x
        self.outputs.pop(index, None)  # this block's output is no longer needed: one boundary alive at a time

    def _check_parameters(self, index: int, block: nn.Module) -> None:
        """A block rebuilt with parameters changed since its forward would silently give a wrong input (the plain
        stack's autograd refuses the same: the ops saved the weights)."""
        for param, version in self.parameter_versions[index]:
            if param._version != version:
                name = next((n for n, p in block.named_parameters() if p is param), "?")
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index}'s parameter {name} was modified in place after the "
                    f"forward (version {version}, now {param._version}), so the block's input cannot be rebuilt from "
                    "its output. Run backward before changing parameters (an optimizer step, or an "
                    "OptimizerInBackward stepping during another backward that shares them)."
                )

    def _rebuild_additive(self, index: int, block: AdditiveCoupling, y1: torch.Tensor, y2: torch.Tensor,
                          recorded: list[torch.Tensor]) -> _Halves:
        replays = self.replays[index]
        f_saved: list[torch.Tensor] = []
        g_saved: list[torch.Tensor] = []
        # inputs require grad as they did in forward, so the ops save the same tensors
        with _replayed(replays["g"]), _recording(g_saved), torch.enable_grad():
            gy = block.g(self._fn_input(y1).requires_grad_(replays["g"].requires_grad))
        x2 = (y2 - self._to_stream(gy.detach())).detach()
        with _replayed(replays["f"]), _recording(f_saved), torch.enable_grad():
            fx = block.f(self._fn_input(x2).requires_grad_(replays["f"].requires_grad))
        x1 = (y1 - self._to_stream(fx.detach())).detach()
        recorded += f_saved + g_saved  # the forward saved f's tensors, then g's (the additions save nothing)
        return _Halves(x1, x2, block.split_dim)

    def _rebuild_affine(self, index: int, block: AffineCoupling, y1: torch.Tensor, y2: torch.Tensor,
                        recorded: list[torch.Tensor]) -> _Halves:
        """Invert with f and g evaluated once each, recording what the forward saved, in its order: f's tensors and
        the f-side multiplication's, then g's and the g-side multiplication's."""
        replays = self.replays[index]
        f_saved: list[torch.Tensor] = []
        g_saved: list[torch.Tensor] = []
        with torch.enable_grad():
            y1_in = y1.detach().requires_grad_(replays["g"].requires_grad)
            with _replayed(replays["g"]), _recording(g_saved):
                s_g, t_g = block._scale_shift("g", block.g, y1_in)
            x2 = ((y2 - t_g.detach()) / s_g.detach()).detach().requires_grad_(replays["f"].requires_grad)
            with _replayed(replays["f"]), _recording(f_saved):
                s_f, t_f = block._scale_shift("f", block.f, x2)
            x1 = ((y1 - t_f.detach()) / s_f.detach()).detach().requires_grad_(replays["f"].requires_grad)
            with _recording(f_saved):
                _ = x1 * s_f + t_f  # what the forward's y1 = x1 * s_f + t_f saved
            with _recording(g_saved):
                _ = x2 * s_g + t_g
        recorded += f_saved + g_saved
        return _Halves(x1.detach(), x2.detach(), block.split_dim)

    def _fn_input(self, half: torch.Tensor) -> torch.Tensor:
        """What f or g receives: the half itself, or (exact mode) its value back in floating point."""
        if not self.exact:
            return half.detach()
        return (half.detach() / self.scale).to(self.dtype)

    def _to_stream(self, out: torch.Tensor) -> torch.Tensor:
        """f's or g's output as added to the stream: itself, or (exact mode) rounded to the fixed-point grid."""
        if not self.exact:
            return out
        return torch.round(out.double() * self.scale)

    def _recompute_forward(self, index: int, block: nn.Module, x: torch.Tensor, recorded: list[torch.Tensor]) -> None:
        replays = self.replays[index]
        with torch.enable_grad():
            if type(block) is AdditiveCoupling:
                self.stack._additive(self, index, block, x.detach().requires_grad_(replays["f"].requires_grad),
                                     recording=recorded)
            elif type(block) is AffineCoupling:
                self.stack._affine(self, index, block, x.detach().requires_grad_(replays["f"].requires_grad),
                                   recording=recorded)
            else:
                with _replayed(replays["block"]), _recording(recorded):
                    block(x.detach().requires_grad_(replays["block"].requires_grad))

    def _rebuild_generic(self, index: int, block: nn.Module, y: torch.Tensor,
                         recorded: list[torch.Tensor]) -> torch.Tensor:
        replay = self.replays[index]["block"]
        with _replayed(replay, strict=False), torch.no_grad():
            x = block.inverse(y)
        with _replayed(replay), _recording(recorded), torch.enable_grad():
            block(x.detach().requires_grad_(replay.requires_grad))
        return x.detach()


def _probe(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """64 evenly spaced elements of a block input: a few hundred bytes to check its reconstruction against."""
    flat = x.detach().reshape(-1)
    where = torch.linspace(0, flat.numel() - 1, steps=min(64, flat.numel()), device=flat.device).long()
    return where, flat[where].clone()


@contextmanager
def _recording(into: list[torch.Tensor]) -> Iterator[None]:
    def pack(tensor: torch.Tensor) -> None:
        into.append(tensor.detach())

    def unpack(_: None) -> torch.Tensor:  # pragma: no cover - the recomputed graph is never differentiated
        raise ReversibleError("memtrim.ReversibleSequential: internal recomputation graph was differentiated.")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class ReversibleSequential(nn.Module):
    """A sequence of invertible blocks whose inputs are reconstructed in backward instead of being kept.

    Why: a plain stack keeps every block's intermediate tensors for backward, so activation memory grows with
    depth; here only the stack's output is kept, and one block's tensors exist at a time during backward.

    Args:
        blocks: :class:`AdditiveCoupling`, :class:`AffineCoupling`, or any module with ``inverse(output)``.

    Raises:
        InvalidInputError: a block without ``inverse``.

    Example::

        stack = memtrim.ReversibleSequential(*[memtrim.AdditiveCoupling(nn.Sequential(
            nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))) for _ in range(16)])
        y = stack(torch.randn(32, 512))

    See NOTE [ reversible without backward inside backward ] in memtrim/techniques/reversible/sequential.py.
    """

    def __init__(self, *blocks: nn.Module, exact: bool = False, fraction_bits: int = 24,
                 check_drift: float | None = None) -> None:
        super().__init__()
        if exact and not all(type(b) is AdditiveCoupling for b in blocks):
            raise InvalidInputError(
                "memtrim.ReversibleSequential: exact=True needs AdditiveCoupling blocks (fixed-point addition is "
                "exact; an affine scale is not)."
            )
        if not 1 <= fraction_bits <= 40:
            raise InvalidInputError(
                f"memtrim.ReversibleSequential: fraction_bits must be in 1..40, got {fraction_bits}."
            )
        if check_drift is not None and not check_drift > 0:
            raise InvalidInputError(f"memtrim.ReversibleSequential: check_drift must be > 0, got {check_drift}.")
        self.exact, self.fraction_bits, self.check_drift = exact, fraction_bits, check_drift
        self.drift: dict[int, float] = {}  # block -> relative reconstruction error seen in the last backward
        self.keep_inputs: set[int] = set()  # blocks whose input is kept (drift above check_drift)
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module) or not callable(getattr(block, "inverse", None)):
                raise InvalidInputError(
                    f"memtrim.ReversibleSequential: block {i} ({type(block).__name__}) has no inverse(); wrap f and g "
                    "in memtrim.AdditiveCoupling or memtrim.AffineCoupling, or give the module an inverse method."
                )
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise InvalidInputError(f"memtrim.ReversibleSequential: input must be a tensor, got {type(x).__name__}.")
        if not torch.is_grad_enabled() or len(self.blocks) == 0:
            for block in self.blocks:
                x = block(x)
            return x
        frame = _Frame(self)
        frame.dtype = x.dtype
        if self.exact:
            x = self._to_fixed(x)
        h: torch.Tensor | _Halves = x  # between two couplings the stream stays split: no cat, no split
        for index, block in enumerate(self.blocks):
            if index in self.keep_inputs:
                frame.kept_inputs[index] = _whole(h).detach()
            elif self.check_drift is not None:
                frame.probes[index] = _probe(_whole(h))
            frame.parameter_versions[index] = [(p, p._version) for p in block.parameters()]
            h = self._run_block(frame, index, block, h)
        x = _whole(h)
        frame.set_output(x)
        hold_for_backward(frame.outputs[len(self.blocks) - 1], frame)
        for kept in frame.kept_inputs.values():
            hold_for_backward(kept, frame)
        if self.exact:
            return (x / frame.scale).to(frame.dtype)
        return x

    def _to_fixed(self, x: torch.Tensor) -> torch.Tensor:
        """The input on the fixed-point grid, as integer-valued float64 (exact below 2**53), with a straight-through
        gradient."""
        if not torch.isfinite(x.detach()).all():
            raise ReversibleError("memtrim.ReversibleSequential (exact): the input holds a non-finite value.")
        scaled = x.double() * float(2 ** self.fraction_bits)
        self._check_range(scaled, "the input")
        return scaled + (torch.round(scaled) - scaled).detach()

    def _check_range(self, stream: torch.Tensor, where: str) -> None:
        stream = stream.detach()  # checks must not record anything in the graph (isfinite saves via abs)
        if not torch.isfinite(stream).all():
            raise ReversibleError(f"memtrim.ReversibleSequential (exact): {where} produced a non-finite value.")
        limit = float(2 ** 53)
        if bool((stream.detach().abs() >= limit).any()):
            raise ReversibleError(
                f"memtrim.ReversibleSequential (exact): {where} overflows the fixed-point range "
                f"(|x| < 2**{53 - self.fraction_bits} with fraction_bits={self.fraction_bits}). Lower fraction_bits "
                "or keep activations smaller."
            )

    def _measure_drift(self, index: int, x: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
        rebuilt = x.detach().reshape(-1)[where].to(values.dtype)
        if values.numel() == 0:  # an empty batch: nothing was rebuilt, nothing drifted
            error = 0.0
        else:
            error = float((rebuilt - values).abs().max() / values.abs().max().clamp_min(1e-30))
        self.drift[index] = error
        if self.check_drift is not None and error > self.check_drift and index not in self.keep_inputs:
            import warnings

            warnings.warn(
                f"memtrim.ReversibleSequential: block {index} was reconstructed with relative error {error:.3e} "
                f"(> check_drift={self.check_drift}); from the next forward on its input is kept instead.",
                stacklevel=2,
            )
            self.keep_inputs.add(index)

    def drift_report(self) -> dict[int, float]:
        """Per block, the relative reconstruction error measured in the last backward (needs ``check_drift``)."""
        return dict(self.drift)

    def _run_block(self, frame: _Frame, index: int, block: nn.Module, x: torch.Tensor | _Halves
                   ) -> torch.Tensor | _Halves:
        def pack(tensor: torch.Tensor) -> _Handle:
            handle = _Handle(frame, index)
            frame.handles[index].append(weakref.ref(handle))
            return handle

        def unpack(handle: _Handle) -> torch.Tensor:
            return handle.frame.unpack(handle)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                if type(block) is AdditiveCoupling:
                    return self._additive(frame, index, block, x)
                if type(block) is AffineCoupling:
                    return self._affine(frame, index, block, x)
                x = _whole(x)
                with _captured(frame.replays[index], "block", x, f"block {index} ({type(block).__name__})"):
                    return block(x)
        except InvalidInputError as e:
            raise InvalidInputError(f"memtrim.ReversibleSequential: block {index}: {e}") from e

    @staticmethod
    def _affine(frame: _Frame, index: int, block: AffineCoupling, x: torch.Tensor | _Halves,
                recording: list[torch.Tensor] | None = None) -> _Halves:
        """AffineCoupling.forward, step by step: the random-number state is captured before f and before g (or,
        with ``recording``, replayed and the saved tensors recorded)."""
        def scale_shift(name: str, fn: nn.Module, half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if recording is None:
                with _captured(frame.replays[index], name, half, f"block {index}'s {name}"):
                    return block._scale_shift(name, fn, half)
            with _replayed(frame.replays[index][name]):
                return block._scale_shift(name, fn, half)

        with _recording(recording) if recording is not None else contextlib.nullcontext():
            x1, x2 = _split_halves(block, x)
            s, t = scale_shift("f", block.f, x2)
            y1 = x1 * s + t
            s, t = scale_shift("g", block.g, y1)
            y2 = x2 * s + t
        return _Halves(y1, y2, block.split_dim)

    def _additive(self, frame: _Frame, index: int, block: AdditiveCoupling, x: torch.Tensor | _Halves,
                  recording: list[torch.Tensor] | None = None) -> _Halves:
        """One additive coupling; in exact mode f and g see floats, the stream stays on the fixed-point grid.

        With ``recording`` (backward's recomputation of a block whose input was kept) the forward's random numbers
        and autocast are replayed and the saved tensors recorded, instead of captured."""
        def apply(name: str, fn: nn.Module, half: torch.Tensor) -> torch.Tensor:
            inp = (half / frame.scale).to(frame.dtype) if self.exact else half
            if recording is None:
                with _captured(frame.replays[index], name, inp, f"block {index}'s {name}"):
                    out = _checked(block, name, fn(inp), inp)
            else:
                with _replayed(frame.replays[index][name]), _recording(recording):
                    out = fn(inp)
            if not self.exact:
                return out
            scaled = out.double() * frame.scale
            self._check_range(scaled, f"block {index}'s {name}")
            return scaled + (torch.round(scaled) - scaled).detach()  # on the grid, straight-through gradient

        x1, x2 = _split_halves(block, x)
        y1 = x1 + apply("f", block.f, x2)
        y2 = x2 + apply("g", block.g, y1)
        if self.exact:
            self._check_range(y1, f"block {index}")
            self._check_range(y2, f"block {index}")
        return _Halves(y1, y2, block.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Reconstruct the stack's input from its output."""
        for block in reversed(self.blocks):
            y = block.inverse(y)
        return y

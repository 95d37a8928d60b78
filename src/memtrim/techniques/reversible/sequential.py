"""``ReversibleSequential``: a stack of invertible blocks whose activation memory does not grow with depth.

NOTE [ reversible without backward inside backward ]
The forward runs the blocks normally, so autograd records the ordinary graph of the whole stack, but every tensor
an op inside a block saves for backward is packed (saved-tensor hooks) as a small handle; nothing inside the stack
is kept except the stack's output. When backward first unpacks a handle of block ``i`` (blocks are reached last to
first), the block is *materialised*: its input is reconstructed from its output (the stack output, or the input
reconstructed for block ``i + 1``) and the computations whose saved tensors the graph needs are re-run, recording
what they save, in the forward's order; each handle then returns its tensor and is released with its node.

* A coupling's arithmetic lives once, in its ``couple`` / ``uncouple``; the stack passes what stands for f and g
  (capturing in forward, replaying and recording in backward).
* For an :class:`AdditiveCoupling` the inversion ``x2 = y2 - g(y1)``, ``x1 = y1 - f(x2)`` evaluates ``g`` and ``f``
  exactly where the forward did, so it is run with grad enabled and recorded: each of f and g runs once in backward.
  Any other block with an ``inverse`` is inverted without grad and re-run once (f and g twice).
* Between two couplings the stream stays split (:class:`_Halves`): the forward does not concatenate a block's
  halves for the next block to split again, and backward does not join their gradients; only the stack's output
  is concatenated.
* No backward inside backward: the graph is the ordinary one and is traversed once, so ``autograd.grad``, DDP
  (each parameter's gradient accumulated once) and an enclosing non-reentrant checkpoint work.
* Replay (``_replay.py``): the RNG states (CPU, and the accelerator the input lives on, captured with
  ``torch.utils.checkpoint.get_device_states``) before each of f and g, and the autocast state of both (enabled,
  dtype, cache_enabled, as checkpoint keeps it), are recorded in forward and restored for the recomputation, then
  the caller's states are put back (the global generator is never reseeded or advanced; a generator f or g drew
  nothing from is not touched at all); module buffers (BatchNorm's running statistics) are restored after it, so
  they are updated once per forward. A buffer the forward both changes and reads (spectral_norm's power-iteration
  vectors: updated, then used for the weight) must be what the forward started from when it is recomputed: each
  block's buffers are cloned before its forward, and the clones of those whose version moved are kept (and put in
  place for the recomputation); the others are dropped at once. BatchNorm's running statistics move inside torch's
  kernel without a version bump: not kept in training mode, which does not read them, kept in evaluation mode
  (:func:`_statistics_read`). A buffer written through ``.data``
  (an EMA codebook) moves none either, and its recomputation reads the new value: not seen. Every module's training
  flag is set as the forward had it for the recomputation, and put back after (an evaluation pass between forward
  and backward turns them off).
* A ``torch.Generator`` passed to an op explicitly (``torch.rand(..., generator=self.gen)``, a module's own
  generator) is not reachable from outside f or g: a torch-function mode records the draws of f's and g's forward and
  replays them in the recomputation (``techniques/_generators.py``); a recomputation that draws from explicit
  generators a different number of times than the forward raises :class:`ReversibleError`.
* The caller's tensors are never freed or modified. If the stack output, or a block's parameter, is modified in
  place before backward, reconstruction would be wrong: that raises (version counters, as autograd's own check).
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.nn.parameter import is_lazy

from ...errors import InvalidInputError, ReversibleError
from ...measure.hooks import hold_for_backward
from .._generators import SeededOps, _global_generators
from .._modes import (
    SCRIPTED,
    CachedParametrizations,
    Settings,
    Swaps,
    TrainingFlags,
    buffers_put_back,
    plain_settings,
    put_settings,
    scripted_inside,
    set_training_flags,
    training_flags,
    undo_swaps,
    written_in_place,
)
from ..guards import memtrims, plain_only
from ._replay import Replay, as_forward, captured, replayed
from .coupling import AdditiveCoupling, AffineCoupling, _checked, _split

__all__ = ["ReversibleSequential", "ReversibleError"]  # ReversibleError: re-exported from memtrim.errors

# NOTE [ a later forward's write ]: a frame checks at backward that the buffers its forward read and did not change
# are as it read them (a write between forward and backward would be read by the rebuild). A later forward of the
# same blocks before that backward may write one itself: an evaluation-mode forward with grad, then a training
# forward (its spectral norm's power iteration, an average only training updates), then one backward raised a false
# ReversibleError where plain training trains, until 2026-12-03 (an adversarial pass). Each forward clones a block's
# buffers before running it; where one moves, the clone taken at the version an earlier frame read is handed to that
# frame, which puts it in place for its rebuild as it does for the buffers its own forward changed. So is it to an
# earlier block of the same frame (one module in two blocks, the first reading what the second writes), also where
# the writing block raised (a loop that catches it goes on). A write outside any forward of the stack (the user's;
# ``stack.inverse()``, a block called on its own) still raises at backward.
_LIVE: list[weakref.ref[_Frame]] = []  # frames whose forward ran, until they are freed
_LIVE_LOCK = threading.Lock()


class _Handle:
    """What autograd keeps instead of a tensor saved inside the stack."""

    __slots__ = ("frame", "block", "tensor", "version", "meta", "__weakref__")

    def __init__(self, frame: _Frame, block: int, meta: tuple[torch.Size, torch.dtype]) -> None:
        self.frame, self.block, self.meta = frame, block, meta  # meta: the saved tensor's shape and dtype
        self.tensor: torch.Tensor | None = None  # filled when backward materialises the block
        self.version = 0  # the tensor's version then: autograd checks none under saved-tensor hooks


class _FLeft(NamedTuple):
    """What a coupling's f left for its g in the forward (NOTE [ f and g share a layer ])."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]  # a buffer f wrote, its value after f
    slots: Slots  # the parameters and buffers after f (f may set one anew: ``self.n = self.n + 1``)
    cache: dict[Any, torch.Tensor]  # the parametrize.cached() entries f made


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


def _split_halves(block: AdditiveCoupling | AffineCoupling, x: torch.Tensor | _Halves, *, as_chunks: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two halves block ``block`` reads. ``as_chunks`` (the forward, out of exact mode): the second, which f
    reads, laid out as the second chunk of the halves' concatenation, as a plain stack's block finds it."""
    if isinstance(x, _Halves) and x.dim == block.split_dim:
        return x.first, (_as_second_chunk(x) if as_chunks else x.second)
    return _split(block, _whole(x), block.split_dim)


def _as_second_chunk(halves: _Halves) -> torch.Tensor:
    """``halves.second`` with the strides and storage offset it would have as ``torch.cat(halves).chunk(2)[1]``
    (channels_last kept, as torch's cat keeps it).

    A plain stack concatenates each block's halves and the next block splits them: its f reads a chunk, which is not
    contiguous where the split is not on the leading dimension (features of a (batch, seq, features) input). torch's
    linear computes such an input otherwise than a contiguous one (the last bits differ on some CPUs: found by a
    helper's run of the test suite on an AMD EPYC host, 2026-11-29), so the stack copies the half into that layout
    (half the bytes a cat moves; nothing is kept)."""
    first, second, dim = halves.first, halves.second, halves.dim % halves.second.dim()
    shape = list(second.shape)
    shape[dim] += first.shape[dim]
    # torch.cat lays its output out as its inputs where they share a channels-last layout (a CNN stack on a
    # channels_last input), else contiguous; innermost dimension first
    order = list(range(len(shape) - 1, -1, -1))
    if len(shape) in (4, 5):
        channels_last = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
        if all(t.is_contiguous(memory_format=channels_last) and not t.is_contiguous() for t in (first, second)):
            order = [1, *range(len(shape) - 1, 1, -1), 0]
    strides = [1] * len(shape)
    step = 1
    for d in order:
        strides[d] = step
        step *= shape[d]
    offset = first.shape[dim] * strides[dim]
    if second.stride() == tuple(strides):  # (a split on the leading dimension: the chunk is contiguous too)
        return second
    if second.numel() == 0:
        return second
    laid = second.new_empty(math.prod(shape)).as_strided(second.shape, strides, offset)
    return laid.copy_(second)


def _coupling(block: nn.Module) -> type[AdditiveCoupling] | type[AffineCoupling] | None:
    """The coupling whose arithmetic the stack runs for ``block`` itself (its f and g captured and replayed one by
    one), or None for a block run whole and inverted by its ``inverse``. A subclass counts where it keeps the
    coupling's methods that say which of f and g run in which order (it may add others, or override ``mix``): a
    subclass with dropout in f was inverted whole, g's mask drawn before f's, and trained 366 off, silently, until
    2026-12-03 (an adversarial pass)."""
    for kind in (AdditiveCoupling, AffineCoupling):
        if isinstance(block, kind):
            # (checked_call: f and g's calls, which the stack makes itself; couple and uncouple: the order of f's
            # and g's calls, which the rebuild records in the base's order; a couple calling g first trained 13.7
            # off, silently, until 2026-12-03)
            same = all(getattr(type(block), name) is getattr(kind, name)
                       for name in ("forward", "inverse", "checked_call", "couple", "uncouple", "scale_shift")
                       if hasattr(kind, name))
            return kind if same else None
    return None


def _inverse(block: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """A block's ``inverse`` method (checked to exist when the stack was built)."""
    inverse: Callable[[torch.Tensor], torch.Tensor] = getattr(block, "inverse")  # noqa: B009 - typed, not Module's
    return inverse


_PROBE_ELEMENTS = 1024
"""How many elements of each of two kinds (:func:`_scattered`) ``check_drift`` keeps of a block's input, and the
inverse check reads of a block's output."""

_SCATTER = 2654435761  # a prime (Knuth's multiplicative hash): k * _SCATTER mod n visits every residue class of n


def _scattered(shape: torch.Size, count: int, device: torch.device) -> torch.Tensor:
    """Indices into a tensor of ``shape`` (as ``torch.take`` reads it): where it has more than ``2 * count`` elements,
    ``count`` whose coordinate along every dimension runs through its values (every channel, every feature, up to
    ``count`` of them), and ``count`` scattered over the whole, ``k * p mod numel`` for a prime ``p`` prime to it;
    else all. Evenly spaced indices (until 2026-12-03) fell on one feature of a (tokens, 256) tensor, whose spacing
    256 divides, and scattered ones alone missed 36 of 192 channels of a (2, 192, 16, 16) one: a rebuild off on one
    feature or channel alone (a norm with a large bias there) went unseen, 8.2e-4 and 9.2e-4 against a tolerance of
    1e-4 (adversarial passes). In integers (float32's linspace rounded the last index past the end from 2**24
    elements up: an IndexError in backward)."""
    numel = math.prod(shape)
    if 2 * count >= numel:
        return torch.arange(numel, device=device)
    k = torch.arange(count, device=device)
    along = torch.zeros(count, dtype=torch.int64, device=device)
    stride = 1
    for size in reversed(shape):
        along += k % size * stride
        stride *= size
    prime = _SCATTER
    while math.gcd(prime, numel) != 1:
        prime += 2
    return torch.cat([along, k * prime % numel])


def _probe(x: torch.Tensor) -> torch.Tensor:
    """``2 * _PROBE_ELEMENTS`` elements of a block input (:func:`_scattered`), read where they lie (8 KB in float32,
    kept until backward; their indices are made again there) to check its reconstruction against."""
    return torch.take(x.detach(), _scattered(x.shape, _PROBE_ELEMENTS, x.device))


_CHOOSES_BY_VALUE = (
    "Or it does, and chooses by value (top-k routing of a mixture of experts, a threshold, an argmax): the input its "
    "inverse rebuilt is a rounding off the forward's (float32: about 1e-7 relative per block, more after a norm "
    "with a large bias), which can choose otherwise. To fix: exact=True (a bit-exact rebuild of couplings), float64, "
    "or keep the block out of the reversible stack.")
"""(found by an adversarial pass on 2026-12-03: the message said only that the block depends on more than its input)"""


@contextlib.contextmanager
def _recording(into: list[torch.Tensor]) -> Iterator[None]:
    def pack(tensor: torch.Tensor) -> None:
        into.append(tensor.detach())

    def unpack(_: None) -> torch.Tensor:
        # a tensor the rebuild computed reached a graph that is differentiated: said as the user's code (it read as
        # memtrim's bug, naming no fix, until 2026-12-03: an adversarial pass's auxiliary losses in a list)
        raise ReversibleError(
            "memtrim.ReversibleSequential: a tensor computed while backward rebuilt a block (its f, g or forward run "
            "again) is part of a later loss: the block hands out values besides its output (an auxiliary loss "
            "appended to a list, a cache kept on a module), and its rebuild handed out more. Expected a block whose "
            "only result is its output; to fix: clear such a list just before each forward (not after building the "
            "loss), or keep the block out of the reversible stack.")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _DriftLog:
    """The stack's drift state, shared with each forward's frame: the last measured error per block and the blocks
    whose input is kept from the next forward on (its error exceeded ``check_drift``)."""

    def __init__(self, check_drift: float | None) -> None:
        self.check_drift = check_drift
        self.drift: dict[int, float] = {}
        self.keep_inputs: set[int] = set()
        # blocks whose inverse was checked (_Frame._check_inverse), with their modules' training flags then: a block
        # whose inverse misreads in training mode only was checked in an evaluation forward with grad and never
        # again, 3.9e-2 off after 3 steps, silently, until 2026-12-03 (an adversarial pass)
        self.checked: set[tuple[int, tuple[bool, ...]]] = set()

    def measure(self, index: int, x: torch.Tensor, values: torch.Tensor) -> None:
        rebuilt = _probe(x).to(values.dtype)
        if values.numel() == 0:  # an empty batch: nothing was rebuilt, nothing drifted
            error = 0.0
        else:
            error = float((rebuilt - values).abs().max() / values.abs().max().clamp_min(1e-30))
        self.drift[index] = error
        if self.check_drift is not None and not error <= self.check_drift and index not in self.keep_inputs:  # NaN too
            warnings.warn(
                f"memtrim.ReversibleSequential: block {index} was reconstructed with relative error {error:.3e} "
                f"(> check_drift={self.check_drift}); from the next forward on its input is kept instead.",
                stacklevel=2,
            )
            self.keep_inputs.add(index)


def _live_frames() -> list[_Frame]:
    """The frames whose backward may still check buffer versions (NOTE [ a later forward's write ])."""
    if not _LIVE:
        return []
    with _LIVE_LOCK:
        return [f for f in (ref() for ref in _LIVE) if f is not None]


BuffersThen = list[tuple[torch.Tensor, int, torch.Tensor]]
"""A block's buffers before its forward: each with its version and a clone (:func:`_buffers_then`)."""


def _buffers_then(block: nn.Module) -> BuffersThen:
    with torch.no_grad():
        return [(b, b._version, b.clone()) for b in block.buffers()]


def _hand_over(before: BuffersThen) -> None:
    """Hand each buffer a block's forward moved since ``before`` (a frame's forward, or a plain one under
    ``no_grad``), as it was at the version then (its clone), to the live frames that read it at that version: earlier
    ones, and earlier blocks of the frame running (one module in two blocks, the first reading what the second
    writes) (NOTE [ a later forward's write ])."""
    values = {(id(b), version): value for b, version, value in before if b._version != version}
    if not values:
        return
    for other in [f for f in _live_frames() if not f.checking.isdisjoint(values)]:
        for index, versions in enumerate(other.buffer_versions):
            if any((id(b), version) in values for b, version in versions):
                other.buffers_before[index] += [(b, values[id(b), version]) for b, version in versions
                                                if (id(b), version) in values]
                other.buffer_versions[index] = [(b, version) for b, version in versions
                                                if (id(b), version) not in values]


Slots = list[tuple[dict[str, Any], dict[str, Any], bool]]
"""Each of a block's modules' tables of parameters and of buffers, its entries then (``register_buffer(name, None)``
ones too: they were left out and deleted as added since, and a buffer a forward fills lost its registration, until
2026-12-03, an adversarial pass), and whether it holds buffers."""


def _slots(block: nn.Module) -> Slots:
    """``block``'s modules' tables of parameters and buffers, with their entries now."""
    return [(table, dict(table), held) for sub in block.modules()
            for table, held in ((sub._parameters, False), (sub._buffers, True))]


def _snapshot(slots: Slots) -> Slots:
    """The tables of ``slots`` with their entries now."""
    return [(table, dict(table), held) for table, _, held in slots]


def _buffers_in(slots: Slots) -> list[torch.Tensor]:
    return [b for _, entries, held in slots if held for b in entries.values() if b is not None]


def _differs(slots: Slots) -> bool:
    """Whether any table's entries are other objects than those recorded (or other names)."""
    return any(table.keys() != entries.keys() or any(table[k] is not v for k, v in entries.items())
               for table, entries, _ in slots)


def _put_slots(slots: Slots) -> None:
    """Put the tables' entries back as recorded, removing any added since (a buffer a forward registers at its first
    call: left in place, the rebuild read the forward's, 1.0 off after one step, silently, until 2026-12-03, an
    adversarial pass)."""
    for table, entries, _ in slots:
        if table.keys() != entries.keys():
            for key in [k for k in table if k not in entries]:
                del table[key]
        table.update(entries)


def _filled(slots: Slots) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
    """The buffers registered as ``None`` that a forward filled, with what it filled them with: a block's inverse
    reads them so (NOTE [ what a block's inverse reads ]: it found None, which no inverse can read)."""
    return [(table, key, table[key]) for table, entries, held in slots if held
            for key, value in entries.items() if value is None and isinstance(table.get(key), torch.Tensor)]


def _batchnorm_count(block: nn.Module, buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is a BatchNorm's ``num_batches_tracked`` in ``block``: a later training forward advances it,
    and a forward in evaluation does not read it (a training one that does moved it itself)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.num_batches_tracked is buffer
               for m in block.modules())


def _statistics_read(modes: TrainingFlags) -> set[int]:
    """The ids of the running statistics a block's norms in evaluation (``modes``: its modules and their training
    flags in its forward) read in its forward: a later training
    forward updates them inside torch's kernel, moving no version counter (an evaluation-mode forward with grad, a
    training forward, then one backward: the rebuild read the new statistics, 3.46 off the gradient of the forward
    that ran, silently, until 2026-12-03: an adversarial pass)."""
    return {id(buffer) for m, training in modes
            if not training and isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
            for buffer in (m.running_mean, m.running_var) if buffer is not None}


def _refuse_sharded(index: int, block: nn.Module) -> None:
    """Refuse a block, or a module inside it, that FSDP2's ``fully_shard`` made a unit of its own: FSDP2 reshards its
    parameters after its forward, and the stack's rebuild in backward calls f and g before FSDP2 unshards them (torch's
    "mixed torch.Tensor and DTensor" error there; a block's own unit was refused for its hooks, the message pointing
    at f and g). One unit around the whole stack keeps them unsharded until its backward ends, and trains."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kinds = tuple(k for k in (getattr(fsdp, "FSDPModule", None),
                              getattr(sys.modules.get("torch.distributed._composable.fsdp"), "FSDPModule", None))
                  if isinstance(k, type))
    if not kinds or not any(isinstance(m, kinds) for m in block.modules()):
        return
    sharded = next(name for name, m in block.named_modules() if isinstance(m, kinds))
    where = f"its module {sharded!r}" if sharded else "the block itself"
    raise InvalidInputError(
        f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) is sharded by FSDP2's fully_shard "
        f"({where}). The stack rebuilds each block's input in backward by calling its f and g, whose parameters "
        "FSDP2 has resharded after their forward. Expected the stack's blocks unsharded apart; to fix: one "
        "fully_shard around the whole ReversibleSequential (or a module holding it)."
    )


def _refuse_hooks(index: int, block: nn.Module) -> None:
    """Refuse hooks on a block (and global backward hooks): the stack runs a coupling's arithmetic itself, so none of
    them would run there, and backward rebuilds a block's input by inverting its output, which a hook that changes the
    output breaks (a user's invertible block, called as a module, has its forward hooks run twice). A forward
    pre-hook on a user's block is allowed (``weight_norm``'s recomputes the weight): it runs in the forward and again
    in backward's rebuild (README). Hooks on the modules inside f and g run."""
    _refuse_sharded(index, block)
    module_hooks = torch.nn.modules.module
    tables = [("forward", block._forward_hooks), ("backward", block._backward_hooks),
              ("backward pre-", block._backward_pre_hooks), ("global backward", module_hooks._global_backward_hooks),
              ("global backward pre-", module_hooks._global_backward_pre_hooks)]
    if isinstance(block, (AdditiveCoupling, AffineCoupling)):
        tables.append(("forward pre-", block._forward_pre_hooks))
    found = [kind for kind, table in tables if any(not memtrims(hook) for hook in table.values())]
    # (memtrim's own, convert's trace and the tracker's, are left alone)
    if found:
        raise InvalidInputError(
            f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) has {' and '.join(found)} hooks. "
            "Expected no hooks on the blocks themselves: the stack rebuilds each block's input from its output in "
            "backward and runs a coupling's arithmetic itself, so such hooks would not run, or would change an "
            "output that is then inverted (a forward hook that scales it trained 0.06 off, silently). To fix: "
            "register the hook on a module inside the block's f or g, or on the ReversibleSequential itself."
        )


class _Frame:
    """One forward of the stack and its backward: runs the blocks (capturing what to replay), keeps the output and
    the handles per block, and rebuilds each block's input when backward first needs one of its tensors."""

    def __init__(self, blocks: list[nn.Module], exact: bool, fraction_bits: int, dtype: torch.dtype,
                 drift: _DriftLog) -> None:
        self.blocks = blocks
        self.exact, self.scale, self.dtype, self.drift = exact, float(2 ** fraction_bits), dtype, drift
        self.fraction_bits = fraction_bits
        self.cached: list[CachedParametrizations | None] = [None for _ in blocks]  # NOTE [ parametrize.cached() ]
        self.handles: list[list[weakref.ref]] = [[] for _ in blocks]
        self.replays: list[dict[str, Replay]] = [{} for _ in blocks]
        self.outputs: dict[int, torch.Tensor | _Halves] = {}  # block index -> its output (the next block's input)
        self.output_version = 0
        self.materialised: set[int] = set()
        self.probes: dict[int, torch.Tensor] = {}  # block -> elements of its input (_probe)
        # blocks whose drift exceeded the tolerance before, or that drew random numbers: input, its version then
        self.kept_inputs: dict[int, torch.Tensor] = {}
        self.kept_versions: dict[int, int] = {}
        self.parameter_versions: list[list[tuple[torch.Tensor, int]]] = [[] for _ in blocks]
        self.parameter_flags: list[list[bool]] = [[] for _ in blocks]  # their requires_grad in the forward
        # each block's parameters and buffers as its forward read them, in their modules' slots:
        # torch.func.functional_call (MAML's fast weights) puts the module's own back before backward, a loop may
        # set a new buffer between forward and backward (a schedule's scale: the rebuild read the new one, 0.058 off
        # after 3 steps, silently, until 2026-12-03, an adversarial pass), and the rebuild must read the forward's
        self.slots: list[Slots] = [[] for _ in blocks]
        self.classes: list[list[type]] = [[] for _ in blocks]  # each module's class in the forward
        self.set_anew: list[bool] = [False for _ in blocks]  # whether the forward set any of them anew
        self.buffers_before: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in blocks]  # changed by forward
        # the buffers the forward did not change, with their versions: one written in place before backward
        # (``scale.mul_(1.5)``) was read written by the rebuild, 67 off, silently, until 2026-12-03 (an adversarial
        # pass; the plain stack's autograd raises where an op saved it); a BatchNorm's count is left out
        # (_batchnorm_count)
        self.buffer_versions: list[list[tuple[torch.Tensor, int]]] = [[] for _ in blocks]
        self.checking: set[tuple[int, int]] = set()  # (id, version) of every buffer in them, for _hand_over
        self.drawn: set[int] = set()  # blocks run whole whose forward drew random numbers
        # every module's training flag in the block's forward: an evaluation pass between forward and backward
        # (model.eval(), then no_grad) turns them off, and the recomputation must run as the forward ran
        self.modes: list[TrainingFlags] = [[] for _ in blocks]
        # each block's modules' attributes (plain_settings) as each call the rebuild repeats found them: a coupling's
        # f and g ("f", "g"), a block of the user's ("block"), what f, g or its forward run again reads (a count the
        # forward advances and reads: the rebuild read it advanced, 2.6e-2 off after 4 steps; f setting an attribute g
        # reads: 4.6e-2; f and g one module with a count: 2.0e-2; a temperature annealed before backward: 0.023; all
        # silently until 2026-12-03, adversarial passes) ...
        self.found: list[dict[str, Settings]] = [{} for _ in blocks]
        # ... and a block of the user's as its forward left them, what its own inverse reads (what its forward keeps
        # for it: the stack called twice before one backward, each rebuild reads its own)
        self.left: list[Settings] = [[] for _ in blocks]
        self.f_left: list[_FLeft] = [_FLeft([], [], {}) for _ in blocks]  # NOTE [ f and g share a layer ]
        self.filled: list[list[tuple[dict[str, Any], str, torch.Tensor]]] = [[] for _ in blocks]  # _filled

    # ------------------------------------------------------------------------------------------------ forward

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The stack's forward: every tensor a block saves is packed as a handle; the output is kept."""
        with _LIVE_LOCK:  # (now: a block may write what an earlier one read, NOTE [ a later forward's write ])
            _LIVE[:] = [ref for ref in _LIVE if ref() is not None] + [weakref.ref(self)]
        if self.exact:
            x = self._to_fixed(x)
        h: torch.Tensor | _Halves = x  # between two couplings the stream stays split: no cat, no split
        for index, block in enumerate(self.blocks):
            if index in self.drift.keep_inputs:
                self.kept_inputs[index] = _whole(h).detach()
                self.kept_versions[index] = self.kept_inputs[index]._version
            elif self.drift.check_drift is not None:
                self.probes[index] = _probe(_whole(h))
            versions: list[tuple[torch.Tensor, int]] = [(p, p._version) for p in block.parameters()]
            self.parameter_versions[index] = versions
            self.parameter_flags[index] = [p.requires_grad for p, _ in versions]
            if any(is_lazy(p) for p, _ in versions):  # (not isinstance: torch < 2.5 says a fake Parameter is one)
                # its first forward initialises them, drawing from the global generator; the recomputation, finding
                # them initialised, draws nothing, and a dropout after draws another mask (an adversarial pass)
                name = next(n for n, p in block.named_parameters() if is_lazy(p))
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index}'s parameter {name} is not initialised yet (a lazy "
                    "module, nn.LazyLinear): its first forward initialises it, which the recomputation in backward "
                    "cannot repeat. Expected initialised parameters; to fix: run the model once on an example "
                    "batch under torch.no_grad() before training (or before building the optimizer).")
            self.slots[index] = _slots(block)
            self.modes[index] = training_flags(block.modules())
            before = _buffers_then(block)
            h_in, version_in = h, h._version if isinstance(h, torch.Tensor) else 0
            cached = self.cached[index] = CachedParametrizations.start()
            try:
                h = self._run_block(index, block, h)
            finally:  # (a block that raised may have written some: a loop that catches it goes on)
                _hand_over(before)
            if cached is not None:
                cached.end()
            if _coupling(block) is None:
                self.left[index] = plain_settings(block.modules())
            self.filled[index] = _filled(self.slots[index])
            self.set_anew[index] = self.set_anew[index] or _differs(self.slots[index])
            self.classes[index] = [type(m) for m, _ in self.modes[index]]  # (after: one may set its own class)
            # the statistics an evaluation forward read, kept, and checked too (a write of the user's raises)
            read = _statistics_read(self.modes[index])
            self.buffers_before[index] = [(b, value) for b, version, value in before
                                          if b._version != version or id(b) in read]
            self.buffer_versions[index] = [(b, version) for b, version, _ in before if b._version == version]
            # (and those it filled from None: written in place before backward, they were read so, 1.3e-2 off, or
            # trained on where plain autograd raises, silently, on an intermediate commit of 2026-12-03)
            self.buffer_versions[index] += [(b, b._version) for _, _, b in self.filled[index]]
            self.checking.update((id(b), version) for b, version in self.buffer_versions[index])
            moved = next((p for p, version in versions if p._version != version), None)
            if moved is not None:
                # (found by adversarial passes on 2026-12-03: a clamp before the use trained, after it the rebuild
                # read the clamped value, 21 off, silently; before that, a false "modified after the forward")
                name = next((n for n, p in block.named_parameters() if p is moved), "?")
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index}'s forward changed its parameter {name} in place (a "
                    "clamp or decay under torch.no_grad?). The stack cannot tell whether the forward read it before "
                    "or after the change, and rebuilding the block's input in backward would read the changed value. "
                    "Expected a forward that leaves its parameters alone; to fix: make the change in the training loop "
                    "(after optimizer.step()), or keep the block out of the reversible stack.")
            if index in self.drawn and index not in self.kept_inputs:
                self._keep_drawing(index, block, h_in, version_in)
        x = _whole(h)
        last = len(self.blocks) - 1
        self.outputs[last] = x.detach()  # detached: no cycle through the output's grad_fn
        self.output_version = x._version
        hold_for_backward(self.outputs[last], self)
        for kept in self.kept_inputs.values():
            hold_for_backward(kept, self)
        if self.exact:
            return (x / self.scale).to(self.dtype)
        return x

    def _keep_drawing(self, index: int, block: nn.Module, x: torch.Tensor | _Halves, version: int) -> None:
        """Keep the input of a block run whole that drew random numbers in its forward: its ``inverse`` cannot draw
        them as the forward did (a coupling's inverse evaluates g before f), so an input rebuilt by it under the
        forward's state is not the forward's (a RevViT-style block with dropout trained 416 off, silently, until
        2026-12-03: an adversarial pass). Kept from now on, as a block over the drift tolerance is."""
        if isinstance(x, torch.Tensor) and x._version != version:
            raise ReversibleError(
                f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) drew random numbers in its "
                "forward and modified its input in place, so its input can neither be rebuilt by its inverse (which "
                "cannot draw the forward's numbers) nor kept. Expected a block that leaves its input as it found it; "
                "to fix: compute out of place, or build the block from memtrim.AdditiveCoupling / AffineCoupling.")
        self.kept_inputs[index] = _whole(x).detach()
        self.kept_versions[index] = version
        if index not in self.drift.keep_inputs:
            warnings.warn(
                f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) drew random numbers in its "
                "forward (a dropout?), which its inverse() cannot draw as the forward did (an inverse evaluates its "
                "functions in another order), so its input is kept for backward from now on (its activations, if it "
                "holds a stack of its own, are still rebuilt). To rebuild it instead: build the block from "
                "memtrim.AdditiveCoupling or AffineCoupling, whose f and g the stack replays one by one, or draw no "
                "random numbers in it.", stacklevel=4)
            self.drift.keep_inputs.add(index)

    def _run_block(self, index: int, block: nn.Module, x: torch.Tensor | _Halves) -> torch.Tensor | _Halves:
        def pack(tensor: torch.Tensor) -> _Handle:
            handle = _Handle(self, index, (tensor.shape, tensor.dtype))
            self.handles[index].append(weakref.ref(handle))
            return handle

        def unpack(handle: _Handle) -> torch.Tensor:
            return handle.frame.unpack(handle)

        _refuse_hooks(index, block)
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                kind = _coupling(block)
                if kind is AdditiveCoupling:
                    return self._additive(index, cast(AdditiveCoupling, block), x)
                if kind is AffineCoupling:
                    return self._affine(index, cast(AffineCoupling, block), x)
                x = _whole(x)
                self.found[index]["block"] = plain_settings(block.modules())
                generators = _global_generators()
                seeded = SeededOps()
                with captured(self.replays[index], "block", x, f"block {index} ({type(block).__name__})") as draws, \
                        seeded:
                    out = block(x)
                # an op that draws (seen even under fork_rng, which leaves the generators as it found them), a draw
                # from an explicit generator, or the global generators moved otherwise (a C++ extension's draw)
                if seeded.drew or draws.states or _global_generators() != generators:
                    self.drawn.add(index)
                return out
        except InvalidInputError as e:
            raise InvalidInputError(f"memtrim.ReversibleSequential: block {index}: {e}") from e

    def _additive(self, index: int, block: AdditiveCoupling, x: torch.Tensor | _Halves,
                  recorded: list[torch.Tensor] | None = None) -> _Halves:
        """One additive coupling; in exact mode f and g see floats, the stream stays on the fixed-point grid.

        The random-number and autocast state is captured before each of f and g; with ``recorded`` (backward's
        recomputation of a block whose input was kept) it is replayed instead, and f's and g's saved tensors
        recorded."""
        def evaluate(name: str, fn: nn.Module, half: torch.Tensor) -> torch.Tensor:
            inp = self._from_stream(half)
            if recorded is None:
                self.found[index][name] = plain_settings(block.modules())
                with captured(self.replays[index], name, inp, f"block {index}'s {name}"), \
                        self._leaving(index, name, block):
                    out = fn(inp)
                out = _checked(block, name, out, inp)
            else:  # a half of the kept input, laid out as the forward's (an op saves other tensors for another)
                replay = self.replays[index][name]
                # (made before the replay: inside it, f or g alone runs, as in the forward, so that NOTE [ another
                # thread's draws ] sees the same calls in both)
                inp = as_forward(inp.detach(), replay).requires_grad_(replay.requires_grad)
                with _recording(recorded), replayed(replay), self._as_found(index, name):
                    out = fn(inp)
            return self._on_grid(out, f"block {index}'s {name}") if self.exact else out

        y1, y2 = block.couple(*_split_halves(block, x, as_chunks=recorded is None and not self.exact), evaluate)
        if self.exact:
            self._check_range(y1, f"block {index}")
            self._check_range(y2, f"block {index}")
        return _Halves(y1, y2, block.split_dim)

    def _affine(self, index: int, block: AffineCoupling, x: torch.Tensor | _Halves,
                recorded: list[torch.Tensor] | None = None) -> _Halves:
        """One affine coupling, capturing (or, with ``recorded``, replaying and recording) as :meth:`_additive`."""
        def scale_shift(name: str, fn: nn.Module, half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if recorded is None:
                self.found[index][name] = plain_settings(block.modules())
                with captured(self.replays[index], name, half, f"block {index}'s {name}"), \
                        self._leaving(index, name, block):
                    return block.scale_shift(name, fn, half)
            replay = self.replays[index][name]  # a half of the kept input, laid out as the forward's
            half = as_forward(half.detach(), replay).requires_grad_(replay.requires_grad)
            with replayed(replay), self._as_found(index, name):
                return block.scale_shift(name, fn, half)

        recording: contextlib.AbstractContextManager[Any] = (
            _recording(recorded) if recorded is not None else contextlib.nullcontext())
        with recording:
            y1, y2 = block.couple(*_split_halves(block, x, as_chunks=recorded is None and not self.exact),
                                  scale_shift)
        return _Halves(y1, y2, block.split_dim)

    # ------------------------------------------------------------------------------------- exact mode (fixed point)

    def _to_fixed(self, x: torch.Tensor) -> torch.Tensor:
        """The input on the fixed-point grid, as integer-valued float64 (exact below 2**53), with a straight-through
        gradient."""
        if not torch.isfinite(x.detach()).all():
            raise ReversibleError("memtrim.ReversibleSequential (exact): the input holds a non-finite value.")
        return self._on_grid(x, "the input")

    def _on_grid(self, out: torch.Tensor, where: str) -> torch.Tensor:
        """``out`` scaled and rounded to the fixed-point grid, with a straight-through gradient (forward)."""
        scaled = out.double() * self.scale
        self._check_range(scaled, where)
        return scaled + (torch.round(scaled) - scaled).detach()

    def _to_stream(self, out: torch.Tensor) -> torch.Tensor:
        """f's or g's output as added to the stream: itself, or (exact mode) its value on the grid (backward)."""
        return torch.round(out.double() * self.scale) if self.exact else out

    def _from_stream(self, half: torch.Tensor) -> torch.Tensor:
        """What f or g receives: the half itself, or (exact mode) its value back in floating point."""
        return (half / self.scale).to(self.dtype) if self.exact else half

    def _check_range(self, stream: torch.Tensor, where: str) -> None:
        stream = stream.detach()  # checks must not record anything in the graph (isfinite saves via abs)
        if not torch.isfinite(stream).all():
            raise ReversibleError(f"memtrim.ReversibleSequential (exact): {where} produced a non-finite value.")
        if bool((stream.abs() >= float(2 ** 53)).any()):
            raise ReversibleError(
                f"memtrim.ReversibleSequential (exact): {where} overflows the fixed-point range "
                f"(|x| < 2**{53 - self.fraction_bits} with fraction_bits={self.fraction_bits}). Lower fraction_bits "
                "or keep activations smaller."
            )

    # ----------------------------------------------------------------------------------------------- backward

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
        if tensor._version != handle.version:
            # a second backward through the graph (retain_graph=True) after an optimizer step: the recomputed
            # tensors (a Linear's weight) changed since, and plain training raises autograd's error here (this
            # one trained silently on the new weights: an adversarial pass on 2026-12-02)
            raise ReversibleError(
                f"memtrim.ReversibleSequential: one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: a tensor block {handle.block} saved (shape {tuple(tensor.shape)}, "
                f"a parameter or its view) is at version {tensor._version}, expected {handle.version}, as autograd "
                "says in plain training. Expected no change between the backward passes through one graph; to fix: "
                "step the optimizer after the last backward (or run the forward again after the step).")
        return tensor

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
        """Rebuild block ``index``'s input and re-run what its saved tensors need; fill its handles."""
        if index in self.materialised:
            return
        block = self.blocks[index]
        self._check_parameters(index, block)
        recorded: list[torch.Tensor] = []
        saved_buffers = [(b, b.detach().clone()) for b in block.buffers()]
        modes_now = training_flags(m for m, _ in self.modes[index])
        slots_now = _snapshot(self.slots[index])  # as backward found them
        # a parameter frozen or unfrozen between forward and backward: the recomputation runs with the forward's
        # flags, so it saves what the forward saved (it raised a false "saved 10 tensors ... 8" before: an
        # adversarial pass); autograd then treats the parameter as plain training does
        flipped = [p for (p, _), flag in zip(self.parameter_versions[index], self.parameter_flags[index])
                   if p.requires_grad != flag]
        # a coupling's rebuild runs f and g as its forward did (each around its own call too: _as_found); a block of
        # the user's runs its inverse on what its forward left (and its forward again on what that forward found:
        # _rebuild_generic), or, its input kept, its forward on what it found
        found = self.found[index]
        whole = _coupling(block) is None and index not in self.kept_inputs
        settings = self.left[index] if whole else found.get("f", found.get("block", []))
        written = next((w for w in map(written_in_place, [self.left[index]] if whole else found.values()) if w), None)
        if written is not None:
            raise ReversibleError(f"memtrim.ReversibleSequential: in block {index}, {written}.")
        attributes: Swaps = []
        try:
            attributes = put_settings(settings)
            for p in flipped:
                p.requires_grad_(not p.requires_grad)
            _put_slots(self.slots[index])  # the forward's (functional_call's, put back since; set anew since)
            with torch.no_grad():
                for buffer, value in self.buffers_before[index]:
                    buffer.data.copy_(value)  # what the forward read (the NOTE above; NOTE [ buffers put back ])
            set_training_flags(self.modes[index])  # as in the forward
            cached = self.cached[index]
            with buffers_put_back(), cached.recomputing() if cached is not None else contextlib.nullcontext():
                x = self._rebuild(index, block, recorded)
        finally:
            undo_swaps(attributes)
            for p in flipped:
                p.requires_grad_(not p.requires_grad)
            _put_slots(slots_now)
            with torch.no_grad():
                for buffer, value in saved_buffers:
                    buffer.data.copy_(value)  # running statistics: updated once, by the forward
            set_training_flags(modes_now)
        handles = self.handles[index]
        if len(recorded) != len(handles):
            raise ReversibleError(
                f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) saved {len(handles)} tensors "
                f"in forward but {len(recorded)} when recomputed; its computation must not depend on anything but "
                f"its input (and the replayed random numbers). {_CHOOSES_BY_VALUE}"
            )
        for ref, tensor in zip(handles, recorded):
            handle = ref()
            if handle is not None and handle.meta != (tensor.shape, tensor.dtype):
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}) saved a tensor of shape "
                    f"{tuple(handle.meta[0])} ({handle.meta[1]}) in forward where its recomputation saved one of shape "
                    f"{tuple(tensor.shape)} ({tensor.dtype}); its computation must not depend on anything but its "
                    f"input (and the replayed random numbers). {_CHOOSES_BY_VALUE}"
                )
        for ref, tensor in zip(handles, recorded):
            handle = ref()
            if handle is not None:
                handle.tensor, handle.version = tensor, tensor._version
        self.materialised.add(index)
        # (kept until the rebuild succeeded: a backward retried on the same graph after an error in a rebuild (an
        # out-of-memory caught) rebuilt from the buffers as backward found them, 0.10 off, silently, until 2026-12-03)
        self.buffers_before[index] = []
        self.f_left[index] = _FLeft([], [], {})
        self.filled[index] = []
        self.kept_inputs.pop(index, None)
        if index in self.probes:
            self.drift.measure(index, _whole(x), self.probes.pop(index))
        if index > 0:
            self.outputs[index - 1] = x
        self.outputs.pop(index, None)  # this block's output is no longer needed: one boundary alive at a time

    # NOTE [ buffers put back ]: a rebuild sets the block's buffers to what its forward read, and back after to what
    # backward found, through ``.data``: values each buffer held before, so no version counter moves. A graph that
    # saved a buffer (a parametrization computed and cached outside the stack saves orthogonal's ``base``) found its
    # version moved by these restores: autograd's in-place error, where the plain stack trains (found 2026-12-03).

    def _rebuild(self, index: int, block: nn.Module, recorded: list[torch.Tensor]) -> torch.Tensor | _Halves:
        """Block ``index``'s input, recording into ``recorded`` what its forward saved, in the forward's order."""
        if index in self.kept_inputs:  # drift fallback: the input was kept, recompute forward from it
            x = self.kept_inputs[index]
            if x._version != self.kept_versions[index]:
                # the stack's input, changed by the caller (plain training raises autograd's in-place error there;
                # this recomputed from the new values, silently, until 2026-12-03)
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index}'s input, kept for backward, was modified in place "
                    f"after the forward (version {self.kept_versions[index]}, now {x._version}), as autograd says of "
                    "a saved tensor in plain training. Expected the stack's input unchanged until backward; to fix: "
                    "clone it before changing it.")
            self._recompute_forward(index, block, x, recorded)
            return x
        kind = _coupling(block)
        if kind is AdditiveCoupling:
            additive = cast(AdditiveCoupling, block)
            return self._rebuild_additive(index, additive, *_split_halves(additive, self._stored_output(index)),
                                          recorded)
        if kind is AffineCoupling and not self.exact:
            affine = cast(AffineCoupling, block)
            return self._rebuild_affine(index, affine, *_split_halves(affine, self._stored_output(index)), recorded)
        return self._rebuild_generic(index, block, _whole(self._stored_output(index)), recorded)

    def _check_parameters(self, index: int, block: nn.Module) -> None:
        """A block rebuilt with parameters or buffers changed in place since its forward would silently give a wrong
        input (the plain stack's autograd refuses such a change too where the ops saved them); one whose modules
        changed class cannot run its forward's code (``remove_parametrizations`` between forward and backward failed
        with an AttributeError naming ``weight`` until 2026-12-03: an adversarial pass)."""
        for (module, _), cls in zip(self.modes[index], self.classes[index]):
            if type(module) is not cls:
                name = next((n for n, m in block.named_modules() if m is module), "?")
                raise ReversibleError(
                    f"memtrim.ReversibleSequential: block {index}'s module {name or '(the block)'} changed class "
                    f"after the forward ({cls.__name__}, now {type(module).__name__}: a parametrization registered or "
                    "removed?), so its forward cannot be run again to rebuild the block's input. Expected the "
                    "block's modules unchanged until backward; to fix: change them after backward.")
        for kind, versions, named, fix in (
                ("parameter", self.parameter_versions[index], block.named_parameters,
                 "Run backward before changing parameters (an optimizer step, or an OptimizerInBackward stepping "
                 "during another backward that shares them)."),
                ("buffer", self.buffer_versions[index], block.named_buffers,
                 "Expected buffers unchanged until backward; to fix: change it after backward, or assign a new tensor "
                 "(the rebuild reads the forward's).")):
            for tensor, version in versions:
                if tensor._version != version and not (kind == "buffer" and _batchnorm_count(block, tensor)):
                    name = next((n for n, t in named() if t is tensor), "?")
                    raise ReversibleError(
                        f"memtrim.ReversibleSequential: block {index}'s {kind} {name} was modified in place after the "
                        f"forward (version {version}, now {tensor._version}), so the block's input cannot be rebuilt "
                        f"from its output. {fix}"
                    )

    def _rebuild_additive(self, index: int, block: AdditiveCoupling, y1: torch.Tensor, y2: torch.Tensor,
                          recorded: list[torch.Tensor]) -> _Halves:
        """Invert with g and f evaluated once each, recording what they save (the additions save nothing)."""
        saved: dict[str, list[torch.Tensor]] = {"f": [], "g": []}

        def evaluate(name: str, fn: nn.Module, half: torch.Tensor) -> torch.Tensor:
            replay = self.replays[index][name]
            # the input requires grad as it did in forward, so the ops save the same tensors
            inp = as_forward(self._from_stream(half.detach()), replay).requires_grad_(replay.requires_grad)
            with torch.enable_grad(), _recording(saved[name]), replayed(replay), self._as_found(index, name):
                out = fn(inp)
            return self._to_stream(out.detach())

        x1, x2 = block.uncouple(y1, y2, evaluate)
        recorded += saved["f"] + saved["g"]  # the forward saved f's tensors, then g's
        return _Halves(x1.detach(), x2.detach(), block.split_dim)

    def _rebuild_affine(self, index: int, block: AffineCoupling, y1: torch.Tensor, y2: torch.Tensor,
                        recorded: list[torch.Tensor]) -> _Halves:
        """Invert with g and f evaluated once each, recording what the forward saved, in its order: f's tensors and
        the f-side multiplication's, then g's and the g-side multiplication's."""
        saved: dict[str, list[torch.Tensor]] = {"f": [], "g": []}
        evaluated: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # name -> (input, s, t)

        def scale_shift(name: str, fn: nn.Module, half: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            replay = self.replays[index][name]
            inp = as_forward(half.detach(), replay).requires_grad_(replay.requires_grad)
            with torch.enable_grad(), _recording(saved[name]), replayed(replay), self._as_found(index, name):
                s, t = block.scale_shift(name, fn, inp)
            evaluated[name] = (inp, s, t)
            return s.detach(), t.detach()

        x1, x2 = block.uncouple(y1, y2, scale_shift)
        x2_in, s_f, t_f = evaluated["f"]
        _, s_g, t_g = evaluated["g"]
        with torch.enable_grad():
            with _recording(saved["f"]):  # what the forward's y1 = x1 * s_f + t_f saved
                block.mix(x1.detach().requires_grad_(x2_in.requires_grad), s_f, t_f)
            with _recording(saved["g"]):
                block.mix(x2_in, s_g, t_g)
        recorded += saved["f"] + saved["g"]
        return _Halves(x1.detach(), x2.detach(), block.split_dim)

    def _recompute_forward(self, index: int, block: nn.Module, x: torch.Tensor, recorded: list[torch.Tensor]) -> None:
        replays = self.replays[index]
        with torch.enable_grad():
            kind = _coupling(block)
            if kind is AdditiveCoupling:
                self._additive(index, cast(AdditiveCoupling, block),
                               x.detach().requires_grad_(replays["f"].requires_grad), recorded)
            elif kind is AffineCoupling:
                self._affine(index, cast(AffineCoupling, block),
                             x.detach().requires_grad_(replays["f"].requires_grad), recorded)
            else:
                inp = as_forward(x.detach(), replays["block"]).requires_grad_(replays["block"].requires_grad)
                with _recording(recorded), replayed(replays["block"]):
                    block(inp)

    # NOTE [ f and g share a layer ]: a coupling's forward runs f, then g; its rebuild runs g, then f. A layer both
    # call (one spectral-normed Linear, one BatchNorm, a coupling built as AdditiveCoupling(f, f)) is left by f's call
    # as g's found it: its power-iteration vectors advanced, under parametrize.cached() its weight cached. The rebuild
    # read the block's state from before f for g (1.3e-3 to 6.5e-2 off plain training after 3 steps, silently), and
    # under cached() g computed the weight its forward read cached (a ReversibleError: "saved a tensor of shape
    # (8,) ... (5, 8)"), until 2026-12-03. Now the forward keeps what f's call left for g: the block's buffers f
    # wrote (their values after f: small, and only those whose version moved), the parameters and buffers it set
    # anew (``self.n = self.n + 1``: 7.31 off before) and the cache entries f made (held until backward, as the
    # entries the block found are); the rebuild puts them in place for g's call, and the block's state from before
    # f back for f's (g's rebuild may have written what f reads: 3.35 off before).

    @contextlib.contextmanager
    def _leaving(self, index: int, name: str, block: nn.Module) -> Iterator[None]:
        """Around a coupling's call of ``name`` in the forward: for f, note what it left for g (the NOTE above)."""
        if name != "f":
            yield
            return
        versions = {id(b): b._version for b in _buffers_in(self.slots[index])}
        keys = CachedParametrizations.keys() if self.cached[index] is not None else None
        yield
        # (f's and g's changes may cancel by the block's end: one layer as f and g swapping two buffers, 7.14 off
        # with the flag read at the end alone, an adversarial pass)
        self.set_anew[index] = _differs(self.slots[index])
        after = _snapshot(self.slots[index])
        with torch.no_grad():  # (one f registered, or wrote: g may write it next)
            buffers = [(b, b.detach().clone()) for b in _buffers_in(after) if versions.get(id(b)) != b._version]
        self.f_left[index] = _FLeft(buffers, after, CachedParametrizations.made_since(keys) if keys is not None else {})

    @contextlib.contextmanager
    def _as_found(self, index: int, name: str) -> Iterator[None]:
        """Block ``index``'s attributes, children, parameters and buffers as its ``name`` (f, g, or the block's
        forward) found them in the forward: those the block's forward found, and for g what f left it (NOTE [ f and
        g share a layer ]). What the rebuild ran before (g before f, a block's inverse before its forward) may have
        written or set anew what this call reads: a buffer g averages and f reads was rebuilt with g's write, 3.35
        off, silently, until 2026-12-03 (an adversarial pass)."""
        left = self.f_left[index]
        if self.set_anew[index]:  # (else the rebuild, running the same code, sets none anew either)
            _put_slots(left.slots if name == "g" and left.slots else self.slots[index])
        with torch.no_grad():
            for buffer, value in [*self.buffers_before[index], *(left.buffers if name == "g" else [])]:
                buffer.data.copy_(value)  # (NOTE [ buffers put back ])
        swapped = put_settings(self.found[index][name])
        try:
            with CachedParametrizations.holding(left.cache) if name == "g" and left.cache else contextlib.nullcontext():
                yield
        finally:
            undo_swaps(swapped)

    def _rebuild_generic(self, index: int, block: nn.Module, y: torch.Tensor,
                         recorded: list[torch.Tensor]) -> torch.Tensor:
        replay = self.replays[index]["block"]
        filled = self.filled[index]
        for table, key, value in filled:  # (a TypeError in the user's inverse, reading None, until 2026-12-03)
            table[key] = value
        buffers = [(b, b.detach().clone()) for b in block.buffers()]
        try:
            with replayed(replay, strict=False), torch.no_grad():
                x = _inverse(block)(y)
            with torch.no_grad():  # as the forward found them: the inverse, in training mode, may move them (a
                for buffer, value in buffers:  # spectral_norm's power iteration: 0.05 to 2.27 off until 2026-12-03)
                    buffer.data.copy_(value)  # (NOTE [ buffers put back ])
        finally:
            for table, key, _ in filled:  # the forward run again finds them as its forward did
                table[key] = None
        inp = as_forward(x.detach(), replay).requires_grad_(replay.requires_grad)
        with torch.enable_grad(), _recording(recorded), replayed(replay), self._as_found(index, "block"):
            out = block(inp)  # its forward again, on the attributes that forward found
        self._check_inverse(index, block, out, y)
        return x.detach()

    # NOTE [ what a block's inverse reads ]: a block of the user's is inverted with its attributes as its forward left
    # them (what a forward keeps for its inverse) and its buffers as its forward found them (what a forward reads and
    # then updates: an EMA, a count, the hook-based spectral_norm's power iteration, which its inverse runs again). A
    # buffer the forward sets and its inverse then reads (Glow's ActNorm keeping loc and scale from its first batch in
    # buffers, a mean kept for the inverse) is read as found: 2.97 and 9.51 off after 3 steps, silently, until
    # 2026-12-03. Which of the two a buffer is cannot be told (reading them as left for one afternoon broke the first
    # kind: 2e-2 to 3.62 off, an adversarial pass), so the forward run again in the rebuild, whose output was
    # discarded, is compared with the block's output at the block's first rebuild: a block whose inverse did not give
    # back its input warns. A buffer registered as None that its forward filled is read filled (None: no inverse reads).

    def _check_inverse(self, index: int, block: nn.Module, out: Any, y: torch.Tensor) -> None:
        """Warn where the block's forward, on the input its inverse rebuilt, does not give back its output (NOTE [ what
        a block's inverse reads ]). Checked once per block and set of training flags, at its first rebuild with a finite
        output: reading the error is a host sync on an accelerator, a misread state is the block's code, the same at
        every step, and a check at later steps made them peak higher than the steady state a plan predicts (an
        adversarial pass)."""
        key = (index, tuple(flag for _, flag in self.modes[index]))
        if key in self.drift.checked or not isinstance(out, torch.Tensor) or out.shape != y.shape or not y.numel():
            return
        # (2 * _PROBE_ELEMENTS elements, _scattered, read where they lie: reshape copied a whole output laid out
        # otherwise, a channels_last one, 1.5 outputs more at the peak; a state the inverse misread moves most of them)
        where = _scattered(y.shape, _PROBE_ELEMENTS, y.device)
        expected = torch.take(y.detach(), where)
        largest, off = expected.abs().max(), (torch.take(out.detach(), where) - expected).abs().max()
        # a rebuild whose inverse read buffers its forward filled from None is no block's usual one: checked again at
        # the next (a block filling one anew in each forward passed there and trained on the one before from its
        # second step, 2.22 off after 3, silently, on an intermediate commit of 2026-12-03: an adversarial pass)
        final = not self.filled[index]
        if is_fake(y) or y.device.type == "meta":  # a plan's trace: the same tensors, no values to read
            if final:
                self.drift.checked.add(key)
            return
        scale = float(largest)
        if not math.isfinite(scale):  # (a NaN or inf in the output: plain training's is not finite either; later)
            return
        if final:
            self.drift.checked.add(key)
        error = float(off) / max(scale, 1e-30)
        # (the precision the forward computed in: under autocast one ulp of its dtype, bfloat16's where the output is
        # float32; correct blocks came within 0.06 of one, a misread buffer 2.6)
        compute = [kw["dtype"] for kw in self.replays[index]["block"].autocast.values() if kw.get("enabled")]
        tolerance = max(1e-4, 64 * torch.finfo(y.dtype).eps, *(torch.finfo(dtype).eps for dtype in compute))
        if not error <= tolerance:  # NaN too
            warnings.warn(
                f"memtrim.ReversibleSequential: block {index} ({type(block).__name__}): its forward on the input its "
                f"inverse rebuilt gives its output back only to relative error {error:.3e} (> {tolerance:.0e}), so "
                "its gradients are not the plain stack's. Its inverse reads the block's attributes as the forward "
                "left them and its buffers as the forward found them: keep a value the forward sets for its inverse "
                "(ActNorm's loc and scale from its first batch, a kept mean) in a plain attribute, not a buffer; if "
                "the inverse is approximate, check_drift= keeps the inputs of the blocks that drift.", stacklevel=2)


class ReversibleSequential(nn.Module):
    """A sequence of invertible blocks whose inputs are reconstructed in backward instead of being kept.

    Why: a plain stack keeps every block's intermediate tensors for backward, so activation memory grows with
    depth; here only the stack's output is kept, and one block's tensors exist at a time during backward.

    Args:
        blocks: :class:`AdditiveCoupling`, :class:`AffineCoupling`, or any module with ``inverse(output)``.
        exact: carry the stream in fixed point (AdditiveCoupling blocks only), so every input is rebuilt bit for
            bit.
        fraction_bits: the fixed-point grid's fraction bits in exact mode (1..40).
        check_drift: measure each rebuilt input's relative error; above this, warn and keep that block's input
            from the next forward on (see :meth:`drift_report`).

    Raises:
        InvalidInputError: a block without ``inverse``, a block holding a TorchScript module (its recomputation
            does not save what its forward saved), or an option out of range.

    Example::

        stack = memtrim.ReversibleSequential(*[memtrim.AdditiveCoupling(nn.Sequential(
            nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))) for _ in range(16)])
        y = stack(torch.randn(32, 512))

    See NOTE [ reversible without backward inside backward ] in memtrim/techniques/reversible/sequential.py.
    """

    def __init__(self, *blocks: nn.Module, exact: bool = False, fraction_bits: int = 24,
                 check_drift: float | None = None) -> None:
        super().__init__()
        if exact and not all(_coupling(b) is AdditiveCoupling for b in blocks):
            raise InvalidInputError(
                "memtrim.ReversibleSequential: exact=True needs AdditiveCoupling blocks (fixed-point addition is "
                "exact; an affine scale is not), or subclasses keeping its forward, inverse, couple and uncouple."
            )
        if not 1 <= fraction_bits <= 40:
            raise InvalidInputError(
                f"memtrim.ReversibleSequential: fraction_bits must be in 1..40, got {fraction_bits}."
            )
        if check_drift is not None and not check_drift > 0:
            raise InvalidInputError(f"memtrim.ReversibleSequential: check_drift must be > 0, got {check_drift}.")
        for i, block in enumerate(blocks):
            if not isinstance(block, nn.Module) or not callable(getattr(block, "inverse", None)):
                raise InvalidInputError(
                    f"memtrim.ReversibleSequential: block {i} ({type(block).__name__}) has no inverse(); wrap f and g "
                    "in memtrim.AdditiveCoupling or memtrim.AffineCoupling, or give the module an inverse method."
                )
            scripted = scripted_inside(block)
            if scripted is not None:
                where = f"its {scripted!r}" if scripted else "the block itself"
                raise InvalidInputError(
                    f"memtrim.ReversibleSequential: expected blocks the stack can recompute; block {i} "
                    f"({type(block).__name__}) holds a TorchScript module ({where}). {SCRIPTED}, or keep the block "
                    "out of the stack."
                )
        self.exact, self.fraction_bits, self.check_drift = exact, fraction_bits, check_drift
        self._drift = _DriftLog(check_drift)
        self.drift = self._drift.drift  # block -> relative reconstruction error seen in the last backward
        self.keep_inputs = self._drift.keep_inputs  # blocks whose input is kept (drift above check_drift)
        self.blocks = nn.ModuleList(blocks)

    # eager under torch.compile, as checkpoint_modules' regions are (a graph break before and after the stack):
    # traced, its saved-tensor hooks and replay gave silently wrong gradients (aot_eager, 0.12 off on three additive
    # couplings) or a false ReversibleError (inductor)
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks applied in turn, keeping no block's input for backward (each is rebuilt from the block's
        output there); a plain sequential call where grad is disabled, but with ``exact=True``, whose stream stays
        on its fixed-point grid there too (an evaluation under ``no_grad`` gave other outputs than the training
        forward, 2.4e-7 off, until 2026-12-01)."""
        if plain_only(in_backward=False):  # torch.func transforms, forward-mode AD, fx tracing
            return self._plain(x)
        if not isinstance(x, torch.Tensor):
            raise InvalidInputError(f"memtrim.ReversibleSequential: input must be a tensor, got {type(x).__name__}.")
        if (not torch.is_grad_enabled() and not self.exact) or len(self.blocks) == 0:
            live = _live_frames()
            for block in self.blocks:
                if not live:
                    x = block(x)
                    continue
                before = _buffers_then(block)  # (a recalibration: NOTE [ a later forward's write ])
                x = block(x)
                _hand_over(before)
            return x
        if torch.is_inference_mode_enabled():  # (exact: the frame reads version counters, which these lack)
            with torch.inference_mode(False), torch.no_grad():  # (leaving inference mode turns grad on)
                return self._frame(x.clone())
        return self._frame(x)

    def _plain(self, x: Any) -> Any:
        """The blocks in turn as torch's own ops, where the frame's saved-tensor hooks and backward cannot run: under
        ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``vmap``: they raised torch's "don't yet support
        saved tensor hooks"), in forward-mode AD and while ``torch.fx`` traces. The same gradients as the plain stack,
        keeping what it keeps. ``exact=True`` refuses: its fixed-point stream takes its gradient from the frame's own
        backward, which these cannot run."""
        if self.exact:
            raise ReversibleError(
                "memtrim.ReversibleSequential(exact=True) cannot run under torch.func transforms (grad, vjp, jacrev, "
                "vmap), forward-mode AD or torch.fx tracing: its fixed-point stream takes its gradient from memtrim's "
                "own backward, which they cannot run. Call the stack outside the transform, or use exact=False, which "
                "runs there as its blocks in turn (torch's autograd, keeping every block's activations).")
        for block in self.blocks:
            x = block(x)
        return x

    def _frame(self, x: torch.Tensor) -> torch.Tensor:
        return _Frame(list(self.blocks), self.exact, self.fraction_bits, x.dtype, self._drift).run(x)

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.blocks)

    def __getitem__(self, index: int | slice) -> Any:
        """A block, as ``nn.Sequential`` gives one; a slice, a stack of those blocks with these options (the blocks
        shared, not copied)."""
        if isinstance(index, slice):
            return ReversibleSequential(*self.blocks[index], exact=self.exact, fraction_bits=self.fraction_bits,
                                        check_drift=self.check_drift)
        return self.blocks[index]

    def drift_report(self) -> dict[int, float]:
        """Per block, the relative reconstruction error measured in the last backward (needs ``check_drift``)."""
        return dict(self.drift)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Reconstruct the stack's input from its output."""
        for block in reversed(self.blocks):
            y = _inverse(block)(y)
        return y

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
* No backward inside backward: the graph is the ordinary one and is traversed once, so ``autograd.grad``, DDP
  (each parameter's gradient accumulated once) and an enclosing non-reentrant checkpoint work.
* Replay: the RNG states (CPU and the CUDA device) before each of f and g, and the autocast state, are recorded in
  forward and restored for the recomputation inside ``torch.random.fork_rng`` (the global generator is never
  reseeded or advanced); module buffers (BatchNorm's running statistics) are restored after it, so they are
  updated once per forward.
* The caller's tensors are never freed or modified. If the stack output is modified in place before backward,
  reconstruction would be wrong: that raises.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ...errors import InvalidInputError, MemtrimError
from ...measure import _hooks
from .coupling import AdditiveCoupling

__all__ = ["ReversibleSequential", "ReversibleError"]


class ReversibleError(MemtrimError, RuntimeError):
    """A reversible stack cannot reconstruct what backward needs."""


class _Handle:
    """What autograd keeps instead of a tensor saved inside the stack."""

    __slots__ = ("frame", "block", "position", "__weakref__")


class _Replay:
    """What the forward of one function (f, g, or a whole block) ran under."""

    __slots__ = ("cpu_rng", "cuda_rng", "cuda_device", "autocast", "requires_grad")


def _capture(x: torch.Tensor, requires_grad: bool | None = None) -> _Replay:
    replay = _Replay()
    replay.requires_grad = x.requires_grad if requires_grad is None else requires_grad
    replay.cpu_rng = torch.get_rng_state()
    replay.cuda_device = x.device if x.device.type == "cuda" else None
    replay.cuda_rng = torch.cuda.get_rng_state(x.device) if replay.cuda_device is not None else None
    replay.autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")
                       if d == "cpu" or replay.cuda_device is not None] if hasattr(torch, "get_autocast_dtype") else []
    return replay


@contextmanager
def _replayed(replay: _Replay) -> Iterator[None]:
    devices = [replay.cuda_device] if replay.cuda_device is not None else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(replay.cpu_rng)
        if replay.cuda_device is not None:
            torch.cuda.set_rng_state(replay.cuda_rng, replay.cuda_device)
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in replay.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            yield


class _Frame:
    """One forward of the stack: the output, the handles per block, and what backward rebuilt."""

    def __init__(self, stack: ReversibleSequential) -> None:
        self.blocks = list(stack.blocks)
        self.handles: list[list[weakref.ref]] = [[] for _ in self.blocks]
        self.replays: list[dict[str, _Replay]] = [{} for _ in self.blocks]
        self.outputs: dict[int, torch.Tensor] = {}  # block index -> its output (the next block's input)
        self.output_version = 0
        self.recomputed: weakref.WeakKeyDictionary[_Handle, torch.Tensor] = weakref.WeakKeyDictionary()
        self.materialised: set[int] = set()

    def set_output(self, output: torch.Tensor) -> None:
        self.outputs[len(self.blocks) - 1] = output.detach()  # detached: no cycle through the output's grad_fn
        self.output_version = output._version

    def unpack(self, handle: _Handle) -> torch.Tensor:
        if handle not in self.recomputed:
            self.materialise(handle.block)
        tensor = self.recomputed.get(handle)
        if tensor is None:
            raise ReversibleError(
                f"memtrim.ReversibleSequential: block {handle.block} saved a tensor in forward that its "
                "recomputation did not save again: the block is not deterministic in what it computes (data-"
                "dependent control flow?). Keep such a block out of the reversible stack."
            )
        return tensor

    def output_of(self, index: int) -> torch.Tensor:
        if index not in self.outputs:
            self.materialise(index + 1)  # reconstructs block index + 1's input, which is this block's output
        y = self.outputs.get(index)
        if y is None:
            raise ReversibleError(f"memtrim.ReversibleSequential: block {index}'s output is gone (internal error).")
        if index == len(self.blocks) - 1 and y._version != self.output_version:
            raise ReversibleError(
                "memtrim.ReversibleSequential: the stack's output was modified in place after the forward, so the "
                "blocks' inputs cannot be reconstructed from it. Clone the output before changing it."
            )
        return y

    def materialise(self, index: int) -> None:
        if index in self.materialised:
            return
        block = self.blocks[index]
        y = self.output_of(index)
        recorded: list[torch.Tensor] = []
        saved_buffers = [(b, b.detach().clone()) for b in block.buffers()]
        try:
            if type(block) is AdditiveCoupling:
                x = self._rebuild_additive(index, block, y, recorded)
            else:
                x = self._rebuild_generic(index, block, y, recorded)
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
                self.recomputed[handle] = tensor
        self.materialised.add(index)
        if index > 0:
            self.outputs[index - 1] = x
        del self.outputs[index]  # this block's output is no longer needed: one boundary alive at a time

    def _rebuild_additive(self, index: int, block: AdditiveCoupling, y: torch.Tensor,
                          recorded: list[torch.Tensor]) -> torch.Tensor:
        y1, y2 = y.chunk(2, dim=block.split_dim)
        replays = self.replays[index]
        f_saved: list[torch.Tensor] = []
        g_saved: list[torch.Tensor] = []
        # inputs require grad as they did in forward, so the ops save the same tensors
        with _replayed(replays["g"]), _recording(g_saved), torch.enable_grad():
            gy = block.g(y1.detach().requires_grad_(replays["g"].requires_grad))
        x2 = (y2 - gy.detach()).detach()
        with _replayed(replays["f"]), _recording(f_saved), torch.enable_grad():
            fx = block.f(x2.detach().requires_grad_(replays["f"].requires_grad))
        x1 = (y1 - fx.detach()).detach()
        recorded += f_saved + g_saved  # the forward saved f's tensors, then g's (the additions save nothing)
        return torch.cat([x1, x2], dim=block.split_dim)

    def _rebuild_generic(self, index: int, block: nn.Module, y: torch.Tensor,
                         recorded: list[torch.Tensor]) -> torch.Tensor:
        replay = self.replays[index]["block"]
        with _replayed(replay), torch.no_grad():
            x = block.inverse(y)
        with _replayed(replay), _recording(recorded), torch.enable_grad():
            block(x.detach().requires_grad_(replay.requires_grad))
        return x.detach()


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

    def __init__(self, *blocks: nn.Module) -> None:
        super().__init__()
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
        for index, block in enumerate(self.blocks):
            x = self._run_block(frame, index, block, x)
        frame.set_output(x)
        _hooks.hold_for_backward(frame.outputs[len(self.blocks) - 1], frame)
        return x

    def _run_block(self, frame: _Frame, index: int, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        def pack(tensor: torch.Tensor) -> _Handle:
            handle = _Handle()
            handle.frame, handle.block, handle.position = frame, index, len(frame.handles[index])
            frame.handles[index].append(weakref.ref(handle))
            return handle

        def unpack(handle: _Handle) -> torch.Tensor:
            return handle.frame.unpack(handle)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            if type(block) is AdditiveCoupling:
                return self._additive(frame, index, block, x)
            frame.replays[index]["block"] = _capture(x)
            return block(x)

    @staticmethod
    def _additive(frame: _Frame, index: int, block: AdditiveCoupling, x: torch.Tensor) -> torch.Tensor:
        from .coupling import _checked, _split

        x1, x2 = _split(block, x, block.split_dim)
        frame.replays[index]["f"] = _capture(x2)
        y1 = x1 + _checked(block, "f", block.f(x2), x2)
        frame.replays[index]["g"] = _capture(y1)
        y2 = x2 + _checked(block, "g", block.g(y1), y1)
        return torch.cat([y1, y2], dim=block.split_dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        """Reconstruct the stack's input from its output."""
        for block in reversed(self.blocks):
            y = block.inverse(y)
        return y

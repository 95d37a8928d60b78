"""What the norms share: a small cache of constant tensors for torch's fused normalization kernels, and the rule that
decides which features keep their normalised input (NOTE [ when a norm keeps its input ]). Where the norms step aside
and the errors they raise are in :mod:`memtrim.techniques.guards`."""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as _dispatch_modes

from ...errors import ConvertError
from ...measure.hooks import compiled_autograd_running, tensors_in
from ..guards import capturing, defined_in, foreign_handles, memtrims, plain_only, register_own

__all__ = ["CACHE_SIZE", "HALF_PRECISION", "KEEP_BOUND", "DecidedTogether", "check_taken", "keep_input_features",
           "zeros_and_ones"]


# ---------------------------------------------------------------------- bounded constant cache
CACHE_SIZE = 8
"""Shapes :func:`zeros_and_ones` keeps: a model sees a handful (one per sequence length in flight), not thousands."""
# (shape, dtype, device) -> (zeros, ones), least recently used first; never written to (the kernels only read them)
_CONSTANTS: OrderedDict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()


def zeros_and_ones(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeros and ones shaped like ``like``, kept for the :data:`CACHE_SIZE` most recently used shapes. A fake
    ``like`` (a planner's trace) gets its fake mode's own: a fake tensor must never reach a real run, nor another
    trace's mode (an entry holds its mode, so the mode's ``id`` is not reused while the entry lives)."""
    mode = getattr(like, "fake_mode", None)
    key = (tuple(like.shape), like.dtype, like.device, None if mode is None else id(mode))
    found = _CONSTANTS.get(key)
    if found is None:
        found = _CONSTANTS[key] = (torch.zeros_like(like), torch.ones_like(like))
        while len(_CONSTANTS) > CACHE_SIZE:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(key)
    return found


# ---------------------------------------------------------------------- NOTE [ when a norm keeps its input ]
# A norm that keeps its output ``y = gamma * xhat + beta`` (per feature or channel) rebuilds ``xhat = (y - beta) /
# gamma`` in backward. With u the unit roundoff of the dtype (float32: 6e-8):
#
# * the forward rounds y once or twice: |dy| <= ~2u (|beta| + |gamma xhat|) (+ u |mean * invstd * gamma| for
#   BatchNorm's fused ``x * scale + shift``, which the plain path pays too);
# * inverting the activation adds a relative error of 2u for LeakyReLU; for ELU, ``y = log1p(z / alpha)`` has
#   condition number 1 / (1 + z / alpha) = e^-y, so |dy| grows by u (e^-y - 1) for y < 0;
# * dividing by gamma: |d xhat| <= |dy| / |gamma| + u |xhat|.
#
# So the rebuilt xhat carries an absolute error of about u (|xhat| + (|beta| + s) / |gamma|), with s the ELU term
# (0 for other activations), where torch's own backward computes xhat from the input with about u |xhat|. The
# gradients of a norm are linear in xhat's error (dgamma = sum(dy * xhat); dx has xhat * sum(dy * xhat) / N), and
# xhat has unit RMS in training, so the converted gradients' relative error exceeds torch's by a factor of about
# 1 + (|beta| + s) / |gamma|, per feature. A feature keeps its xhat (the input's information, only for those
# features) when that factor could pass KEEP_BOUND:
#
#     keep  <=>  not (|gamma| * KEEP_BOUND > |beta| + s)   or   |gamma| < tiny ** 0.25
#
# The second clause keeps gamma^2 (fed to torch's BatchNorm backward) and 1 / gamma normal; it and gamma == 0 are
# covered by the same comparison (``not (0 > ...)``). For ELU, s is the RMS over the channel of e^-y - 1 (y < 0):
# the gradient error aggregates in norm, and a max would keep nearly every ELU channel for one tail value. The
# decision is a per-feature boolean tensor; gathering the kept features needs their count (one small host sync on
# an accelerator, none on CPU; in a model convert changed, one a forward for all its norms: NOTE [ keep decisions made
# together ]). Under torch.compile and torch.func the modules run as torch's own ops instead
# (:func:`memtrim.techniques.guards.plain_only`), so the compiler sees no data-dependent shape.
KEEP_BOUND = 8.0
"""How many times torch's own error a rebuilt ``xhat`` may carry (NOTE above): the converted gradients' error stays
within ~9x torch's at the bound; tests hold it to 10x against float64."""
HALF_PRECISION = (torch.float16, torch.bfloat16)
"""NOTE [ norms in half precision ]: the norms that rebuild their input from their output (``BatchNormAct``,
``LayerNorm``, ``RMSNorm``, and convert's norms by behaviour) run as torch's own ops for inputs of these dtypes,
keeping what torch keeps. torch's half-precision backward computes in float32 from the exact input and rounds the
result once; a rebuilt ``xhat`` carries the rounding of the half-precision output into every element of the
weight-gradient sums. No bound on |beta / gamma| holds the error to 10x torch's: with a bound of 2, where a sum
nearly cancels (a uniform incoming gradient over a batch of one, a gradient nearly orthogonal to a feature's
xhat), BatchNormAct's dgamma reached 17.5x torch's error against float64 and RMSNorm's 6,607x (float16); keeping
every feature's xhat in half precision still gave 56-68x (measured on 2026-11-29). So half precision saves nothing
with these modules rather than train differently; ``convert`` leaves such norms torch's and says so."""


# ---------------------------------------------------------------------- NOTE [ the weights a rebuild reads ]
# torch's norms keep their input and read their weight in backward (dx = weight * ...): a weight written through
# ``.data`` between forward and backward (no version moves: autograd does not refuse it) gives torch's backward the new
# weight with the input the forward kept. A norm that rebuilds its input from its output must divide by the weight
# and subtract the bias the forward computed with, or it rebuilds another input. So each rebuilding norm (the output-
# keeping LayerNorm and RMSNorms, BatchNorm + LeakyReLU/ELU) copies its weight and bias at each forward (two small
# copies; Gemma's ``1 + w`` is a new tensor already) and rebuilds from the copies, and reads the weight itself where
# torch's backward does: its gradients are torch's for any such write, at any time before the backward. Before
# e406254 the rebuild read the live weights, and a write after the norm ran was refused at the forward's end, or
# not seen after it (1e-4 off plain). The copies are held with the output, as saved tensors (the tracker counts them).


def keep_input_features(gamma: torch.Tensor, beta: torch.Tensor | None, extra: torch.Tensor | None = None,
                        floor: float = 0.0, offset: float = 0.0, node: Any = None,
                        read: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Indices (flattened) of the features whose ``xhat`` cannot be rebuilt from the output to within KEEP_BOUND
    times torch's own error (NOTE [ when a norm keeps its input ] in this file). ``extra``: the ELU term s, per
    feature; ``floor``: a user's ``gamma_threshold``, below which features keep their ``xhat`` anyway; ``offset``: the
    norm multiplies by ``gamma + offset`` (Gemma's RMSNorm: ``1 + w``), from which it decides. Inside the forward of a
    model ``convert`` changed, decided with the model's other norms (NOTE [ keep decisions made together ]): ``node``,
    the norm's autograd ``ctx``, and ``read``, the copies of ``gamma + offset`` and ``beta`` it computed with (which
    its backward rebuilds from), let a decision taken from an earlier norm's be checked."""
    if getattr(_LOCAL, "stack", None) and extra is None and read is not None and _plain_tensors(gamma, beta):
        open_ = _open_forward()
        if open_ is not None and open_.group is not None:
            return open_.group.kept(gamma, beta, floor, offset, open_, node, read)
    return _indices(_keep_mask(gamma, beta, extra, floor, offset).flatten())


# NOTE [ keep decisions while a CUDA graph is captured ]
# A norm that keeps its output decides from its weights' values which features keep their input, and gathering them
# (nonzero) makes the host wait for the GPU: while a CUDA graph is captured that wait fails the capture, and a decision
# recorded there would hold at every replay while the weights change. So while a graph is captured (guards.capturing)
# these norms, and the BatchNorms fused with a LeakyReLU or ELU, run as torch's own modules, as under autocast: the
# capture records the unconverted model's ops for them, keeping what torch keeps; their savings are lost there, those
# of the other rewrites (a fused BatchNorm + ReLU's, the rebuilt LayerNorm, GELU and SiLU outputs) are not. The
# RMSNorms convert recognises by behaviour (HF Llama's, Gemma's) keep part of theirs: NOTE [ an RMSNorm while a CUDA
# graph is captured ] in convert/norms.py. A caller that reaches the gathering while capturing anyway gets
# ConvertError, not CUDA's own error.
def _indices(mask: torch.Tensor) -> torch.Tensor:
    """``mask.nonzero().flatten()``; none on the meta device or under a fake mode without a shape environment (the
    values that decide are not there: a model measured on meta or fake tensors keeps no feature's input; found by an
    adversarial pass, nonzero raised there)."""
    if mask.is_meta:
        return torch.empty(0, dtype=torch.long, device=mask.device)
    if capturing(mask):  # (NOTE [ keep decisions while a CUDA graph is captured ]: not reached by convert's norms)
        raise ConvertError(
            "memtrim: a norm memtrim.convert made keep its output (an RMSNorm or LayerNorm, or a BatchNorm fused "
            "with a LeakyReLU or ELU) decides from its weights' values which features keep their input, and "
            "gathering them makes the host wait for the GPU, which a CUDA graph being captured does not allow (a "
            "decision recorded at the capture would also hold at every replay while the weights change). To fix: "
            "leave the norms out of memtrim.convert (module_filter), or train this model without CUDA graphs."
        )
    try:
        return mask.nonzero().flatten()
    except DynamicOutputShapeException:
        if any(type(mode).__module__.startswith("memtrim.planner") for mode in _dispatch_modes()):
            raise  # (a plan's trace says which values it lacks: memtrim.plan turns this into its error)
        return torch.empty(0, dtype=torch.long, device=mask.device)


def _keep_mask(gamma: torch.Tensor, beta: torch.Tensor | None, extra: torch.Tensor | None,
               floor: float, offset: float = 0.0) -> torch.Tensor:
    """Per feature, whether it keeps its ``xhat`` (NOTE [ when a norm keeps its input ]), for a norm that multiplies
    by ``gamma + offset`` (the same bits as the norm's own sum: one rounding)."""
    g = (gamma.detach() + offset if offset else gamma.detach()).abs()
    # without beta the limit is 0, a scalar (a zeros tensor was one more op, on a GPU a kernel, at every call)
    limit: torch.Tensor | float = beta.detach().abs() if beta is not None else 0.0
    if extra is not None:
        limit = limit + extra.to(limit.dtype if isinstance(limit, torch.Tensor) else g.dtype)
    return ~(g * KEEP_BOUND > limit) | (g < max(torch.finfo(g.dtype).tiny ** 0.25, floor))


def _masks(norms: list[tuple[torch.Tensor, torch.Tensor | None, float, float]]
           ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``_keep_mask(gamma, beta, None, floor, offset).flatten()`` for each (gamma, beta, floor, offset) of one device,
    and all of them concatenated; computed once for all norms alike (dtypes, a beta or none, floor, offset) on their
    concatenated weights: a handful of ops where each norm's own were six, at every forward (on a GPU each is a kernel
    launch). Elementwise comparisons, so each mask is the one the norm computes by itself."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, (gamma, beta, floor, offset) in enumerate(norms):
        groups.setdefault((gamma.dtype, None if beta is None else beta.dtype, floor, offset), []).append(i)
    masks: list[torch.Tensor] = [norm[0] for norm in norms]  # (each replaced below)
    with torch.no_grad():
        for (_, has_beta, floor, offset), members in groups.items():
            gamma = torch.cat([norms[i][0].flatten() for i in members]) if len(members) > 1 else norms[members[0]][0]
            beta = None
            if has_beta is not None:
                beta = (torch.cat([norms[i][1].flatten() for i in members])  # type: ignore[union-attr]
                        if len(members) > 1 else norms[members[0]][1])
            mask = _keep_mask(gamma, beta, None, floor, offset).flatten()
            for i, part in zip(members, mask.split([norms[i][0].numel() for i in members])):
                masks[i] = part
    return masks, mask if len(groups) == 1 else torch.cat(masks)  # (one group: its members in order)


def _plain_tensors(*tensors: torch.Tensor | None) -> bool:
    """Tensors with values, or fake ones (a plan traces the same ops as the real step: NOTE [ known values in a
    trace ]); meta tensors and other subclasses decide at each call."""
    for t in tensors:  # (a loop, not all() over a generator: it runs at every norm's call)
        if t is not None and (type(t) not in _PLAIN_TYPES or t.is_meta):
            return False
    return True


_PLAIN_TYPES = (torch.Tensor, nn.Parameter, FakeTensor)


# ---------------------------------------------------------------------- NOTE [ keep decisions made together ]
# Gathering a norm's kept features needs their count: on a GPU a ``nonzero`` that makes the host wait until the GPU
# has run everything queued before it, once per norm per forward. The host then has nothing queued ahead of the GPU
# and a step that waits on the host pays the whole queue again each time (a converted Llama: 9 waits a step, 8 % of
# its step on an H200; benchmarks/convert_waits.py). ``convert`` therefore makes the model's norms decide together:
# a forward pre-hook of the converted model opens a forward; the first norm to decide in it decides for every norm
# of the model seen before, on its device, in one ``nonzero`` (one wait), and each later norm of that forward takes
# its decision if it was made
#
# * in this forward of the model (a ``.data`` write between forwards moves no version: every forward decides
#   afresh),
# * from the same weight and bias objects the norm passes now (``functional_call``'s fast weights, a
#   parametrization's recomputed weight, a cast copy: anything else decides for itself), at the versions and shapes
#   they have now (a weight changed in place since, by an optimizer or a user, decides again; so does one a sharding
#   framework set through ``.data`` to a view of its shard between its calls, FSDP1's sharded views).
#
# A decision is a function of the weights alone (the ELU term, which reads the output, decides at each call). What
# no version shows is a ``.data`` write during the forward, before the norm runs: a pruning or masking hook
# (network slimming re-zeroes pruned gammas in a pre-hook). So
#
# * a forward of a model with forward hooks or pre-hooks not memtrim's (on any of its modules, or global ones) does
#   not decide together: each norm decides at its call, as before (the modules are walked again only after torch
#   made a hook handle somewhere since the last walk);
# * a decision taken from an earlier norm's is checked: each norm rebuilds from copies of the weights it computed
#   with (NOTE [ the weights a rebuild reads ]), so a write after it ran changes nothing it needs; a write before it
#   ran but after the decision may have made a feature need its input that the decision left out. At the forward's
#   end the model's forward hook makes, all at once on the device, each decision taken again from the copies (about
#   ten small ops) and reads whether one left out a feature they need (a decision that keeps more than they need is
#   exact, and a norm whose graph is gone by then, a teacher's whose output was detached, is not read):
#   ``ConvertError`` (that forward's saved tensors cannot give torch's gradients), and the model's norms decide alone
#   from then on. On a GPU the flag is read when a backward reaches the model's output, not at the forward's end
#   (NOTE [ the check read at the backward ]: no second wait). A backward through such a norm run before the
#   forward's end (a local loss backpropagated inside the model's forward) reads that norm's own decision, in its
#   backward. Before e406254 the weights themselves were compared at the forward's end, as the rebuild read the live
#   weights, and a write between the forward and the backward went unseen (an adversarial pass, 2026-11-30: 1e-4 off
#   plain). Reading the flag at the end of the backward instead was tried and dropped: an optimizer stepped inside
#   the backward (OptimizerInBackward, post-accumulate-grad hooks) or DDP's reducer had used the gradients by then (an
#   adversarial pass: NaN parameters, then DDP's internal assert at every later step). Its start, before any of the
#   model's gradients, is where a GPU reads it now, outside torch.distributed.
#
# The masks of all the norms deciding at once are computed together, on their concatenated weights (``_masks``), and
# so are the checks: a handful of small ops a forward, not six a norm (on a GPU each is a kernel launch).
#
# A norm called outside the model's forward (a submodule called by itself, a checkpoint's recomputation in backward,
# a norm that is not converted) decides at its call. A forward is open while the model's ``_call_impl`` frame is on
# the thread's stack: a ``KeyboardInterrupt`` skips even always-called forward hooks, and an entry it left is dropped
# at the next norm. The hooks do nothing under torch.compile.
_LOCAL = threading.local()  # .stack: [_Open], one entry per open forward of a converted model on this thread


class _Open:
    """One open forward of a converted model on this thread: its decisions (None: its norms decide alone), the
    epoch, the frame of the model's call, and the decisions its norms took from an earlier norm's, with the weights
    each norm computed with (its copies) and its node (weakly), checked together at the forward's end (``check``, which
    those norms' nodes hold: a backward through one of them run before that end checks its own decision)."""

    __slots__ = ("check", "epoch", "frame", "group", "taken")

    def __init__(self, group: DecidedTogether | None, epoch: int, frame: Any) -> None:
        self.group, self.epoch, self.frame = group, epoch, frame
        self.taken: list[_Taken] = []
        self.check: _Check | None = None

    def take(self, mask: torch.Tensor, read: tuple[torch.Tensor, torch.Tensor | None], floor: float,
             node: Any) -> None:
        """Record a decision a norm took from an earlier norm's, and the weights it computed with (``gamma +
        offset``: its mask is decided with offset 0)."""
        self.taken.append((mask, read[0], read[1], floor, None if node is None else weakref.ref(node)))
        if self.check is None:
            assert self.group is not None
            self.check = _Check(self.group, self.taken)
        if node is not None:
            node.memtrim_check = self.check


# (the mask taken, the copies of gamma + offset and beta the norm computed with, its floor, its node weakly)
_Taken = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, float, Any]


class _Check:
    """Whether the decisions one forward's norms took from an earlier norm's left out a feature the weights they
    computed with need (NOTE [ keep decisions made together ]): computed at the forward's end and read there (on the
    CPU), or, on a GPU, read when a backward reaches the model's output or one of those norms (no wait at the
    forward's end: NOTE [ the check read at the backward ]); for a backward through one of those norms that runs
    before the forward's end (a local loss backpropagated inside the model's forward), by that norm's backward for its
    own decision (:meth:`before_end`)."""

    __slots__ = ("done", "group", "pending", "refused", "taken")

    def __init__(self, group: DecidedTogether, taken: list[_Taken]) -> None:
        self.group, self.taken, self.done = group, taken, False
        self.pending: list[tuple[torch.Tensor, Any]] | None = None  # (the flags on their way to the host)
        self.refused = False

    def at_end(self, output: Any = None) -> None:
        if not self.done:  # (refused already by a backward before the end, whose error the forward raises)
            self.done = True
            # (a norm whose graph is gone by now, a teacher's whose output was detached: no backward reads it)
            taken, self.taken = self.taken, []  # (a graph the user keeps holds this check, not the copies)
            alive = [entry for entry in taken if entry[4] is None or entry[4]() is not None]
            found = _flags(alive)
            nodes = _output_nodes(output, alive) if read_at_backward(found) else []
            if not nodes:  # (on the CPU; or no output a backward can enter by: read here)
                self._refuse_if(found, at_backward=False)
                return
            self.pending = [_to_host(flag) for flag in found]
            register_own([(node.register_prehook, self._at_output) for node in nodes])

    def before_end(self, node: Any) -> None:
        """Called by a checked norm's backward (``node``: its ctx): before the forward's end, its own decision is
        read (the other norms taken so far may be off this backward's path); after it, the forward's flags, where
        they were left to be read (a backward that did not pass the model's output)."""
        if not self.done:
            self._refuse_if(_flags([entry for entry in self.taken if entry[4] is not None and entry[4]() is node]),
                            at_backward=False)
        elif self.pending is not None or self.refused:
            self._resolve()

    def _at_output(self, grad_outputs: Any) -> None:
        self._resolve()

    def _resolve(self) -> None:
        pending = self.pending
        if pending is not None:
            refused = any(_on_host(flag) for flag in pending)  # (a wait only if the GPU has not got there yet)
            self.refused, self.pending = self.refused or refused, None
        if self.refused:
            self.group._alone = True
            raise ConvertError(_refusal(at_backward=True))

    def _refuse_if(self, found: list[torch.Tensor], at_backward: bool) -> None:
        # (a plan's trace has no values to read there, and makes the same tensors)
        if any(not isinstance(flag, FakeTensor) and bool(flag) for flag in found):  # (the wait)
            self.group._alone = self.done = True
            raise ConvertError(_refusal(at_backward))


def _output_nodes(output: Any, taken: list[_Taken]) -> list[Any]:
    """The grad_fns a backward enters the model's output by (NOTE [ the check read at the backward ]): of each tensor
    in it and, for a view, of its base too (an in-place change of a returned view, ``logits.div_(t)``, rebases the
    view's history onto its base's node and the view's own node is left out of the graph); only nodes that lead to
    one of ``taken``'s norms (:func:`_leads_to`): a returned input, or a view of one, has a node from before the
    forward, which later forwards' backwards pass too (hooked, they were refused where plain trains; an adversarial
    pass), and autograd's node numbers, which would tell, are counted per thread. A tensor whose grad_fn torch refuses
    to give (a view made under no_grad whose base was changed in place since) is one no backward enters by."""
    targets = {id(node): node for node in (entry[4]() for entry in taken if entry[4] is not None) if node is not None}
    nodes: dict[int, Any] = {}
    if not targets:
        return []
    for t in tensors_in(output):
        for u in (t, t._base) if t._is_view() else (t,):
            try:
                node = None if u is None else u.grad_fn
            except RuntimeError:
                continue
            if node is not None and id(node) not in nodes and _leads_to(node, targets):
                # (a later output that leads to this one leads to a norm: a model's hidden states, in order, each
                # found in a few nodes from the one before, where each alone was up to 71 from its norm in an 8-layer
                # Llama with biases and 34 of them cost 1.1 ms a forward; an adversarial pass)
                nodes[id(node)] = targets[id(node)] = node
    return list(nodes.values())


_LEAD_LIMIT = 128
"""How many nodes :func:`_leads_to` looks at: a model's output is a few nodes past its last norm (a Llama's logits:
6 to 9, its loss 9 to 12); an output not found to lead to a norm or an earlier output within them is not hooked (a
backward through it is then refused at the first checked norm's backward; read at the forward's end if no output is
hooked)."""


def _leads_to(node: Any, targets: dict[int, Any]) -> bool:
    """Whether ``node`` is one of ``targets`` or a backward from it reaches one, within :data:`_LEAD_LIMIT` nodes,
    breadth first (``targets`` and the nodes seen are held while their ids are compared)."""
    seen, todo = {id(node)}, [node]
    for current in todo:
        if id(current) in targets:
            return True
        if len(todo) >= _LEAD_LIMIT:
            continue
        for following, _ in current.next_functions:
            if following is not None and id(following) not in seen:
                seen.add(id(following))
                todo.append(following)
    return False


def _flags(taken: list[_Taken]) -> list[torch.Tensor]:
    """:func:`_changed` of the entries, one flag a device (a model split over two)."""
    by_device: dict[torch.device, list[_Taken]] = {}
    for entry in taken:
        by_device.setdefault(entry[1].device, []).append(entry)
    return [_changed(entries) for entries in by_device.values()]


def _refusal(at_backward: bool) -> str:
    when = ("so its backward is refused, when it reaches the model's output or that norm (on a GPU the check is read "
            "there, not at the forward's end: NOTE [ the check read at the backward ]). What ran between that forward "
            "and this backward is not undone: another model's optimizer step (a GAN's discriminator), and the "
            "gradients this backward reached first (parameters outside the model, or its head where the loss was "
            "taken on an activation), used already where an optimizer steps in backward" if at_backward
            else "so it is refused")
    return ("memtrim.convert: a norm's weight changed during a forward of the converted model without its version "
            "moving (a .data write, in the model's own code or a hook), after the model's norms had decided together "
            "which features keep their input and before the norm ran, so that a feature its weight now needs kept is "
            "not (NOTE [ keep decisions made together ] in memtrim/techniques/norms/_kernels.py). That forward's "
            f"saved tensors cannot give torch's gradients, {when}. Expected a norm's weight to change in place (which "
            "moves its version: under torch.no_grad(), not through .data), or through .data before the model's "
            "forward or in a forward pre-hook. The model's norms now decide at each call: run the step again (what "
            "the refused forward changed, a BatchNorm's running statistics, an EMA, it has changed once already).")


# ---------------------------------------------------------------------- NOTE [ the check read at the backward ]
# On a GPU, reading the flag of the forward's end check (NOTE [ keep decisions made together ]) made the host wait until
# the GPU had run the whole forward, and the GPU then waited while the host returned from the model, computed the loss
# and started the backward: on an H200 (benchmarks/convert_waits.py, 2026-11-30) a converted Llama step took 1.101x
# plain's with the flag read at the end and 1.039x with it never read; read at the backward, 1.033x against 1.058x read
# at the end, in one later run. There the flag is copied to the host without a wait and read when a backward reaches the
# model's output (a pre-hook on the grad_fn of each output tensor, and of a view's base: an in-place change of a
# returned view leaves the view's own node out of the graph; of nodes that lead to a checked norm only: a returned
# input's node is passed by other forwards' backwards), before any of the model's parameters has a gradient, by when the
# GPU has usually run the forward's end; a backward that does not pass the output (a loss on an activation a hook kept)
# reads it in the first checked norm's backward, before that norm's gradients. A forward no backward reaches is never
# read: no gradient uses its saved tensors. It is read at the forward's end as before on the CPU (no wait there), where
# the output holds no tensor that leads to a checked norm within a few nodes (a dataclass, which the output walk does
# not open), under torch.distributed (an error inside DDP's backward leaves its reducer waiting for gradients, and every
# later step fails: refused at the forward's end, the step can be run again) and under compiled autograd (which traces
# hooks). The price, in the rare loop the check exists for (a ``.data`` write to a norm's weight in the model's own
# forward): what ran between the refused forward and its backward is not undone when the step is run again, a GAN's
# discriminator step taken on the refused generator's output, or another model's parameters stepped inside the same
# backward (an adversarial pass); the error says so.
READ_AT_BACKWARD_ON_CPU = False
"""Tests: the GPU's path on the CPU."""


def read_at_backward(found: list[torch.Tensor]) -> bool:
    """Whether the forward's end check's ``found`` flags are left to be read at the backward (NOTE above)."""
    if not found or not all(type(flag) is torch.Tensor and (flag.is_cuda or READ_AT_BACKWARD_ON_CPU)
                            for flag in found):
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    config = sys.modules.get("torch._dynamo.config")
    return not (getattr(config, "compiled_autograd", False) or compiled_autograd_running())


def _to_host(flag: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The flag copied to pinned host memory without a wait, and the event after the copy (on the CPU: the flag)."""
    if not flag.is_cuda:
        return flag, None
    with torch.cuda.device(flag.device):
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    return host, copied


def _on_host(pending: tuple[torch.Tensor, Any]) -> bool:
    host, copied = pending
    if copied is not None:
        copied.synchronize()
    return bool(host)


def check_taken(ctx: Any) -> None:
    """Called first by a rebuilding norm's backward: where its decision was taken from an earlier norm's and its
    forward has not ended yet (a backward inside the model's forward), read whether that decision holds."""
    check = getattr(ctx, "memtrim_check", None)
    if check is not None:
        check.before_end(ctx)


def _on_stack(target: Any, frame: Any) -> bool:
    """Whether ``target`` is ``frame`` or one of its callers."""
    while frame is not None and frame is not target:
        frame = frame.f_back
    return frame is not None


def _open_forward() -> _Open | None:
    """This thread's innermost open forward of a converted model, or None; entries whose forward a
    ``KeyboardInterrupt`` left are dropped."""
    stack = getattr(_LOCAL, "stack", None)
    while stack:
        top = stack[-1]
        frame: Any = sys._getframe(1)
        while frame is not None and frame is not top.frame:
            frame = frame.f_back
        if frame is not None:
            return top
        stack.pop()
    return None


class _Decision:
    """One norm's weights (held weakly: a fast weight is not kept alive by this), and what was decided from them."""

    __slots__ = ("beta", "epoch", "floor", "gamma", "kept", "mask", "offset", "shapes", "versions")

    def __init__(self, gamma: torch.Tensor, beta: torch.Tensor | None, floor: float, offset: float) -> None:
        self.gamma = weakref.ref(gamma)
        self.beta = None if beta is None else weakref.ref(beta)
        self.floor, self.offset = floor, offset
        self.epoch = -1
        self.versions: tuple[int, int] | None = None
        self.shapes: tuple[Any, Any] | None = None
        self.kept: torch.Tensor | None = None
        self.mask: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        gamma = self.gamma()
        beta = None if self.beta is None else self.beta()
        return None if gamma is None or (self.beta is not None and beta is None) else (gamma, beta)

    def of(self, gamma: torch.Tensor, beta: torch.Tensor | None) -> bool:
        """Whether these are the weights it was made for (the objects themselves)."""
        return self.gamma() is gamma and (None if self.beta is None else self.beta()) is beta

    def holds(self, epoch: int, gamma: torch.Tensor, beta: torch.Tensor | None) -> bool:
        """Whether it was decided in this forward from these weights at the versions and shapes they have now (a
        sharding framework sets ``.data`` to a view of a shard between a block's calls, which moves no version: a
        decision made from the shard, for every norm seen before, once kept one feature for a full weight and trained
        NaN; an adversarial pass)."""
        if self.epoch != epoch or self.gamma() is not gamma or (None if self.beta is None else self.beta()) is not beta:
            return False  # (the checks of `of`, `_versions` and `_shapes` written out: this runs at every norm's call)
        return (self.versions == (gamma._version, -1 if beta is None else beta._version)
                and self.shapes == (gamma.shape, None if beta is None else beta.shape))


def _versions(gamma: torch.Tensor, beta: torch.Tensor | None) -> tuple[int, int]:
    return gamma._version, -1 if beta is None else beta._version


def _shapes(gamma: torch.Tensor, beta: torch.Tensor | None) -> tuple[Any, Any]:
    return gamma.shape, None if beta is None else beta.shape


def _hooked(model: nn.Module) -> bool:
    """Whether a forward of ``model`` runs forward hooks or pre-hooks that may write a norm's weight through ``.data``
    before the norm runs: any but memtrim's and transformers' own (which record outputs, or make the embeddings'
    output need a gradient: ``enable_input_require_grads``; they stay on a model once a call asked for attentions)."""
    for hooks in (_global_hooks.get("_global_forward_pre_hooks"), _global_hooks.get("_global_forward_hooks")):
        if hooks and not all(_trusted(h) for h in hooks.values()):
            return True
    return any(not _trusted(h) for m in model.modules() for hooks in (m._forward_pre_hooks, m._forward_hooks)
               for h in hooks.values())


def _trusted(hook: Any) -> bool:
    return memtrims(hook) or defined_in(hook, "transformers")


_global_hooks = vars(torch.nn.modules.module)


def _changed(taken: list[_Taken]) -> torch.Tensor:
    """Whether a decision a norm took from an earlier norm's left out a feature that the weights it computed with need
    kept (keeping more than they need is harmless: a kept feature's xhat is exact): one boolean tensor for all of
    them."""
    masks = _masks([(gamma, beta, floor, 0.0) for _, gamma, beta, floor, _ in taken])[1]
    taken_masks = [entry[0] for entry in taken]
    return (masks & ~(torch.cat(taken_masks) if len(taken_masks) > 1 else taken_masks[0])).any()


class DecidedTogether:
    """The keep decisions of one converted model's norms, made together once a forward (NOTE [ keep decisions made
    together ]). ``enter`` and ``leave`` are the model's forward pre-hook and (always called) forward hook."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch = 0
        self._decisions: dict[tuple[int, int, float, float], _Decision] = {}
        self._alone = False  # (after a decision taken differed from the norm's own: NOTE above)
        # (the model, torch's hook count, and whether it had hooks not memtrim's then: _hooked_now)
        self._hooks_seen: tuple[int, int, bool] | None = None

    def __getstate__(self) -> dict[str, Any]:  # (a pickled or copied model decides afresh)
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def enter(self, module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = _LOCAL.__dict__.setdefault("stack", [])
        frame = sys._getframe(1)  # the model's _call_impl
        while stack and not _on_stack(stack[-1].frame, frame):  # (left by a KeyboardInterrupt: dropped here too,
            stack.pop()                                          # not only under a later open forward)
        # (under torch.jit.trace the decisions' bookkeeping would join the traced graph: its norms decide alone)
        if self._alone or plain_only() or torch.jit.is_tracing() or self._hooked_now(module):
            stack.append(_Open(None, 0, frame))  # its norms decide alone (or run as torch's: nothing to decide)
            return
        with self._lock:
            self._epoch += 1
            stack.append(_Open(self, self._epoch, frame))

    def _hooked_now(self, module: nn.Module) -> bool:
        """:func:`_hooked`, walked again only where a hook was registered anywhere since the last walk (torch numbers
        every hook handle it makes): a walk over every module at every forward was about 0.2 ms of a small converted
        Llama's step on the CPU. A submodule attached since with hooks of its own is not seen until then; a ``.data``
        write such a hook makes before a norm runs but after the decision is refused all the same, in the backward on
        a GPU (NOTE above; one after the norm ran trains as torch: NOTE [ the weights a rebuild reads ])."""
        count, seen = foreign_handles(), self._hooks_seen
        # (a hooked model is walked at every forward, as before: removing a hook makes no handle)
        if seen is None or seen[2] or count is None or seen[:2] != (id(module), count):
            seen = self._hooks_seen = (id(module), -1 if count is None else count, _hooked(module))
        return seen[2]

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling():
            return
        stack = getattr(_LOCAL, "stack", None)
        if not stack or stack[-1].group not in (self, None):
            return
        top = stack.pop()
        if top.group is self and not any(o.group is self for o in stack):
            self._forget(top.epoch)
        if top.check is not None:
            top.check.at_end(output)

    def _forget(self, epoch: int) -> None:
        """Let the masks and indices decided in the forward ``epoch`` go at its end: the next forward decides again,
        and what this one's norms and its check need they hold themselves. Held until the next forward, they were
        above plain at the step's peak, the optimizer's (a converted HF Llama: 64 B a norm; an adversarial pass)."""
        with self._lock:
            for decision in self._decisions.values():
                if decision.epoch == epoch:
                    decision.epoch, decision.mask, decision.kept = -1, None, None

    def kept(self, gamma: torch.Tensor, beta: torch.Tensor | None, floor: float, offset: float, open_: _Open,
             node: Any, read: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        """``keep_input_features(gamma, beta, None, floor, offset)``, decided with the model's other norms; a decision
        taken from an earlier norm's is checked against ``read`` (NOTE [ keep decisions made together ])."""
        key = (id(gamma), -1 if beta is None else id(beta), floor, offset)
        with self._lock:
            found = self._decisions.get(key)
            if found is not None and found.holds(open_.epoch, gamma, beta):
                assert found.kept is not None and found.mask is not None
                open_.take(found.mask, read, floor, node)  # (checked at the forward's end)
                return found.kept
            if found is None or not found.of(gamma, beta):
                found = self._decisions[key] = _Decision(gamma, beta, floor, offset)
            self._decide(gamma.device, open_.epoch)  # (from the weights it computed with: nothing to check)
            assert found.kept is not None
            return found.kept

    def _decide(self, device: torch.device, epoch: int) -> None:
        """Decide for every norm seen before whose decision this forward has not made, on ``device``: one wait."""
        todo = []
        for key, decision in list(self._decisions.items()):
            tensors = decision.tensors()
            if tensors is None:  # (its weights are gone)
                del self._decisions[key]
            elif any(t is not None and t.untyped_storage().nbytes() == 0 for t in tensors):
                continue  # (freed by a sharding framework after its block ran, FSDP's flat parameters: not read)
            elif tensors[0].device == device and not decision.holds(epoch, *tensors):
                todo.append((decision, *tensors))
        masks, whole = _masks([(gamma, beta, d.floor, d.offset) for d, gamma, beta in todo])
        found = _indices(whole)  # the one wait
        for (decision, gamma, beta), mask in zip(todo, masks):
            # where no feature keeps its input (what trained weights mostly give), none of this norm's does; else
            # each norm gathers its own, one wait each (their counts, read from the values, a plan's trace may not
            # know: NOTE [ known values ] in planner/_values.py; it knows the shapes nonzero gives)
            decision.kept = found[:0] if found.numel() == 0 else _indices(mask)
            decision.mask, decision.epoch, decision.versions = mask, epoch, _versions(gamma, beta)
            decision.shapes = _shapes(gamma, beta)

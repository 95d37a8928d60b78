"""Recipes: a saved tensor kept as "how to rebuild it" instead of itself.

NOTE [ recipes at consumer call sites ]
Autograd keeps, for each node, the tensors its backward needs. When a tensor ``T`` is cheap to rebuild from
tensors ``S`` that backward keeps anyway (an activation's output from its input, ``act(g) * u`` from ``g`` and
``u``), keeping ``T`` too is waste. The producer *marks* ``T`` (:func:`mark_recomputable`): a registry maps
``T``'s storage (through a weak reference: the registry never keeps a tensor alive beyond ``T``'s own life) to a
:class:`Recipe` and the sources, with ``T``'s version counter and layout. While a *consumer scope* is active
(:class:`recipes_honoured`, or :func:`keep_recipes_in` around a module's forward), every tensor autograd saves
passes through our pack hook:

* a saved tensor whose storage, version and dtype match a live recipe (``T`` itself or any view of it: a Linear
  on 3-D input saves a 2-D view) becomes a :class:`_Handle`: the view's geometry plus the recipe's sources,
  each packed through the saved-tensor hooks active *outside* our scope (memtrim's tracker counts them, a
  checkpoint drops and recomputes them) or, with no hooks outside, kept as detached aliases with their version;
  a source that is itself a live recipe becomes a nested handle;
* anything else passes to the hooks outside unchanged (or is kept as a detached alias; a parameter as itself, as
  autograd keeps a saved leaf), and ``unpack`` repeats
  autograd's in-place version check, which autograd skips for hooked tensors.

In backward the first handle unpacked rebuilds ``T = fn(*sources)`` under no_grad and caches it on the recipe;
every other handle of that recipe shares it, and the cache is dropped as soon as every live handle has been
unpacked (or has died). Autograd re-attaches the saved tensor's own grad_fn edge to what an unpack hook returns,
so when the rebuild is bitwise, a backward with create_graph=True is exact too; recipes that are not bitwise can
refuse it (``double_backward=False``: a :class:`ConvertError` naming the owner).

A producer that is one op whose autograd node saves everything the op reads (a LayerNorm, a GELU, a SiLU: NOTE
[ recipes from the producer's autograd node ]) needs no registry entry: its node is tagged instead.

A producer whose own backward keeps its output (relu, sigmoid) saves ``T`` before it can be marked: :class:`producing`
holds saves made in its scope provisionally and decides at exit, once ``T`` is marked. Where ``T`` is made in place
from a tensor that exists before (BatchNormReLU's ``relu_``), marking that tensor first at the version the op leaves
(``mark_recomputable(version=)``) does the same inside an ordinary consumer scope.

In-place edits: a source changed in place after ``T`` was made is never used (the pack keeps ``T`` itself; after the
pack, unpacking raises autograd's "modified by an inplace operation"). ``T`` changed in place after a consumer saved
it raises the same while ``T`` is alive (a weak reference); once ``T`` has died the recipe cannot see the edit and
rebuilds the value the consumer saw, so the gradient is that of the computation that ran, where torch would raise.

Under torch.compile and torch.func (:func:`plain_only`) and with grad mode off nothing is marked or hooked.
Scopes are per thread (saved-tensor hooks are thread-local); the registry is shared, written under a lock.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...errors import ConvertError
from ...measure.hooks import check_saved_version, compiled_autograd_running, top_saved_tensors_hooks
from ..guards import HOOKS_ENABLED, RECOMPUTE_HOOKS, any_autocast, hooks_allowed, memtrims, plain_only, saves_checked

__all__ = [
    "Recipe", "enter_consumer_scope", "entry_of", "exit_consumer_scope", "exit_if_on_top", "is_recomputable",
    "mark_recomputable", "producing", "recipe_of", "recipes_honoured", "register", "source_of", "tag_output",
]


_MARK = RECOMPUTE_HOOKS  # attribute on our pack functions: "these hooks are memtrim's recompute hooks"
_DisableAutocast: Any = getattr(torch._C, "_DisableAutocast", contextlib.nullcontext)  # (private: absent, as before)


class Recipe:
    """How to rebuild one tensor, shared by every saved copy of it: the function, the tensor's layout, who made it,
    and the rebuilt tensor while a backward needs it."""

    __slots__ = ("fn", "owner", "shape", "stride", "dtype", "device", "double_backward", "tag", "cache", "live",
                 "done", "autocast", "__weakref__")
    # one lock for every recipe's cache and counts (a lock per recipe was measurable Python per call; rebuilds are
    # short and nest, hence re-entrant)
    lock = threading.RLock()

    def __init__(self, fn: Callable[..., torch.Tensor], tensor: torch.Tensor, owner: str, double_backward: bool,
                 tag: str | None) -> None:
        self.fn, self.owner, self.double_backward, self.tag = fn, owner, double_backward, tag
        self.shape, self.stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
        self.cache: torch.Tensor | None = None
        self.live = 0  # handles alive
        self.done: set[int] = set()  # handles unpacked since the cache was built
        self.autocast = any_autocast()  # at the producer's call

    def _run(self, sources: list[torch.Tensor]) -> torch.Tensor:
        """The recipe's function, as the forward ran: without autocast where the forward had none, a backward called
        inside ``torch.autocast`` included (the rebuild came out in bfloat16 there, refused as another tensor: found
        by an adversarial pass); a plain backward runs with grad off, one with ``create_graph=True`` on."""
        if not self.autocast and any_autocast():
            with _DisableAutocast(), torch.no_grad():
                return self.fn(*sources)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self.fn(*sources)
        return self.fn(*sources)

    def _rebuild(self, sources: list[torch.Tensor]) -> torch.Tensor:
        try:
            t = self._run(sources)
        except RuntimeError as e:
            if "is not allocated" not in str(e):
                raise
            # found by an adversarial pass: FSDP2 (reshard_after_forward) frees a unit's unsharded parameters after
            # its forward, and a LayerNorm ending one unit was rebuilt in the next unit's backward, before FSDP2
            # gathers them again (BERT's layout): torch's bare "data is not allocated yet"
            raise ConvertError(
                f"memtrim: {self.owner} rebuilds in backward a tensor it did not keep, from tensors freed since its "
                f"forward ({e}). Under FSDP2, fully_shard frees a unit's parameters after its forward "
                "(reshard_after_forward=True), and this module's output is rebuilt in the backward of a later unit "
                "that reads it. To fix: put this module in the same fully_shard unit as the layer that reads its "
                "output, pass reshard_after_forward=False to its unit, or leave it out of memtrim.convert "
                "(module_filter)."
            ) from e
        if not isinstance(t, torch.Tensor) or t.shape != self.shape or t.dtype != self.dtype or t.device != self.device:
            found = (f"{type(t).__name__} {tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor)
                     else type(t).__name__)
            raise ConvertError(
                f"memtrim: {self.owner} rebuilds a tensor it did not keep, and the rebuild differs from the original. "
                f"Expected {tuple(self.shape)} {self.dtype} on {self.device}; found {found}. To fix: leave this module "
                "out of memtrim.convert (module_filter); the recipe's function is not a pure function of its inputs."
            )
        if t.stride() != self.stride:  # same values, other layout: lay them out as the original was
            t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).copy_(t)
        return t


class _Entry:
    """A live recipe in the registry: the recipe, its sources (strong, while T lives), T's version, a weak
    reference to T (for the in-place check at unpack) and to T's storage (whose death removes the entry)."""

    __slots__ = ("recipe", "sources", "versions", "flat", "version", "tensor_ref", "storage_ref")
    recipe: Recipe
    sources: tuple[torch.Tensor | _Entry | _NodeSource, ...]
    versions: tuple[int, ...]
    flat: bool  # no source is a nested recipe
    version: int
    tensor_ref: weakref.ref[torch.Tensor]
    storage_ref: weakref.ref[torch.UntypedStorage]


_lock = threading.Lock()
_REGISTRY: dict[int, _Entry] = {}  # id(storage of T) -> entry; removed by a weakref callback when T's storage dies


def _forget(key: int, entry: _Entry, ref: object = None) -> None:
    with _lock:
        if _REGISTRY.get(key) is entry:
            del _REGISTRY[key]


def _lookup(tensor: torch.Tensor) -> _Entry | None:
    """The live entry whose tensor ``tensor`` is a view of (same storage, same version, same dtype), or None."""
    if not _REGISTRY or tensor.layout is not torch.strided:
        return None
    try:
        entry = _REGISTRY.get(id(tensor.untyped_storage()))
    except (RuntimeError, NotImplementedError):
        return None
    if (entry is None or entry.version != tensor._version or entry.recipe.dtype != tensor.dtype
            or entry.storage_ref() is None or not _sources_unchanged(entry)):
        return None
    return entry


def _sources_unchanged(entry: _Entry) -> bool:
    """No source (nor a nested recipe's source) was changed in place since ``T`` was made from it."""
    if entry.flat:  # the usual entry: every source a tensor, compared with its version (no type test per source)
        for source, version in zip(entry.sources, entry.versions):
            if source._version != version:  # type: ignore[union-attr]
                return False
        return True
    for source, version in zip(entry.sources, entry.versions):
        if isinstance(source, _Entry):
            if not _sources_unchanged(source):
                return False
        elif isinstance(source, _NodeSource):
            t = source.tensor_ref()
            if t is not None and t._version != source.version:
                return False
        elif source._version != version:
            return False
    return True


def _whole(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one dense block covering its whole storage from offset 0."""
    if tensor.layout is not torch.strided or tensor.storage_offset() != 0 or tensor.is_sparse:
        return False
    if not tensor.is_contiguous() and not _dense_in_some_order(tensor):
        return False
    return tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


def _dense_in_some_order(tensor: torch.Tensor) -> bool:
    """Whether the strides are a contiguous layout of some permutation of the dimensions (channels-last, a
    transposed contiguous tensor, ...): no gaps, no overlaps."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(tensor.shape, tensor.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def mark_recomputable(tensor: torch.Tensor, fn: Callable[..., torch.Tensor], *sources: torch.Tensor, owner: str,
                      double_backward: bool = True, tag: str | None = None, version: int | None = None,
                      checked: bool = False) -> bool:
    """Register that ``tensor == fn(*sources)``: saved copies of it made inside a consumer scope keep the sources
    instead. See NOTE [ recipes at consumer call sites ].

    Args:
        tensor: the tensor ``T`` to drop; one dense block covering its storage from offset 0.
        fn: rebuilds ``T`` from the sources, called in backward under no_grad. Deterministic, no RNG draws, no side
            effects (no BatchNorm forward that updates running statistics); bitwise equal to ``T`` where gradients
            must be bitwise.
        sources: the tensors ``fn`` needs, kept for backward anyway (else memory moves rather than drops). A source
            that is itself marked becomes a nested recipe.
        owner: how errors name the producer (its module path).
        double_backward: False if a backward with create_graph=True must refuse (a rebuild that is not bitwise).
        tag: a label :func:`is_recomputable` can ask for (BatchNormReLU marks its outputs ``"relu"``).
        version: the version ``tensor`` will have when it is saved, where it is marked before the in-place op that
            makes it (BatchNormReLU marks its BatchNorm's output ``v``, then ``relu_(v)`` saves it at ``v._version +
            1``): that op's own save then keeps the recipe in an ordinary consumer scope. Default: its version now.
        checked: the caller has just checked grad mode and :func:`plain_only` (a per-call path).

    Returns:
        Whether a recipe was registered: False with grad mode off, under torch.compile/torch.func, for a tensor that
        is not one whole storage, or one sharing a storage with a source (an in-place producer).
    """
    if not checked and (not torch.is_grad_enabled() or plain_only()):
        return False
    resolved: list[torch.Tensor | _Entry | _NodeSource] = []
    for source in sources:
        if type(source) is torch.nn.Parameter:  # never a marked tensor (the usual parameter: no metaclass check)
            resolved.append(source)
            continue
        if not isinstance(source, torch.Tensor) or source.layout is not torch.strided:
            return False
        resolved.append(source_of(source))
    return register(tensor, fn, resolved, owner=owner, double_backward=double_backward, tag=tag, checked=True,
                    version=version) is not None


def entry_of(tensor: torch.Tensor) -> _Entry | None:
    """The live registry entry of exactly ``tensor`` (for callers that must keep it past the tensor's life)."""
    entry = _lookup(tensor)
    if (entry is None or tensor.storage_offset() != 0 or tensor.shape != entry.recipe.shape
            or tensor.stride() != entry.recipe.stride):
        return None
    return entry


def register(tensor: torch.Tensor, fn: Callable[..., torch.Tensor],
             sources: Iterable[torch.Tensor | _Entry | _NodeSource], *,
             owner: str, double_backward: bool = True, tag: str | None = None, checked: bool = False,
             version: int | None = None) -> _Entry | None:
    """:func:`mark_recomputable` with sources already resolved (a source may be an entry from :func:`entry_of`,
    kept alive by the caller after its tensor died). Returns the entry, or None if nothing was registered.
    ``checked``: the caller has just checked grad mode and :func:`plain_only` (a per-call path)."""
    if not checked and (not torch.is_grad_enabled() or plain_only()):
        return None
    if not _whole(tensor):
        return None
    storage = tensor.untyped_storage()
    resolved: list[torch.Tensor | _Entry | _NodeSource] = []
    for source in sources:
        # a Parameter is kept as itself: never a producer's output (no in-place check needed), and saved-tensor hooks
        # outside (memtrim.OffloadActivations) then see a parameter and leave it where it is, as with torch's own saves
        # (a plain tensor or parameter first: Parameter's isinstance runs a Python metaclass check)
        kind = type(source)
        if isinstance(source, torch.Tensor) and kind is not torch.nn.Parameter and (
                kind is torch.Tensor or not isinstance(source, torch.nn.Parameter)):
            # the same storage (compared as torch's StorageWeakRef does: fake tensors, as a plan traces them, all
            # have data pointer 0)
            try:
                same = source.untyped_storage()._cdata == storage._cdata
            except (RuntimeError, NotImplementedError):  # (a functorch wrapper a finished transform left: no storage)
                return None
            if same and storage.nbytes() > 0:
                return None  # an in-place producer: its input is gone
            source = source.detach()
        resolved.append(source)
    entry = _Entry()
    entry.recipe = Recipe(fn, tensor, owner, double_backward, tag)
    entry.sources = tuple(resolved)
    entry.versions = tuple([s._version if isinstance(s, torch.Tensor) else -1 for s in resolved])
    entry.flat = -1 not in entry.versions
    entry.version = tensor._version if version is None else version
    entry.tensor_ref = weakref.ref(tensor)
    key = id(storage)
    entry.storage_ref = weakref.ref(storage, functools.partial(_forget, key, entry))
    with _lock:
        _REGISTRY[key] = entry
    return entry


def recipe_of(tensor: torch.Tensor) -> Recipe | None:
    """The live recipe of exactly ``tensor`` (whole storage, unchanged since it was marked), or None."""
    entry = entry_of(tensor)
    return None if entry is None else entry.recipe


def is_recomputable(tensor: torch.Tensor, tag: str | None = None) -> bool:
    """Whether ``tensor`` is exactly a marked tensor, unchanged since (and, with ``tag``, marked with that tag)."""
    recipe = recipe_of(tensor)
    return recipe is not None and (tag is None or recipe.tag == tag)


# ---------------------------------------------------------------------- recipes kept by the producer's node
# NOTE [ recipes from the producer's autograd node ]
# Most producers convert rebuilds are one op whose autograd node already saves every tensor and setting the op
# reads: gelu keeps its input and ``approximate``, native_layer_norm its input, normalized_shape, weight and bias
# (all but eps). The op run again on what its node saved is the op's own output, bitwise, so such a producer needs
# no registry entry, no detached sources and no settings compared per call: :func:`tag_output` puts a
# :class:`_NodeRecipe` in the node's ``metadata`` (with the output's TensorImpl and version, and the eps of a
# LayerNorm, which the node does not keep), and a consumer scope's pack that meets the unchanged output (or a view
# of it) keeps the node instead (:func:`_node_handle`). In backward the rebuild reads the node's saved tensors
# through autograd itself: its own in-place check, through whatever hooks packed them. The node outlives every
# consumer's unpack in one backward (a node runs after everything that reads its output); the handle keeps it alive
# past that only with the graph.
# A producer's Python per call is about a third of a registry recipe's; a LayerNorm rebuilt for its Linear costs
# 99 µs per forward + backward instead of 155 (benchmarks/convert_overhead.py, on tiny tensors).
# Where the node's saves are not checked for in-place changes, or a checkpoint kept them (:func:`saves_checked`),
# nothing is tagged and consumers keep the output as torch does.
_NODE_KEY = "memtrim_recipe"


def _node_layer_norm(node: Any, eps: float) -> torch.Tensor:
    return torch.native_layer_norm(node._saved_input, node._saved_normalized_shape, node._saved_weight,
                                   node._saved_bias, eps)[0]


_NODE_REBUILDS: dict[str, Callable[[Any, Any], torch.Tensor]] = {
    "NativeLayerNormBackward0": _node_layer_norm,
    "GeluBackward0": lambda n, _: torch._C._nn.gelu(n._saved_self, approximate=n._saved_approximate),
    "SiluBackward0": lambda n, _: torch._C._nn.silu(n._saved_self),
    "MishBackward0": lambda n, _: torch._C._nn.mish(n._saved_self),
    "HardswishBackward0": lambda n, _: torch._C._nn.hardswish(n._saved_self),
    "HardsigmoidBackward0": lambda n, _: torch._C._nn.hardsigmoid(n._saved_self),
    "SoftplusBackward0": lambda n, _: torch._C._nn.softplus(n._saved_self, n._saved_beta, n._saved_threshold),
    "EluBackward0": lambda n, _: torch._C._nn.elu(n._saved_self, n._saved_alpha, n._saved_scale,
                                                  n._saved_input_scale),
    "CeluBackward0": lambda n, _: torch.celu(n._saved_self, n._saved_alpha),
    "LeakyReluBackward0": lambda n, _: torch._C._nn.leaky_relu(n._saved_self, n._saved_negative_slope),
    "HardtanhBackward0": lambda n, _: torch._C._nn.hardtanh(n._saved_self, n._saved_min_val, n._saved_max_val),
    "LogSigmoidBackward0": lambda n, _: torch._C._nn.log_sigmoid(n._saved_self),
}
"""Autograd node class name -> the op run again on what the node saved (and the recipe's ``extra``: a LayerNorm's
eps). Each is the op that made the node, so its output is the forward's, bitwise."""

NODE_OPS = frozenset({"native_layer_norm", "gelu", "silu", "mish", "hardswish", "hardsigmoid", "softplus", "elu",
                      "celu", "leaky_relu", "hardtanh", "log_sigmoid_forward"})  # log_sigmoid runs log_sigmoid_forward
"""The aten ops (as convert's trace names them) whose nodes :data:`_NODE_REBUILDS` rebuilds from."""


class _NodeRecipe(Recipe):
    """A recipe kept in its node's ``metadata``: the output's TensorImpl and version at the call, ``extra``, and a
    weak reference to the tensor the producer returned (the in-place check at unpack, while it lives: a consumer
    may save a view made inside it, which dies at once)."""

    __slots__ = ("extra", "impl", "version", "output_ref")
    extra: Any
    impl: int
    version: int
    output_ref: weakref.ref[torch.Tensor]

    def _rebuild(self, sources: list[Any]) -> torch.Tensor:
        reads = _reads  # (NOTE [ a node's saves read by a rebuild ])
        outer, reads.node = reads.__dict__.get("node", False), True
        try:
            return super()._rebuild(sources)
        except ConvertError:
            raise
        except RuntimeError as e:
            if "freed" not in str(e):
                raise
            if compiled_autograd_running():
                raise ConvertError(
                    f"memtrim: {self.owner} does not keep its output; backward rebuilds it from what its autograd "
                    "node saved, and torch's compiled autograd (torch._dynamo.compiled_autograd) released those "
                    "saved tensors before its graph ran memtrim's saved-tensor hooks. Expected the eager autograd "
                    "engine for this backward; found compiled autograd. To fix: run the backward without compiled "
                    "autograd, enable compiled autograd around the forward too (the module then keeps its output as "
                    "torch does), compile the model itself (torch.compile(model): converted modules run as torch's "
                    "own ops), or leave this module out of memtrim.convert (module_filter)."
                ) from e
            raise ConvertError(
                f"memtrim: {self.owner} does not keep its output; backward rebuilds it from what its autograd node "
                "saved, and an earlier backward through that node freed it (retain_graph=False). Expected the node's "
                "saved tensors; found them freed. To fix: pass retain_graph=True to the earlier backward, or leave "
                "this module out of memtrim.convert (module_filter)."
            ) from e
        finally:
            reads.node = outer


# NOTE [ a node's saves read by a rebuild ]
# A tagged node's rebuild reads the tensors the node saved (``node._saved_self``), and the node's own backward reads
# them again later in the same backward. Where one of them is itself a handle (GroupNorm -> SiLU -> Conv: the SiLU
# node keeps the GroupNorm's recipe, the Conv the SiLU's node), counting the first read as the handle's unpack let
# the cache go, and the node's backward rebuilt the norm a second time (found by an adversarial pass). So a read made
# by a node's rebuild (``_reads.node``, per thread) does not count: the cache stays for the node's own unpack, or until
# the handle dies with the graph (a backward that never reaches the node: torch.autograd.grad of other inputs).
_reads = threading.local()


class _NodeSource:
    """A tagged node's output (or a view of it) as a saved tensor or a recipe's source: the node, the view's
    geometry (None: the whole output), and a weak reference to the tensor with its version (the in-place check)."""

    __slots__ = ("node", "recipe", "view", "tensor_ref", "version")
    node: Any
    recipe: _NodeRecipe
    view: tuple[torch.Size, tuple[int, ...], int | torch.SymInt] | None
    tensor_ref: weakref.ref[torch.Tensor]
    version: int


def _tagged(tensor: torch.Tensor) -> _NodeSource | None:
    """``tensor`` as the output of a tagged node, unchanged since the node made it, or None."""
    base = tensor._base
    if base is None:
        base = tensor
    node: Any = base.grad_fn
    if node is None or type(node).__name__ not in _NODE_REBUILDS:  # the usual tensor: no metadata made
        return None
    recipe = node.metadata.get(_NODE_KEY)
    if (recipe is None or recipe.impl != base._cdata or recipe.version != base._version
            or recipe.dtype != tensor.dtype):
        return None
    found = _NodeSource()
    found.node, found.recipe, found.tensor_ref, found.version = node, recipe, recipe.output_ref, tensor._version
    found.view = (None if (tensor.storage_offset() == 0 and tensor.shape == recipe.shape
                           and tensor.stride() == recipe.stride)
                  else (tensor.shape, tensor.stride(), tensor.storage_offset()))
    return found


def source_of(tensor: torch.Tensor) -> torch.Tensor | _Entry | _NodeSource:
    """``tensor`` as a recipe's source: its live registry entry, its tagged node, or itself (a nested recipe keeps
    what rebuilds it, not the tensor)."""
    return entry_of(tensor) or _tagged(tensor) or tensor


def tag_output(tensor: torch.Tensor, owner: str, eps: float | None = None) -> bool:
    """Tag the autograd node that made ``tensor`` (or the tensor ``tensor`` is a view of) so that consumer scopes
    keep the node instead of the tensor: NOTE [ recipes from the producer's autograd node ]. Callers have checked
    :func:`plain_only`.

    Args:
        tensor: a module's output: one op's output, or a view of one (timm's ``LayerNorm2d`` permutes it back).
        owner: how errors name the producer.
        eps: a LayerNorm's eps, as the forward used it (its node does not keep it); None for any other op.

    Returns:
        Whether a node was tagged: False for a tensor without a node (grad mode off, nothing requiring grad), one
        made by another op (a LayerNorm's without ``eps``, any other with it), by an op in place or changed in place
        since (its node is then the in-place op's; under no_grad the node stays and the version moves from the 0 of
        a new tensor: a clamp in the module's own forward or in a hook), or made under saved-tensor hooks that skip
        autograd's in-place check (:func:`saves_checked`).
    """
    if not saves_checked() or compiled_autograd_running():  # compiled autograd frees the node's saves first
        return False
    base = tensor._base
    if base is None:
        base = tensor
    node: Any = base.grad_fn
    if node is None:
        return False
    rebuild = _NODE_REBUILDS.get(type(node).__name__)
    if (rebuild is None or (rebuild is _node_layer_norm) != (eps is not None) or base.output_nr != 0
            or base.layout is not torch.strided or base._version != 0):
        return False
    recipe = _NodeRecipe(rebuild, base, owner, True, None)
    recipe.extra, recipe.impl, recipe.version, recipe.output_ref = eps, base._cdata, base._version, weakref.ref(tensor)
    node.metadata[_NODE_KEY] = recipe
    return True


# ---------------------------------------------------------------------- what autograd keeps
class _Kept:
    """A saved tensor passed through: packed by the hooks outside, or a detached alias with its version."""

    __slots__ = ("tensor", "version", "packed", "outer", "who", "source", "original")
    tensor: torch.Tensor | None  # None when packed by the hooks outside
    version: int
    packed: Any
    outer: Any
    who: str | Callable[[], str]
    source: bool  # a recipe's source (kept to rebuild from), not a tensor torch keeps itself
    original: weakref.ref[torch.Tensor] | None  # a source packed by the hooks outside: the tensor itself, while alive


def _keep(tensor: torch.Tensor, outer: Any, who: str | Callable[[], str], source: bool = False) -> _Kept:
    saver = getattr(_local, "saver", None)  # a scope that says who keeps what it saves (a checkpoint's inputs)
    if saver is not None:
        who, source = saver, True
    kept = _Kept()
    kept.outer, kept.who, kept.source, kept.original = outer, who, source, None
    if outer is not None:
        kept.packed, kept.tensor, kept.version = outer[0](tensor), None, tensor._version
        if source:  # hooks outside may keep the tensor itself and check nothing (torch skips its own check for
            kept.original = weakref.ref(tensor)  # them): a source changed in place would rebuild another tensor
    elif type(tensor) is torch.nn.Parameter:  # a leaf has no grad_fn to make a cycle through: kept as itself, as
        kept.packed, kept.tensor, kept.version = None, tensor, tensor._version  # autograd keeps a saved leaf
    else:  # detached: no cycle through the tensor's grad_fn
        kept.packed, kept.tensor, kept.version = None, tensor.detach(), tensor._version
    return kept


def _unkeep(kept: _Kept) -> torch.Tensor:
    if kept.outer is not None:
        original = kept.original() if kept.original is not None else None
        if original is not None:  # a parameter the module holds, or a source still alive
            check_saved_version(original, kept.version, kept.who, source=True)
        return kept.outer[1](kept.packed)
    assert kept.tensor is not None
    check_saved_version(kept.tensor, kept.version, kept.who, source=kept.source)
    return kept.tensor


class _Handle:
    """What autograd keeps instead of (a view of) a marked tensor: the recipe, the view's geometry, the sources as
    packed at save time, and a weak reference to the marked tensor for the in-place check."""

    __slots__ = ("recipe", "sources", "versions", "view", "version", "tensor_ref", "__weakref__")
    recipe: Recipe
    sources: tuple[_Handle | _Kept, ...] | tuple[Any, ...]
    versions: tuple[int, ...] | None  # set where ``sources`` are the entry's own tensors, checked against these
    view: tuple[torch.Size, tuple[int, ...], int | torch.SymInt] | None  # None: the whole marked tensor
    version: int
    tensor_ref: weakref.ref[torch.Tensor]

    def __del__(self) -> None:
        try:
            recipe = self.recipe
        except AttributeError:  # pragma: no cover - construction failed
            return
        with recipe.lock:
            recipe.live -= 1
            recipe.done.discard(id(self))
            if recipe.cache is not None and len(recipe.done) >= recipe.live:
                recipe.cache = None
                recipe.done.clear()


def _handle(entry: _Entry, tensor: torch.Tensor | None, outer: Any) -> _Handle:
    recipe = entry.recipe
    handle = _Handle()
    handle.recipe, handle.version, handle.tensor_ref = recipe, entry.version, entry.tensor_ref
    handle.view = (None if tensor is None or (tensor.storage_offset() == 0 and tensor.shape == recipe.shape
                                                and tensor.stride() == recipe.stride)
                   else (tensor.shape, tensor.stride(), tensor.storage_offset()))
    if outer is None and entry.flat:  # the usual case: the entry's own detached sources, checked at unpack
        handle.sources, handle.versions = entry.sources, entry.versions
    else:
        handle.sources = tuple(_handle(s, None, outer) if isinstance(s, _Entry) else
                               _node_handle(s) if isinstance(s, _NodeSource) else
                               _keep(s, outer, recipe.owner, True) for s in entry.sources)
        handle.versions = None
    with recipe.lock:
        recipe.live += 1
    return handle


def _node_handle(source: _NodeSource) -> _Handle:
    recipe = source.recipe
    handle = _Handle()
    handle.recipe, handle.version, handle.tensor_ref, handle.view = (recipe, source.version, source.tensor_ref,
                                                                     source.view)
    handle.sources, handle.versions = (source.node, recipe.extra), ()  # the rebuild's arguments: none to check
    with recipe.lock:
        recipe.live += 1
    return handle


def _handle_of(tensor: torch.Tensor, outer: Any) -> _Handle | None:
    """What a consumer scope keeps for a saved ``tensor`` that has a live recipe (a registry entry or a tagged
    node), or None."""
    entry = _lookup(tensor)
    if entry is not None:
        return _handle(entry, tensor, outer)
    source = _tagged(tensor)
    return None if source is None else _node_handle(source)


def _rebuilt(handle: _Handle) -> torch.Tensor:
    recipe = handle.recipe
    if torch.is_grad_enabled() and not recipe.double_backward:
        raise ConvertError(
            f"memtrim: {recipe.owner} does not keep its output; a later layer gets it rebuilt, without a graph, so "
            "there is no second derivative through it. Expected a backward without create_graph=True; found "
            "create_graph=True (a gradient penalty or another double backward). To fix: leave this module out "
            "of memtrim.convert (module_filter), or use torch's modules here."
        )
    original = handle.tensor_ref()
    if original is not None:  # still alive: autograd's in-place check on the tensor itself
        check_saved_version(original, handle.version, f"{recipe.owner} (the tensor it rebuilds)")
    reads = _reads
    by_node = reads.__dict__.get("node", False)  # read by a node's rebuild: NOTE [ a node's saves read by a rebuild ]
    if by_node:
        reads.node = False  # (what this rebuild reads, it reads itself)
    try:
        with recipe.lock:
            t = recipe.cache
            if t is None:
                t = recipe.cache = recipe._rebuild(_sources(handle))
                recipe.done.clear()
            if not by_node:
                recipe.done.add(id(handle))
                if len(recipe.done) >= recipe.live:  # every live handle has had it: let it go
                    recipe.cache = None
                    recipe.done.clear()
    finally:
        if by_node:
            reads.node = True
    if handle.view is None:
        return t
    shape, stride, offset = handle.view
    return t.as_strided(shape, stride, t.storage_offset() + offset)


def _sources(handle: _Handle) -> list[torch.Tensor]:
    """The tensors to rebuild from, unpacked and version-checked as autograd checks its saved tensors."""
    versions = handle.versions
    if versions is None:
        return [_unpack(s) for s in handle.sources]
    sources: list[torch.Tensor] = list(handle.sources)  # type: ignore[arg-type]
    for source, version in zip(sources, versions):
        check_saved_version(source, version, handle.recipe.owner, source=True)
    return sources


class _Pending:
    """A save made inside a :class:`producing` scope, decided at the scope's exit."""

    __slots__ = ("tensor", "version", "inner")
    tensor: torch.Tensor | None  # None once decided
    version: int
    inner: _Handle | _Kept | None  # None until decided


def _unpack(packed: Any) -> torch.Tensor:
    """The unpack hook for everything the pack hooks here return."""
    if type(packed) is _Pending:
        packed = packed.inner
    if type(packed) is _Handle:
        return _rebuilt(packed)
    return _unkeep(packed)


def _outer_of(top: Any) -> Any:
    """The saved-tensor hooks below ours: ``top`` itself unless it is one of our own, then what that one chains to."""
    if top is None:
        return None
    return getattr(top[0], _MARK, top)


def _consumer_pack(outer: Any) -> Callable[[torch.Tensor], Any]:
    def pack(tensor: torch.Tensor) -> Any:
        if type(tensor) is torch.nn.Parameter:  # a consumer's weight: never a producer's output, kept as itself
            return _keep(tensor, outer, "memtrim's recompute hooks")
        handle = _handle_of(tensor, outer)
        if handle is not None:
            return handle
        return _keep(tensor, outer, "memtrim's recompute hooks")

    setattr(pack, _MARK, outer)
    return pack


_ALONE = torch.autograd.graph.saved_tensors_hooks(_consumer_pack(None), _unpack)  # a consumer scope's hooks with none
                                                                                  # outside: entered by every such scope
_local = threading.local()  # .scopes: per-thread stack of (id of the scope's module or None, the hooks it entered)


def _scopes() -> list[tuple[int | None, torch.autograd.graph.saved_tensors_hooks | None]]:
    stack = getattr(_local, "scopes", None)
    if stack is None:
        stack = _local.scopes = []
    return stack


def exit_if_on_top(hooks: Any) -> None:
    """Exit ``hooks`` (saved-tensor hooks entered by a scope whose end never ran) where they are the thread's
    innermost: exiting pops the innermost, whichever it is."""
    top = top_saved_tensors_hooks()
    if top is not None and top[0] is getattr(hooks, "pack_hook", None):
        hooks.__exit__(None, None, None)


def _close_interrupted(stack: list[tuple[int | None, Any]], key: int) -> None:
    """A scope of the module ``key`` still open when that module starts again: its forward was interrupted by a
    BaseException that is no Exception (KeyboardInterrupt: Ctrl-C in a notebook), after which nn.Module runs no
    ``always_call`` hook, so the scope's end never ran and its hooks would stay on this thread. A leaf consumer (a
    Linear) is never inside its own forward: close that scope and every scope opened after it."""
    for depth in range(len(stack) - 1, -1, -1):
        if stack[depth][0] == key:
            break
    else:
        return
    while len(stack) > depth:
        hooks = stack.pop()[1]
        if hooks is not None:
            exit_if_on_top(hooks)


def enter_consumer_scope(owner: object | None = None, checked: bool = False) -> None:
    """Start a consumer scope on this thread (a no-op inside another, under compile/torch.func, or with grad off).
    Every call must be matched by :func:`exit_consumer_scope` (with the same ``checked``). ``owner``: the module whose
    forward the scope spans, if any (a scope of it still open is one an interrupt left behind, and is closed first).
    ``checked``: the caller has just found :func:`plain_only` false (a per-call path)."""
    if not checked and plain_only():  # before anything else: torch.compile must trace none of this
        return
    stack = _scopes()
    key = None if owner is None else id(owner)
    if stack and key is not None:
        _close_interrupted(stack, key)
    top = top_saved_tensors_hooks()
    hooks = None
    # under saved-tensor hooks other than memtrim's a scope stands aside: inside a checkpointed region the region's
    # forward would keep a recipe for a tensor made outside it (its sources: several saves) where the recomputation,
    # which does not rerun that producer, saves the tensor itself, and torch requires both to save the same tensors;
    # a user's hooks may pack lossily (to bfloat16), and a rebuild from packed sources is then not the packed tensor;
    # under disable_saved_tensors_hooks entering any raises: what torch saves is kept as torch keeps it
    if (torch.is_grad_enabled() and (top is None or (not hasattr(top[0], _MARK) and memtrims(top[0])))
            and (HOOKS_ENABLED is None or HOOKS_ENABLED())):  # (hooks_allowed, inlined: a call at every scope)
        # with no hooks outside (the usual case) one shared pair serves every scope: it holds no state
        hooks = _ALONE if top is None else torch.autograd.graph.saved_tensors_hooks(_consumer_pack(_outer_of(top)),
                                                                                   _unpack)
        hooks.__enter__()
    stack.append((key, hooks))


def exit_consumer_scope(checked: bool = False) -> None:
    """End the consumer scope the matching :func:`enter_consumer_scope` started on this thread."""
    if not checked and plain_only():
        return
    stack = _scopes()
    hooks = stack.pop()[1] if stack else None
    if hooks is not None:
        hooks.__exit__(None, None, None)


class recipes_honoured(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: a consumer scope. Saved copies of marked tensors made inside keep their recipe instead.

    Example::

        h = fc1(x)
        a = act(h)
        mark_recomputable(a, act, h, owner="act")
        with recipes_honoured():
            y = fc2(a)        # fc2 keeps h (kept by act anyway), not a
    """

    def __init__(self, saver: Callable[[], str] | None = None) -> None:
        # (the hooks are chosen at entry: they chain to whatever is active then). ``saver``: who keeps the tensors
        # saved in the scope, to rebuild from (torch's checkpoint: the region's inputs), named where one of them is
        # changed in place before backward; the plain model may not keep them at all
        self.saver = saver

    def __enter__(self) -> recipes_honoured:  # type: ignore[override]
        enter_consumer_scope()
        self.before = getattr(_local, "saver", None)
        _local.saver = self.saver
        return self

    def __exit__(self, *args: object) -> None:
        _local.saver = self.before
        exit_consumer_scope()


class producing(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: a producer scope. Saves made inside are held provisionally; at exit each one becomes a recipe
    handle if its tensor was marked inside the scope (:func:`mark_recomputable`), else passes to the hooks outside.

    Use around an op whose own backward keeps its output, when the output is marked::

        with producing():
            z = torch.relu_(bn_out)               # relu_ saves z...
            mark_recomputable(z, rebuild, x, owner="bn1")   # ...which is kept as the recipe from then on
    """

    def __init__(self) -> None:
        self.pending: list[_Pending] = []
        self.outer: Any = None
        self.active = False

    def __enter__(self) -> producing:  # type: ignore[override]
        # under saved-tensor hooks other than memtrim's a producer scope stands aside like a consumer scope: inside a
        # checkpointed region its handles would pack a recipe's sources where the recomputation, whose marks differ,
        # saves the tensor itself; a user's lossy hooks would pack the sources, not the tensor
        self.active = torch.is_grad_enabled() and not plain_only() and saves_checked() and hooks_allowed()
        if not self.active:
            return self
        self.outer = outer = _outer_of(top_saved_tensors_hooks())
        pending = self.pending

        def pack(tensor: torch.Tensor) -> _Pending:
            held = _Pending()
            # the tensor itself until the exit decides (a tagged node's output is known by its grad_fn), then
            # dropped: what stays is decided then (a detached alias, a handle)
            held.tensor, held.version, held.inner = tensor, tensor._version, None
            pending.append(held)
            return held

        setattr(pack, _MARK, outer)
        self.pack_hook, self.unpack_hook = pack, _unpack
        super().__enter__()
        return self

    def __exit__(self, *args: object) -> None:
        if not self.active:
            return
        super().__exit__(*args)
        self.active = False
        outer = self.outer
        for held in self.pending:
            tensor = held.tensor
            assert tensor is not None
            if tensor._version != held.version:  # changed in place inside the scope: unpacking raises, as autograd
                kept = held.inner = _keep(tensor, None, "memtrim's recompute hooks")
                kept.version = held.version
            else:
                held.inner = _handle_of(tensor, outer) or _keep(tensor, outer, "memtrim's recompute hooks")
            held.tensor = None
        self.pending.clear()

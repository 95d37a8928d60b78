"""Bytes an autograd graph keeps, read off the graph itself: an independent check of the tracker, and a way to
measure code the tracker cannot hook (``torch.compile``'d graphs keep their tensors in one compiled node)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..errors import InvalidInputError

__all__ = ["autograd_graph_bytes"]


def autograd_graph_bytes(output: torch.Tensor, *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages saved by the autograd graph behind ``output``.

    Walks every node reachable from ``output.grad_fn`` and reads its saved tensors (``_saved_*`` attributes of
    built-in nodes, ``saved_tensors`` of custom Functions, including compiled graphs), deduplicated by storage.

    Args:
        output: a tensor with a ``grad_fn`` (e.g. a model's output or loss, before backward).
        exclude: tensors whose storages are not counted (typically the parameters and the batch).

    Raises:
        InvalidInputError: ``output`` has no autograd graph.

    Note: reading a saved tensor unpacks it; under saved-tensor hooks that recompute (checkpointing, memtrim's
    BatchNorm+ReLU recipes) the recomputed tensors are counted, so measure such models with the tracker.
    """
    if not isinstance(output, torch.Tensor) or output.grad_fn is None:
        raise InvalidInputError("memtrim.autograd_graph_bytes: output must be a tensor with a grad_fn "
                                "(computed with autograd, before backward).")
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack: list[torch.autograd.graph.Node | None] = [output.grad_fn]
    keep = []  # node wrappers stay alive during the walk, so their ids stay unique
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        keep.append(node)
        for tensor in _saved(node):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in skip:
                storages[storage.data_ptr()] = storage.nbytes()
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sum(storages.values())


def _saved(node: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    if hasattr(node, "saved_tensors"):
        try:
            found.extend(t for t in node.saved_tensors if isinstance(t, torch.Tensor))
        except RuntimeError:  # freed by an earlier backward
            pass
    for name in dir(node):
        if not name.startswith("_saved_"):
            continue
        try:
            value = getattr(node, name)
        except RuntimeError:
            continue
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(t for t in value if isinstance(t, torch.Tensor))
    return found

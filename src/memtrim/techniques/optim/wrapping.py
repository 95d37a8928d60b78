"""The view memtrim's optimizer wrappers give of the optimizer they wrap."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ...errors import InvalidInputError, MemtrimError


class WrappedOptimizerView(torch.optim.Optimizer):
    """Base of memtrim's optimizer wrappers (``OptimizerInBackward``, ``CPUOffloadOptimizer``): ``param_groups``
    and ``defaults`` are those of ``self.optimizer``, read and set through to it, so LR schedulers and code that
    reads hyperparameters see one optimizer. ``Optimizer.__init__`` is not called; a subclass sets
    ``self.optimizer`` first."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (read and set through to it)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]  # read-only: the wrapped optimizer's own
        """The wrapped optimizer's ``defaults``."""
        return self.optimizer.defaults

    def __getstate__(self) -> Any:
        name = type(self).__name__
        raise MemtrimError(
            f"{name} cannot be pickled or copied (copy.deepcopy): its hooks belong to the parameters it was built "
            f"with, so a copy would not train its own. Save opt.state_dict(), build a new {name} around the copied "
            "model's parameters and load the state into it."
        )


def needs_closure(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether ``optimizer_class.step`` takes a closure it cannot do without (``LBFGS``: it re-evaluates the loss)."""
    closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def sharded(param: Any) -> bool:
    """Whether ``param`` is one of FSDP2's sharded parameters (its data a DTensor; not imported to ask)."""
    return isinstance(param, torch.Tensor) and type(param.data).__name__ == "DTensor"


def refuse_sharded(params: Any, api: str) -> None:
    """Refuse FSDP2's sharded parameters (DTensors) where an optimizer's own arithmetic would mix them with plain
    tensors (found by an adversarial pass: torch's bare "got mixed torch.Tensor and DTensor" at the first step)."""
    for p in params:
        if sharded(p):
            raise InvalidInputError(
                f"{api}: the parameters are DTensors (FSDP2's fully_shard sharded them, shape {tuple(p.shape)}), which "
                "it does not support: its state and update are plain tensors. Expected unsharded parameters; to fix: "
                "use torch.optim.AdamW under FSDP2, or DDP with this optimizer."
            )

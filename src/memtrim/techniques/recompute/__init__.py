"""Recompute instead of keep: recipes honoured at consumer call sites, a gated MLP's product rebuilt, a sum of
embedding lookups rebuilt, pointwise modules checkpointed, a ReLU shared with fused BatchNorm+ReLU call sites.
See NOTE [ recipes at consumer call sites ] in _core.py."""

from ...errors import ConvertError
from ._core import (
    Recipe,
    is_recomputable,
    mark_recomputable,
    producing,
    recipe_of,
    recipes_honoured,
)
from ._sites import (
    LIMITS,
    Handle,
    PassThroughReLU,
    checkpoint_call,
    keep_recipes_in,
    recompute_gated_mlp,
    recompute_op_output,
    recompute_output,
    recompute_sum,
)

__all__ = [
    "LIMITS", "ConvertError", "Handle", "PassThroughReLU", "Recipe", "checkpoint_call", "is_recomputable",
    "keep_recipes_in", "mark_recomputable", "producing", "recipe_of", "recipes_honoured", "recompute_gated_mlp",
    "recompute_op_output", "recompute_output", "recompute_sum",
]

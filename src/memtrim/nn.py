"""Module forms of :mod:`memtrim.functional`, drop-in for ``torch.nn``'s activations, and fused BatchNorm +
activation modules."""

from .techniques.activations.bn_relu import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d
from .techniques.activations.modules import *  # noqa: F403
from .techniques.activations.modules import __all__ as _activations
from .techniques.activations.norm_act import *  # noqa: F403
from .techniques.activations.norm_act import __all__ as _norm_act
from .techniques.activations.transformer import *  # noqa: F403
from .techniques.activations.transformer import __all__ as _transformer

__all__ = [*_activations, *_norm_act, *_transformer, "BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d"]

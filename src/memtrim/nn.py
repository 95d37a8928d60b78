"""Module forms of :mod:`memtrim.functional`, drop-in for ``torch.nn``'s activations and max pool, and fused
BatchNorm + activation modules."""

from .techniques.activations import ActLinear
from .techniques.activations.modules import *  # noqa: F403
from .techniques.activations.modules import __all__ as _activations
from .techniques.norms.bn_relu import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d
from .techniques.norms.keep_output import LayerNorm, RMSNorm
from .techniques.norms.norm_act import *  # noqa: F403
from .techniques.norms.norm_act import __all__ as _norm_act
from .techniques.pooling import MaxPool2d

__all__ = [
    *_activations, *_norm_act, "ActLinear", "LayerNorm", "RMSNorm", "BatchNormReLU1d", "BatchNormReLU2d",
    "BatchNormReLU3d", "MaxPool2d",
]

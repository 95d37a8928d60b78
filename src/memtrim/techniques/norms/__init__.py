"""Norms that keep less for backward than torch's: BatchNorm + activation keeping only the activation's output
(``norm_act.py``), BatchNorm + ReLU keeping only the BatchNorm's input (``bn_relu.py``), and LayerNorm / RMSNorm
keeping their output (``keep_output.py``); the kernels they share in ``_kernels.py``. Re-exported by ``memtrim.nn``.
"""

from .bn_relu import BatchNormReLU1d, BatchNormReLU2d, BatchNormReLU3d
from .keep_output import LayerNorm, NormKeepOutput, RMSNorm
from .norm_act import BatchNormAct1d, BatchNormAct2d, BatchNormAct3d

__all__ = [
    "BatchNormAct1d", "BatchNormAct2d", "BatchNormAct3d", "BatchNormReLU1d", "BatchNormReLU2d", "BatchNormReLU3d",
    "LayerNorm", "NormKeepOutput", "RMSNorm",
]

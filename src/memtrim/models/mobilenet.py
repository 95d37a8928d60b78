"""A MobileNetV3-small-shaped conv net (depthwise inverted residuals, BatchNorm, Hardswish, a wide classifier).

Why it lives here: it is the activation-heavy workload on which :class:`memtrim.OptimizerInBackward`'s
``peak="never_higher"`` is measured (``benchmarks/optimizer_in_backward_peak.py`` and its memory test), so the
benchmark and the test train one network. torchvision's own MobileNetV3 does not load beside the CPU torch here.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["InvertedResidual", "MobileNetLike", "conv_bn"]

# (in channels, expanded channels, out channels, stride) of each inverted residual block
_BLOCKS = (
    (16, 16, 16, 2), (16, 72, 24, 2), (24, 88, 24, 1), (24, 96, 40, 2), (40, 240, 40, 1), (40, 120, 48, 1),
    (48, 288, 96, 2), (96, 576, 96, 1),
)


def conv_bn(
    in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    """Conv2d (no bias, "same" padding) -> BatchNorm2d, then Hardswish when ``act``."""
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
    ]
    if act:
        layers.append(nn.Hardswish())
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expand, depthwise 3x3 (with the stride), 1x1 project; a residual sum where the shape is kept."""

    def __init__(self, in_channels: int, expanded: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.residual = stride == 1 and in_channels == out_channels
        self.block = nn.Sequential(
            conv_bn(in_channels, expanded, 1),
            conv_bn(expanded, expanded, 3, stride, groups=expanded),
            conv_bn(expanded, out_channels, 1, act=False),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x + block(x)`` where the shape is kept, else ``block(x)``."""
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetLike(nn.Module):
    """MobileNetV3-small's shape on 3-channel images: a stride-2 stem, eight inverted residual blocks, a 1x1 conv to
    576 channels, global average pooling and a 576-1024-``num_classes`` classifier (873,810 parameters for 10
    classes).

    Example::

        model = MobileNetLike()
        logits = model(torch.randn(8, 3, 64, 64))   # (8, 10)
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = conv_bn(3, 16, 3, 2)
        self.blocks = nn.Sequential(*[InvertedResidual(*config) for config in _BLOCKS])
        self.last = conv_bn(96, 576, 1)
        self.head = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a batch of images ``(N, 3, H, W)``."""
        return self.head(self.last(self.blocks(self.stem(x))).mean((2, 3)))

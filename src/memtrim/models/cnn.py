"""A small ResNet-style CNN (conv -> BatchNorm -> ReLU basic blocks with identity/projection shortcuts) and a plain
conv -> BatchNorm -> LeakyReLU stack."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["BasicBlock", "ConvBNActCNN", "ResNetCNN"]


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a shortcut, then ReLU (He et al. 2016)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu2 = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``relu2(bn2(conv2(relu1(bn1(conv1(x))))) + shortcut(x))``."""
        out = self.relu1(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu2(out + self.shortcut(x))


class ResNetCNN(nn.Module):
    """Stem conv-BN-ReLU, one stage of basic blocks per width (stride 2 after the first), pool, linear.

    Defaults suit 1x28x28 images (Fashion-MNIST): widths (16, 32, 64), one block per stage.
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks_per_stage: int = 1,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        layers: list[nn.Module] = []
        channels = widths[0]
        for i, width in enumerate(widths):
            for j in range(blocks_per_stage):
                layers.append(BasicBlock(channels, width, stride=2 if i > 0 and j == 0 else 1))
                channels = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``(N, num_classes)`` for images ``(N, in_channels, H, W)``."""
        x = self.stages(self.stem(x))
        return self.head(torch.flatten(self.pool(x), 1))


class ConvBNActCNN(nn.Sequential):
    """``depth`` x (conv3x3 -> BatchNorm -> LeakyReLU) at constant ``width``, then (unless ``num_classes`` is None)
    pool, flatten, linear: the plain conv + BN + activation stack that fused norm + activation targets."""

    def __init__(self, in_channels: int = 1, width: int = 16, depth: int = 4, num_classes: int | None = 10,
                 negative_slope: float = 0.1) -> None:
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Conv2d(in_channels if i == 0 else width, width, 3, padding=1), nn.BatchNorm2d(width),
                       nn.LeakyReLU(negative_slope)]
        if num_classes is not None:
            layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes)]
        super().__init__(*layers)

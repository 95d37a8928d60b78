"""torchvision's ResNet written out (``BasicBlock``, ``Bottleneck``, ``ResNet`` as torchvision builds them: the same
module names, so the same state_dict keys, and the same initialisation). Its blocks call one in-place ``self.relu``
module two or three times, the pattern ``memtrim.convert`` handles per call site; torchvision's wheel does not import
beside the CPU build of torch on these machines, so the tests and benchmarks use this."""

from __future__ import annotations

from typing import Union

import torch
from torch import nn

__all__ = ["TorchvisionBasicBlock", "TorchvisionBottleneck", "TorchvisionResNet"]


def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """torchvision's 3x3 convolution without bias."""
    return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    """torchvision's 1x1 convolution without bias."""
    return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)


class TorchvisionBasicBlock(nn.Module):
    """torchvision's BasicBlock: one ``self.relu`` (in place) called twice."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """conv-bn-relu, conv-bn, plus the shortcut, relu (the one ``self.relu`` twice)."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class TorchvisionBottleneck(nn.Module):
    """torchvision's Bottleneck (stride on the 3x3): one ``self.relu`` (in place) called three times."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """1x1, 3x3, 1x1 convolutions with BatchNorm, plus the shortcut (the one ``self.relu`` three times)."""
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


Block = Union[type["TorchvisionBasicBlock"], type["TorchvisionBottleneck"]]


class TorchvisionResNet(nn.Module):
    """torchvision's ResNet (same module names, so the same state_dict keys, and the same initialisation).

    ``planes`` are the four stages' widths before the block's expansion (torchvision: 64, 128, 256, 512) and ``stem``
    the first convolution's channels (torchvision: 64); smaller values give a narrow model of the same structure.
    """

    def __init__(self, block: Block, layers: list[int], num_classes: int = 1000,
                 planes: tuple[int, int, int, int] = (64, 128, 256, 512), stem: int = 64):
        super().__init__()
        self.inplanes = stem
        self.conv1 = nn.Conv2d(3, stem, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, planes[0], layers[0])
        self.layer2 = self._make_layer(block, planes[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, planes[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, planes[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(planes[3] * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _make_layer(self, block: Block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Stem, four stages, pooled classifier."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---------------------------------------------------------------------------------------------- the models

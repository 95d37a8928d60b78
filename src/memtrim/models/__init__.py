"""Reference workloads: the seed MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN, a MobileNetV3-small-shaped conv
net, a small GPT-style decoder, the seed MLP with coupling hidden layers, the seed article's in-place SiLUs
(:mod:`memtrim.models.seed_silu`), and torchvision's ResNet written out (:mod:`memtrim.models.torchvision_resnet`)."""

from .cnn import BasicBlock, ConvBNActCNN, ResNetCNN
from .coupling_mlp import CouplingMLP
from .gpt import GPTConfig, SmallGPT
from .mlp import SeedMLP
from .mobilenet import InvertedResidual, MobileNetLike

__all__ = [
    "BasicBlock", "ConvBNActCNN", "CouplingMLP", "GPTConfig", "InvertedResidual", "MobileNetLike", "ResNetCNN",
    "SeedMLP", "SmallGPT",
]

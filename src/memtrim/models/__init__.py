"""Reference workloads: the seed MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN and a small GPT-style decoder."""

from .cnn import BasicBlock, ConvBNActCNN, ResNetCNN
from .gpt import GPTConfig, SmallGPT
from .mlp import SeedMLP

__all__ = ["BasicBlock", "ConvBNActCNN", "GPTConfig", "ResNetCNN", "SeedMLP", "SmallGPT"]

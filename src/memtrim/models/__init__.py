"""Reference workloads: the seed MLP, a ResNet-style CNN and a small GPT-style decoder."""

from .cnn import BasicBlock, ResNetCNN
from .gpt import GPTConfig, SmallGPT
from .mlp import SeedMLP

__all__ = ["BasicBlock", "GPTConfig", "ResNetCNN", "SeedMLP", "SmallGPT"]

"""Reference workloads: the seed MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN, a small GPT-style decoder, and
the seed article's in-place SiLUs (:mod:`memtrim.models.seed_silu`)."""

from .cnn import BasicBlock, ConvBNActCNN, ResNetCNN
from .gpt import GPTConfig, SmallGPT
from .mlp import SeedMLP

__all__ = ["BasicBlock", "ConvBNActCNN", "GPTConfig", "ResNetCNN", "SeedMLP", "SmallGPT"]

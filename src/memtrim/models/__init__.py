"""Reference workloads: the seed MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN, a small GPT-style decoder, the
seed MLP with coupling hidden layers, and the seed article's in-place SiLUs (:mod:`memtrim.models.seed_silu`)."""

from .cnn import BasicBlock, ConvBNActCNN, ResNetCNN
from .coupling_mlp import CouplingMLP
from .gpt import GPTConfig, SmallGPT
from .mlp import SeedMLP

__all__ = ["BasicBlock", "ConvBNActCNN", "CouplingMLP", "GPTConfig", "ResNetCNN", "SeedMLP", "SmallGPT"]

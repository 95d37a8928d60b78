"""The reference workloads: shapes, the in-place flag, and that they train."""

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.models import GPTConfig, ResNetCNN, SeedMLP, SmallGPT


def test_seed_mlp_shapes_and_inplace_flag():
    model = SeedMLP(inplace=True)
    assert [m.in_features for m in (model.fc1, model.fc2, model.fc3, model.fc4)] == [784, 256, 128, 64]
    assert model.fc4.out_features == 10
    assert all(m.inplace for m in (model.act1, model.act2, model.act3))
    out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, 10)
    assert torch.allclose(out.exp().sum(1), torch.ones(3))


def test_seed_mlp_inplace_computes_the_same():
    torch.manual_seed(0)
    a = SeedMLP()
    b = SeedMLP(inplace=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 784)
    assert torch.equal(a(x), b(x))


def test_resnet_cnn():
    model = ResNetCNN()
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    wide = ResNetCNN(in_channels=3, num_classes=5, widths=(8, 16), blocks_per_stage=2)
    assert wide(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_small_gpt_is_causal():
    torch.manual_seed(0)
    model = SmallGPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=50)).eval()
    idx = torch.randint(0, 50, (2, 16))
    out = model(idx)
    assert out.shape == (2, 16, 50)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50
    assert torch.equal(model(changed)[:, :-1], out[:, :-1])  # the future does not leak into the past


def test_small_gpt_bad_config():
    with pytest.raises(memtrim.InvalidInputError, match="divisible"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(memtrim.InvalidInputError, match="seq_len"):
        SmallGPT(seq_len=8)(torch.zeros(1, 9, dtype=torch.long))


def test_models_learn():
    torch.manual_seed(0)
    gpt = SmallGPT(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=16)
    optimizer = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    idx = torch.arange(16).repeat(8, 1)  # a fixed sequence: next token = current + 1
    losses = []
    for _ in range(30):
        logits = gpt(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]

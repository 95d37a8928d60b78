"""The reference workloads: shapes, the in-place flag, and that they train."""

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.models import BasicBlock, CouplingMLP, GPTConfig, MobileNetLike, ResNetCNN, SeedMLP, SmallGPT


def test_seed_mlp_computes_the_seed_network():
    model = SeedMLP(inplace=True)
    assert [m.in_features for m in (model.fc1, model.fc2, model.fc3, model.fc4)] == [784, 256, 128, 64]
    assert model.fc4.out_features == 10
    assert all(m.inplace for m in (model.act1, model.act2, model.act3))
    x = torch.randn(3, 1, 28, 28)
    h = x.reshape(3, 784)
    for fc in (model.fc1, model.fc2, model.fc3):
        h = F.relu(F.linear(h, fc.weight, fc.bias))
    expected = F.log_softmax(F.linear(h, model.fc4.weight, model.fc4.bias), dim=1)
    assert torch.equal(model(x), expected)  # images or flat rows, the same arithmetic


def test_seed_mlp_inplace_computes_the_same():
    torch.manual_seed(0)
    a = SeedMLP()
    b = SeedMLP(inplace=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 784)
    assert torch.equal(a(x), b(x))


def test_basic_block_is_conv_bn_relu_with_a_projection_shortcut():
    block = BasicBlock(4, 8, stride=2).eval()  # eval: BatchNorm uses its (initial) running statistics
    x = torch.randn(2, 4, 9, 9)

    def bn(m, h):
        return F.batch_norm(h, m.running_mean, m.running_var, m.weight, m.bias, False, 0.0, m.eps)

    h = F.relu(bn(block.bn1, F.conv2d(x, block.conv1.weight, stride=2, padding=1)))
    h = bn(block.bn2, F.conv2d(h, block.conv2.weight, padding=1))
    shortcut = bn(block.shortcut[1], F.conv2d(x, block.shortcut[0].weight, stride=2))
    assert torch.equal(block(x), F.relu(h + shortcut))
    assert isinstance(BasicBlock(8, 8).shortcut, torch.nn.Identity)


def test_resnet_cnn_stages():
    model = ResNetCNN()
    strides = [b.conv1.stride[0] for b in model.stages]
    assert strides == [1, 2, 2] and [b.conv2.out_channels for b in model.stages] == [16, 32, 64]
    # stem 144 + 32; blocks 4,672 + 14,528 + 57,728 (with projections); head 650
    assert sum(p.numel() for p in model.parameters()) == 77_754
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
    wide = ResNetCNN(in_channels=3, num_classes=5, widths=(8, 16), blocks_per_stage=2)
    assert [b.conv1.stride[0] for b in wide.stages] == [1, 1, 2, 1]
    assert wide(torch.randn(2, 3, 32, 32)).shape == (2, 5)


def test_mobilenet_like_blocks():
    model = MobileNetLike()
    # the figure benchmarks/optimizer_in_backward_peak.py's results were measured with
    assert sum(p.numel() for p in model.parameters()) == 873_810
    assert [b.residual for b in model.blocks] == [False, False, True, False, True, False, False, True]
    assert [b.block[1][0].stride[0] for b in model.blocks] == [2, 2, 1, 2, 1, 1, 2, 1]
    block = model.blocks[2].eval()
    x = torch.randn(2, 24, 5, 5)
    assert torch.equal(block(x), x + block.block(x))


def test_coupling_mlp_plain_and_reversible_are_the_same_network():
    plain, rev = CouplingMLP(4), CouplingMLP(4, reversible=True)
    assert isinstance(rev.hidden, memtrim.ReversibleSequential) and rev.hidden.check_drift == 1e-3
    for a, b in zip(plain.state_dict().values(), rev.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # seed 0 for both
    x = torch.randn(5, 784)
    assert torch.equal(plain(x), rev(x))  # the reversible forward is the same computation
    state = torch.get_rng_state()
    CouplingMLP(2, seed=None)
    assert not torch.equal(torch.get_rng_state(), state)  # seed=None draws from the global generator as it is


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

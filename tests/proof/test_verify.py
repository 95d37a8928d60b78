"""The equivalence harness against plain PyTorch training."""

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.models import SeedMLP

from ..helpers import adam, identity, seed_mlp_batches


def batches(n=5):
    return seed_mlp_batches(n=n, batch=16)


def to_inplace(model, optimizer):
    for module in model.modules():
        if isinstance(module, torch.nn.ReLU):
            module.inplace = True
    return model, optimizer


def test_identity_is_bitwise():
    report = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, identity)
    assert report.ok and report.bitwise and report.steps == 5
    assert report.first_divergence is None
    assert report.baseline_losses == report.transformed_losses
    report.assert_ok()
    assert str(report) == "equal: bitwise over 5 steps"
    assert str(memtrim.verify(SeedMLP, adam, batches()[:1], F.nll_loss, identity)) == "equal: bitwise over 1 step"


def test_inplace_relu_is_bitwise():
    assert memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, to_inplace, steps=3).bitwise


def test_changed_learning_rate_diverges_at_step_zero_params():
    def faster(model, optimizer):
        return model, torch.optim.Adam(model.parameters(), lr=2e-3)

    report = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, faster)
    assert not report.ok and not report.bitwise
    d = report.first_divergence
    assert d.step == 0 and d.tensor.startswith("param:") and d.max_abs_error > 0
    assert report.steps == 1
    with pytest.raises(memtrim.VerifyError, match="step 0"):
        report.assert_ok()


def test_tiny_perturbation_within_tolerance():
    class Noisy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x * (1 + 1e-7))

    def wrap(model, optimizer):
        wrapped = Noisy(model)
        return wrapped, optimizer

    exact = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, wrap)
    assert not exact.ok  # names differ ("inner.fc1.weight") but shapes and order match
    # the loss of step 0 rounds to the same float32; fc1's gradient, the first tensor compared after it, does not
    assert exact.first_divergence.tensor == "grad:fc1.weight" and exact.first_divergence.step == 0
    # the tolerance is applied exactly: the largest error of 2 steps passes at atol equal to it, fails just below
    measured = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, wrap, steps=2, atol=1.0)
    assert measured.ok and not measured.bitwise and measured.first_difference == exact.first_divergence
    edge = measured.max_abs_error
    assert memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, wrap, steps=2, atol=edge).ok
    assert not memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, wrap, steps=2, atol=edge * (1 - 1e-9)).ok


def test_dropout_replayed_identically():
    def make():
        return torch.nn.Sequential(torch.nn.Linear(784, 64), torch.nn.Dropout(0.5), torch.nn.Linear(64, 10),
                                   torch.nn.LogSoftmax(dim=1))

    assert memtrim.verify(make, adam, batches(), F.nll_loss, identity).bitwise


def test_batchnorm_buffers_compared():
    def make():
        return torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10))

    def no_stats(model, optimizer):
        model[1].momentum = 0.5
        return model, optimizer

    report = memtrim.verify(make, adam, batches(), F.cross_entropy, no_stats)
    assert not report.ok and report.first_divergence.tensor == "buffer:1.running_mean"


def test_bad_input():
    with pytest.raises(memtrim.InvalidInputError, match="callable"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, None)
    with pytest.raises(memtrim.InvalidInputError, match="no batches"):
        memtrim.verify(SeedMLP, adam, [], F.nll_loss, identity)
    with pytest.raises(memtrim.InvalidInputError, match="only 5 batches"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, identity, steps=9)
    with pytest.raises(memtrim.InvalidInputError, match="Optimizer"):
        memtrim.verify(SeedMLP, lambda m: None, batches(), F.nll_loss, identity)
    with pytest.raises(memtrim.InvalidInputError, match="must return \\(model, optimizer\\)"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, lambda m, o: m)
    with pytest.raises(memtrim.InvalidInputError, match=r"got ConversionReport\. memtrim.convert returns \(model, "
                                                        r"report\), not \(model, optimizer\)"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, lambda m, o: memtrim.convert(m))
    with pytest.raises(memtrim.InvalidInputError, match="neither by name nor by position"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, lambda m, o: (torch.nn.Linear(2, 2), o))

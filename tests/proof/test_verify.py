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


class _Bag(torch.nn.Module):
    """A sparse embedding (its gradient a sparse COO tensor) and a dense head."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(20, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.embedding(ids).mean(1))


def _token_batches(n=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 20, (4, 5), generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_sparse_gradients_are_compared():
    # the comparison of an nn.Embedding(sparse=True) gradient raised torch's "unsupported memory format option
    # Contiguous" from inside verify
    report = memtrim.verify(_Bag, _sgd, _token_batches(), F.cross_entropy, identity)
    assert report.ok and report.bitwise and report.steps == 3 and report.grads_compared

    def doubled_embedding_gradient(model, optimizer):
        model.embedding.weight.register_hook(lambda grad: grad * 2)
        return model, optimizer

    report = memtrim.verify(_Bag, _sgd, _token_batches(), F.cross_entropy, doubled_embedding_gradient)
    assert not report.ok and report.first_divergence.step == 0
    assert report.first_divergence.tensor == "grad:embedding.weight"
    torch.manual_seed(0)  # plain torch: the baseline's gradient, which the doubled one exceeds by itself
    model = _Bag()
    (ids, targets), = _token_batches(1)
    F.cross_entropy(model(ids), targets).backward()
    assert report.first_divergence.max_abs_error == float(model.embedding.weight.grad.to_dense().abs().max())


def _lbfgs(model, max_iter=4):
    return torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=max_iter)


def test_a_closure_optimizer_trains_as_plain_pytorch():
    # LBFGS's step needs a closure; verify called step() and torch's TypeError came out
    report = memtrim.verify(SeedMLP, _lbfgs, batches(3), F.nll_loss, identity)
    assert report.ok and report.bitwise and report.steps == 3
    torch.manual_seed(0)  # the same training in plain PyTorch: verify seeds 0 for the model, 1 + step for each step
    model = SeedMLP()
    optimizer = _lbfgs(model)
    losses = []
    for step, (x, y) in enumerate(batches(3)):
        optimizer.zero_grad()
        torch.manual_seed(1 + step)
        loss = F.nll_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))

        def closure(x=x, y=y):
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            return loss

        optimizer.step(closure)
    assert report.baseline_losses == losses == report.transformed_losses
    assert len(set(losses)) == 3  # it trained

    report = memtrim.verify(SeedMLP, _lbfgs, batches(3), F.nll_loss, lambda m, o: (m, _lbfgs(m, max_iter=2)))
    assert not report.ok and report.first_divergence.step == 0
    assert report.first_divergence.tensor.startswith("param:")

"""Small shared pieces for the tests."""

import torch
import torch.nn.functional as F

from memtrim.models import SeedMLP


def mlp_step_setup(batch: int = 64, inplace: bool = False):
    torch.manual_seed(0)
    model = SeedMLP(inplace=inplace)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 784)
    y = torch.randint(0, 10, (batch,))
    return model, optimizer, x, y


def seed_mlp_batches(n: int = 10, batch: int = 16, seed: int = 1):
    """``n`` (inputs, targets) batches for the seed MLP from their own generator (the global one untouched)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def adam(model):
    """``make_optimizer`` for memtrim.verify: Adam at lr 1e-3."""
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def identity(model, optimizer):
    """The ``transform`` that changes nothing."""
    return model, optimizer


def train_step(model, optimizer, x, y, loss_fn=F.nll_loss):
    loss = loss_fn(model(x), y)
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_bytes(fn, *args, model=None) -> int:
    """Activation bytes autograd keeps after ``fn(*args)``, from the tracker (``model`` labels its inputs)."""
    import memtrim

    with memtrim.track(model) as tracker:
        out = fn(*args)
        held = tracker.live_by_category()["activations"]
    del out
    return held

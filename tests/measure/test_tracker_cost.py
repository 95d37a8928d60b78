"""The tracker's cost grows with the work it watches, not with ops x parameters (issue 10, item 14).

Timings are noisy on a shared machine, so the cost is counted instead: the Python function calls made while the
tracked loop runs (entering and leaving the tracker, which visit every parameter once, are not in the count).
"""

import sys

import pytest
import torch

import memtrim


def _calls_in_loop(n_layers: int, iterations: int = 60, grad: bool = False) -> int:
    torch.manual_seed(0)
    layers = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(n_layers)])
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    layers(torch.randn(2, 8)).sum().backward()
    optimizer.step()  # gradients exist: a rescan would visit them too
    x = torch.randn(2, 8)
    count = 0

    def profiler(frame, event, arg):
        nonlocal count
        if event == "call":
            count += 1

    with memtrim.track(layers, optimizer), torch.set_grad_enabled(grad):
        sys.setprofile(profiler)
        try:
            h = x
            for i in range(iterations):
                h = layers[i % 4](h)  # a module call: phase "forward"
                h = h.detach() * 0.5  # an op outside any module: phase "other"
        finally:
            sys.setprofile(None)
    return count


@pytest.mark.parametrize("grad", [False, True])
def test_phase_switches_do_not_rescan_parameters(grad):
    small, large = _calls_in_loop(4, grad=grad), _calls_in_loop(400, grad=grad)
    assert large <= 1.1 * small, f"the loop made {large} calls with 400 layers vs {small} with 4"


def test_gradients_and_optimizer_state_still_categorised_without_rescans():
    """What the rescans were for: a gradient assigned by hand and optimizer state loaded from a state dict are
    still reported as such, while a loop with phase switches runs in between."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    fresh = torch.optim.Adam(model.parameters())
    optimizer.zero_grad(set_to_none=True)
    with memtrim.track(model, fresh) as tracker:
        model.weight.grad = torch.ones_like(model.weight)
        fresh.load_state_dict(state)
        with torch.no_grad():
            for _ in range(3):
                model(torch.randn(4, 16)).mul(2)
        fresh.step()
    final = tracker.report().final_by_category
    assert final["gradients"] == model.weight.nbytes
    assert final["optimizer_state"] == 2 * (model.weight.nbytes + model.bias.nbytes) + 2 * 4


def test_parameters_saved_before_any_op_reads_them():
    """No model given: a trainable leaf is a parameter even when autograd saves it (LayerNorm saves its weight)
    before any op has read it; only the norm's input and the Linear's input are activations, plus the stats."""
    torch.manual_seed(0)
    ln, fc = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)
    x = torch.randn(8, 16, 64, requires_grad=True).clone()
    with memtrim.track() as tracker:
        out = fc(ln(x))
        live = tracker.live_by_category()
    assert live["activations"] == 2 * x.nbytes + 2 * 8 * 16 * 4
    assert live["parameters"] == sum(p.nbytes for p in (*ln.parameters(), *fc.parameters()))
    del out


class _Shared(torch.nn.Module):
    """A module registered under two names, a parameter tied between two modules, a buffer shared likewise."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.inner = torch.nn.Sequential(torch.nn.Linear(4, 4), self.first)  # `first` again, as inner.1
        self.tied = torch.nn.Linear(4, 4, bias=False)
        self.tied.weight = self.inner[0].weight
        self.norm = torch.nn.BatchNorm1d(4)
        self.again = self.norm

    def forward(self, x):
        return self.again(self.tied(self.inner(x)))


class _RenamedParameters(_Shared):
    """Overrides named_parameters, as FSDP does to clean its names: the tracker must ask it, not walk by hand."""

    def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield "renamed." + name, param


@pytest.mark.parametrize("cls", [_Shared, _RenamedParameters])
def test_entry_walk_names_as_named_modules_and_named_parameters(cls):
    """The tracker walks the model by hand at entry (issue 10, item 14: cheaper than named_modules); what it
    finds must be what named_modules / named_parameters(remove_duplicate=False) say: a module registered twice
    has its first name, a tied parameter belongs to the first module it is registered in, a shared buffer and
    parameter are counted once."""
    torch.manual_seed(0)
    model = cls()
    model(torch.randn(3, 4)).sum().backward()
    root = type(model).__name__
    first_module_name = {}
    for name, module in model.named_modules():
        first_module_name.setdefault(id(module), name or root)
    first_owner = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        first_owner.setdefault(id(param), name.rpartition(".")[0] or root)
    with memtrim.track(model) as tracker:
        model(torch.randn(3, 4)).sum().backward()
    assert tracker._names == first_module_name
    assert tracker._param_module == first_owner
    modules_in_backward = {e.module for e in tracker.report().timeline if e.phase == "backward" and e.module}
    assert "inner.1" not in modules_in_backward and "first" in modules_in_backward
    start = tracker.report().timeline[0].by_category
    assert start["parameters"] == sum(p.nbytes for p in model.parameters())
    assert start["buffers"] == sum(b.nbytes for b in model.buffers())

"""MemoryReport's analytics of the forward, in bytes: what it leaves for backward and its transient peak."""

import pytest
import torch
from torch import nn

import memtrim


def linear_relu_step(inplace):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU(inplace=inplace))
    x = torch.randn(16, 4)
    with memtrim.track(model) as tracker:
        model(x).sum().backward()
    return tracker.report()


@pytest.mark.parametrize("inplace", [False, True])
def test_activations_at_backward_start_is_what_relu_keeps(inplace):
    # ReLU keeps its 16x8 float32 output for backward, in place or not; Linear keeps its input (an input) and
    # its weight (a parameter)
    assert linear_relu_step(inplace).activations_at_backward_start == 16 * 8 * 4


def test_forward_transient_peak_counts_the_out_of_place_copy():
    out = 16 * 8 * 4
    scalars = 4 + 4  # the loss and backward's seed gradient (ones_like), both born before the first backward op
    assert linear_relu_step(inplace=False).forward_transient_peak == 2 * out  # mm's output and relu's, at once
    assert linear_relu_step(inplace=True).forward_transient_peak == out + scalars


def test_a_span_without_backward():
    with memtrim.track() as tracker:
        pass
    report = tracker.report()
    assert report.activations_at_backward_start == 0 and report.forward_transient_peak == 0


class _Fat(torch.nn.Module):  # its forward makes a 1 MiB temporary: the step's peak, also when recomputed
    def forward(self, x):
        return x * x.new_ones(1 << 18, 1, 1).sum(0)


class _Region(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fat, self.tail = _Fat(), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.tail(self.fat(x))


class _Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.pre, self.region, self.reentrant = torch.nn.Linear(4, 4), _Region(), reentrant

    def forward(self, x):
        if self.reentrant is None:
            return self.region(self.pre(x))
        return torch.utils.checkpoint.checkpoint(self.region, self.pre(x), use_reentrant=self.reentrant)


@pytest.mark.parametrize("how", ["reentrant", "non-reentrant", "checkpoint_modules"])
def test_a_peak_in_checkpoint_recomputation_names_the_module_recomputing(how):
    # the recomputation's ops were named after the node that asked for it (region.tail, or the model for the
    # reentrant one): an adversarial pass on 2026-12-02
    model = _Checkpointed({"reentrant": True, "non-reentrant": False}.get(how))
    if how == "checkpoint_modules":
        memtrim.checkpoint_modules(model, ["region"])
    with memtrim.track(model) as tracker:
        model(torch.randn(2, 4)).sum().backward()
    report = tracker.report()
    assert report.peak_phase == "backward"
    assert report.peak_by_category["temporaries"] >= 4 << 18  # the recomputed ones: the peak
    assert report.peak_module == "region.fat"
    recomputed = [e for e in report.timeline if e.kind == "alloc" and e.delta_bytes == 4 << 18]
    assert [(e.phase, e.module) for e in recomputed] == [("forward", "region.fat"), ("backward", "region.fat")]

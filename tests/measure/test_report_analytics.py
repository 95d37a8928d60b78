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

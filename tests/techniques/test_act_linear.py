"""ActLinear keeping the pre-activation, against plain torch."""

import pytest
import torch
import torch.nn.functional as F

import memtrim

from ..helpers import activation_bytes


def grads(fn, x, grad_out, params):
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    return out.detach(), torch.autograd.grad(out, [leaf, *params], grad_out)


@pytest.mark.parametrize("activation, act", [("gelu", F.gelu), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
                                             ("silu", F.silu), ("relu", torch.relu)])
def test_act_linear_bitwise(activation, act):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 16)
    ours = memtrim.nn.ActLinear.from_linear(linear, activation)
    h = torch.randn(4, 8, 64)
    grad_out = torch.randn(4, 8, 16)
    out_ref, g_ref = grads(lambda t: linear(act(t)), h, grad_out, [linear.weight, linear.bias])
    out, g = grads(ours, h, grad_out, [ours.weight, ours.bias])
    assert torch.equal(out, out_ref)
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


def test_memory_act_linear_in_mlp():
    torch.manual_seed(0)
    d = 64
    x = torch.randn(8, 16, d, requires_grad=True).clone()  # the block's input: kept by nobody else
    one = x.numel() * 4
    fc1, proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
    fused = memtrim.nn.ActLinear.from_linear(proj, "gelu")
    wide = 4 * one
    assert activation_bytes(lambda t: proj(F.gelu(fc1(t))), x) == one + 2 * wide  # fc1's input, GELU's input and output
    assert activation_bytes(lambda t: fused(fc1(t)), x) == one + wide  # fc1's input and the pre-activation only


def test_bad_input():
    with pytest.raises(memtrim.InvalidInputError, match="activation must be one of"):
        memtrim.nn.ActLinear(4, 4, activation="tanhh")

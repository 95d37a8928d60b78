"""BatchNormReLU + recompute hooks: the ReLU output is kept by nobody; gradients equal torch's."""

import gc
import weakref

import pytest
import torch
from torch import nn

import memtrim
from memtrim.measure.hooks import top_saved_tensors_hooks

from ..helpers import activation_bytes


def blocks(fused):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    if not fused:
        return plain
    model, report = memtrim.convert(plain, example_inputs=(torch.randn(2, 3, 10, 10),))
    assert [c.after for c in report.changes] == ["memtrim.nn.BatchNormReLU2d"]
    return model


@pytest.mark.parametrize("dtype, tol", [(torch.float64, (1e-10, 1e-12)), (torch.float32, (1e-4, 1e-5))])
@pytest.mark.parametrize("train", [True, False])
def test_gradients_and_running_stats_match(dtype, tol, train):
    plain, fused = blocks(False).to(dtype), blocks(True).to(dtype)
    plain.train(train)
    fused.train(train)
    x = torch.randn(4, 3, 10, 10, dtype=dtype)
    grad_out = torch.randn(4, 8, 10, 10, dtype=dtype)
    outs = []
    for model in (plain, fused):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        grads = torch.autograd.grad(out, [leaf, *model.parameters()], grad_out)
        outs.append((out.detach(), grads))
    assert torch.equal(outs[0][0], outs[1][0])  # the forward is torch's BatchNorm kernel then ReLU
    for a, b in zip(outs[1][1], outs[0][1]):
        # the ReLU output the second conv needs is recomputed as relu(x * scale + shift): rounding-level
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(fused.state_dict()[name], plain.state_dict()[name])


def test_relu_output_is_kept_by_nobody():
    def kept(model):
        return activation_bytes(model, torch.randn(4, 3, 16, 16), model=model)

    one = 4 * 8 * 16 * 16 * 4
    stats = 2 * 8 * 4  # BatchNorm's per-channel mean and invstd
    assert kept(blocks(False)) == 2 * one + stats  # BatchNorm's input, ReLU's output (shared with the conv)
    assert kept(blocks(True)) == one + stats + 2 * 8 * 4  # BatchNorm's input, statistics, scale and shift


def test_relu_output_freed_right_after_the_forward():
    model = blocks(True)
    storages = []
    model[1].register_forward_hook(lambda m, args, out: storages.append(weakref.ref(out.untyped_storage())))
    out = model(torch.randn(2, 3, 10, 10))
    gc.collect()
    # gone while the graph lives: nothing, not even a hook closure kept with ReLU's saved variable, holds it
    assert storages[0]() is None
    assert out.grad_fn is not None


def test_nothing_leaks_and_inplace_edits_still_raise():
    model = blocks(True)
    x = torch.randn(2, 3, 10, 10)
    with memtrim.track(model) as tracker:
        out = model(x)
        out.sum().backward()
        del out
        gc.collect()
        assert tracker.live_by_category()["activations"] == 0
    assert top_saved_tensors_hooks() is None  # popped after the forward

    class Edits(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = blocks(True)

        def forward(self, t):
            h = torch.sigmoid(self.inner(t))  # sigmoid keeps its output...
            h.mul_(2)  # ...which is then changed in place
            return h

    edits = Edits()
    memtrim.convert(edits, example_inputs=(x,))  # the recompute hooks run around the second conv
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        edits(x).sum().backward()


def test_under_torch_compile_it_runs_as_plain_batchnorm_relu():
    torch._dynamo.reset()
    plain, fused = torch.compile(blocks(False)), torch.compile(blocks(True))
    x = torch.randn(4, 3, 10, 10)
    grads = []
    for model in (plain, fused):
        model(x).square().sum().backward()
        grads.append([p.grad for p in model._orig_mod.parameters()])
    for a, b in zip(grads[1], grads[0]):
        # the saved-tensor hooks step aside under compile (they do not trace): the same compiled graph
        assert torch.equal(a, b)

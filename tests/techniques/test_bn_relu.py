"""BatchNormReLU + recompute hooks: the ReLU output is kept by nobody; gradients equal torch's."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.utils.parametrize
import torch.nn.utils.prune
from torch import nn

import memtrim
from memtrim.measure.hooks import top_saved_tensors_hooks
from memtrim.techniques.norms import bn_relu

from ..helpers import activation_bytes, captured_training


def blocks(fused):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    if not fused:
        return plain
    model, report = memtrim.convert(plain, example_inputs=(torch.randn(2, 3, 10, 10),))
    assert [c.after for c in report.changes] == ["memtrim.nn.BatchNormReLU2d"]
    return model


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("channels_last", [False, True])
def test_gradients_and_running_stats_are_torchs_bit_for_bit(dtype, train, channels_last):
    plain, fused = blocks(False).to(dtype), blocks(True).to(dtype)
    plain.train(train)
    fused.train(train)
    x = torch.randn(4, 3, 10, 10, dtype=dtype)
    if channels_last:
        plain, fused, x = (t.to(memory_format=torch.channels_last) for t in (plain, fused, x))
    grad_out = torch.randn(4, 8, 10, 10, dtype=dtype)
    outs = []
    for model in (plain, fused):
        leaf = x.clone().requires_grad_()
        out = model(leaf)
        grads = torch.autograd.grad(out, [leaf, *model.parameters()], grad_out)
        outs.append((out.detach(), grads))
    assert torch.equal(outs[0][0], outs[1][0])  # the forward is torch's BatchNorm kernel then ReLU
    for a, b in zip(outs[1][1], outs[0][1]):
        # the ReLU output the second conv needs is rebuilt by the same batch_norm call on the same input
        assert torch.equal(a, b)
    for name in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.equal(fused.state_dict()[name], plain.state_dict()[name])


@pytest.mark.parametrize("affine, track", [(False, True), (True, False), (False, False)])
def test_without_affine_parameters_or_running_statistics_too(affine, track):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, affine=affine, track_running_stats=track),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    fused, report = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10))
    assert [(c.after, c.bitwise) for c in report.changes] == [("memtrim.nn.BatchNormReLU2d", True)]
    x = torch.randn(4, 3, 10, 10)
    for mode in (True, False):
        plain.train(mode), fused.train(mode)
        grads = [torch.autograd.grad(m(x).square().sum(), list(m.parameters())) for m in (plain, fused)]
        for a, b in zip(*grads):
            assert torch.equal(a, b)


def test_a_gradient_penalty_through_it_is_torchs():
    # the rebuilt output is the forward's bit for bit, so a backward with create_graph=True through it is exact
    plain, fused = blocks(False).double(), blocks(True).double()
    x = torch.randn(4, 3, 10, 10, dtype=torch.float64)
    results = []
    for model in (plain, fused):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(model(leaf).square().sum(), leaf, create_graph=True)
        results.append(torch.autograd.grad(g.square().sum(), list(model.parameters())))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("what", ["bias", "running_mean"])
def test_a_tensor_the_rebuild_reads_changed_in_place_before_backward_raises(what):
    # the rebuild reads the bias (and in eval the running statistics): changed between forward and backward, it
    # would rebuild another output than the forward's, so unpacking raises autograd's error instead
    fused = blocks(True)
    fused.train(what == "bias")
    out = fused(torch.randn(2, 3, 10, 10))
    with torch.no_grad():
        getattr(fused[1], what).add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_relu_output_is_kept_by_nobody():
    def kept(model):
        return activation_bytes(model, torch.randn(4, 3, 16, 16), model=model)

    one = 4 * 8 * 16 * 16 * 4
    stats = 2 * 8 * 4  # BatchNorm's per-channel mean and invstd
    assert kept(blocks(False)) == 2 * one + stats  # BatchNorm's input, ReLU's output (shared with the conv)
    assert kept(blocks(True)) == one + stats  # BatchNorm's input and statistics: the rebuild computes nothing else


def test_relu_output_freed_right_after_the_forward():
    model = blocks(True)
    storages = []
    # (the next convolution's input, the fused BatchNorm's output: a forward hook on the fused module, or on the
    # absorbed ReLU, which was not in place, raises)
    model[3].register_forward_pre_hook(lambda m, args: storages.append(weakref.ref(args[0].untyped_storage())))
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


@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_a_weight_pruned_or_parametrized_after_convert_is_the_one_the_forward_reads(how):
    # pruning and parametrizations take "weight" out of the module's parameter dict and compute it at each call
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        plain[1].weight.uniform_(0.5, 2.0)
    fused, report = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(6, 4))
    assert [c.after for c in report.changes] == ["memtrim.nn.BatchNormReLU1d"]
    for model in (plain, fused):
        if how == "prune":
            torch.nn.utils.prune.l1_unstructured(model[1], "weight", amount=0.5)
        else:
            torch.nn.utils.parametrize.register_parametrization(model[1], "weight", nn.Softplus())
    x = torch.randn(6, 4)
    results = [(m(x), torch.autograd.grad(m(x).square().sum(), list(m.parameters()))) for m in (plain, fused)]
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_an_eval_forward_then_a_training_forward_before_one_backward_is_torchs():
    # the training forward updates the running statistics in place inside torch's kernel, without a version bump:
    # the eval call's rebuild reads copies made at its forward
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
    fused, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(6, 4))
    x1, x2 = torch.randn(6, 4), torch.randn(6, 4)
    grads = []
    for model in (plain, fused):
        model.eval()
        first = model(x1)
        model.train()
        second = model(x2)
        grads.append(torch.autograd.grad(first.sum() + second.sum(), list(model.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("what", ["weight", "bias"])
def test_under_hooks_that_keep_tensors_themselves_a_changed_parameter_trains_as_the_unconverted_model(what):
    # hooks outside (identity hooks; save_on_cpu on CPU tensors) keep the tensor itself and torch skips its own
    # version check for them: the plain model keeps the ReLU output and trains on. Under hooks other than memtrim's
    # the fused module keeps what torch keeps (no rebuild that would read the changed parameter), so it trains on too,
    # with the plain model's gradients
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    fused, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(6, 4))
    assert isinstance(fused[2], memtrim.Absorbed)
    x = torch.randn(6, 4)
    grads = []
    for model in (plain, fused):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(x).square().sum()
        with torch.no_grad():
            getattr(model[1], what).add_(0.5)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_an_input_kept_from_inside_a_torch_func_transform_runs_as_torch():
    # found by an adversarial pass: such a tensor (a dead functorch wrapper) has no storage to read, and marking the
    # ReLU's output as a recipe of it raised NotImplementedError where torch's BatchNorm + ReLU runs
    torch.manual_seed(0)
    plain = nn.Sequential(nn.BatchNorm2d(3), nn.ReLU()).double()
    fused = memtrim.nn.BatchNormReLU2d(3).double()
    fused.load_state_dict(plain[0].state_dict())
    grads = []
    for model in (plain, fused):
        x = torch.randn(2, 3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
        inside = []

        def f(v, inside=inside):
            inside.append(v * 2)
            return inside[-1].sum()

        torch.func.vjp(f, x)
        model(inside[0]).square().sum().backward()
        grads.append((x.grad, model[0].weight.grad if model is plain else model.weight.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- NOTE [ the one-pass rebuild ] in norms/bn_relu.py
@pytest.fixture
def one_pass(monkeypatch):
    """The one-pass rebuild at any size (the CPU's threshold is for speed only), with no probe made yet, and a list of
    its calls (the probes' included)."""
    monkeypatch.setattr(bn_relu, "_ONE_PASS_CPU_MIN", 0)
    monkeypatch.setattr(bn_relu, "_ONE_PASS_EQUAL", {})
    used = []
    real = bn_relu._one_pass

    def counted(*args):
        used.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(bn_relu, "_one_pass", counted)
    return used


def train_side_by_side(plain, fused, inputs):
    """Each model's gradients at each step of the same inputs, asserted equal bit for bit."""
    for x in inputs:
        grads = [torch.autograd.grad(m(x).square().sum(), list(m.parameters())) for m in (plain, fused)]
        for a, b in zip(*grads):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("affine, track", [(True, True), (False, True), (True, False), (False, False)])
def test_the_one_pass_rebuild_is_used_once_compared_and_the_gradients_stay_torchs(one_pass, dtype, channels_last,
                                                                                  affine, track):
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, affine=affine, track_running_stats=track),
                          nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1)).to(dtype)
    if affine:  # trained-looking gammas and betas, not torch's ones and zeros
        with torch.no_grad():
            plain[1].weight.uniform_(0.01, 3.0)
            plain[1].bias.uniform_(-2.0, 2.0)
    fused, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10, dtype=dtype))
    inputs = [torch.randn(4, 3, 10, 10, dtype=dtype) * 3 + 1 for _ in range(3)]
    if channels_last:
        plain, fused = plain.to(memory_format=torch.channels_last), fused.to(memory_format=torch.channels_last)
        inputs = [x.contiguous(memory_format=torch.channels_last) for x in inputs]
    train_side_by_side(plain, fused, inputs)
    # compared on a probe at the first backward, equal on this machine's CPU kernel, and so used at all three
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [True]
    assert len(one_pass) == 1 + 3


def test_where_the_one_pass_rebuild_differs_the_two_pass_one_is_kept(one_pass, monkeypatch):
    # a kernel that rounds otherwise (cuDNN's at small images, found on an H200): simulated by one ulp off
    real = bn_relu._one_pass

    def off(*args):
        t = real(*args)
        return torch.nextafter(t, torch.full_like(t, float("inf")))

    monkeypatch.setattr(bn_relu, "_one_pass", off)
    plain, fused = blocks(False), blocks(True)
    train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10) for _ in range(3)])
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [False]


def test_below_the_cpu_threshold_or_in_bfloat16_or_in_eval_the_two_pass_rebuild_runs(monkeypatch):
    monkeypatch.setattr(bn_relu, "_ONE_PASS_EQUAL", {})
    small, big = torch.randn(2, 3, 10, 10), torch.randn(32, 3, 10, 10)  # 1,600 and 25,600 values at the BatchNorm
    assert 2 * 8 * 100 < bn_relu._ONE_PASS_CPU_MIN <= 32 * 8 * 100
    train_side_by_side(blocks(False), blocks(True), [small, small])
    assert bn_relu._ONE_PASS_EQUAL == {}
    train_side_by_side(blocks(False).bfloat16(), blocks(True).bfloat16(), [big.bfloat16()] * 2)
    assert bn_relu._ONE_PASS_EQUAL == {}
    train_side_by_side(blocks(False).eval(), blocks(True).eval(), [big, big])
    assert bn_relu._ONE_PASS_EQUAL == {}
    train_side_by_side(blocks(False), blocks(True), [big, big])
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [True]


def test_a_head_run_on_z_after_the_batchnorms_backward_gets_the_forwards_z(one_pass):
    # the BatchNorm node's statistics are freed by its backward; a head run on z after that backward (z held by the
    # caller) keeps a rebuild of z, which is still the forward's z (the recipe holds the statistics, not the node), as
    # the unconverted head keeps z itself
    torch.manual_seed(0)

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.a, self.b = nn.Conv2d(8, 2, 3), nn.Conv2d(8, 2, 3)

        def forward(self, x):
            z = self.body(x)
            return self.a(z) + self.b(z)

    plain = TwoHeads()
    fused, report = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10))
    assert [c.after for c in report.changes] == ["memtrim.nn.BatchNormReLU2d"]
    train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10)])  # (compared: equal, on this CPU)
    assert len(one_pass) == 2
    x = torch.randn(4, 3, 10, 10)
    results = []
    for model in (plain, fused):
        z = model.body(x)
        first = torch.autograd.grad(model.a(z).square().sum(), [*model.body.parameters(), *model.a.parameters()])
        second = torch.autograd.grad(model.b(z).square().sum(), list(model.b.parameters()))  # BatchNorm's node: freed
        results.append((*first, *second))
    for p, q in zip(*results):
        assert torch.equal(p, q)
    assert len(one_pass) == 4  # the probe's and the first step's, then one for each head's backward


def rounds_otherwise_off_the_mean(monkeypatch):
    """The one-pass rebuild replaced by one that rounds as a different kernel would (one ulp up) wherever the value is
    not the bias exactly: ``(x - mean) * weight != 0`` (cuDNN's kernel at 14x14 and 7x7 against batch_norm_elemt on an
    H200: 45 % of the values differ, so not on a batch of zeros or with zero gammas)."""
    real = bn_relu._one_pass

    def other(x, weight, bias, mean, invstd, eps):
        t = real(x, weight, bias, mean, invstd, eps)
        shape = [1, -1] + [1] * (x.dim() - 2)
        off = (x - mean.view(shape)) * (1.0 if weight is None else weight.view(shape)) != 0
        return torch.where(off, torch.nextafter(t, torch.full_like(t, float("inf"))), t)

    monkeypatch.setattr(bn_relu, "_one_pass", other)


@pytest.mark.parametrize("case", ["first batch of zeros", "zero gammas"])
def test_a_batch_of_zeros_or_zero_gammas_do_not_pass_a_kernel_that_rounds_otherwise(one_pass, monkeypatch, case):
    # found by an adversarial pass: compared on the first batch, a batch of zeros (a warm-up step) or zero gammas made
    # both rebuilds give the bias exactly, the one-pass rebuild was taken for the forward's, and later steps differed
    rounds_otherwise_off_the_mean(monkeypatch)
    torch.manual_seed(0)
    # (no bias before the BatchNorm: a batch of zeros gives it zeros)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1))
    if case == "zero gammas":
        with torch.no_grad():
            plain[1].weight.zero_()
            plain[1].bias.uniform_(0.5, 1.0)
    fused, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10))
    inputs = [torch.randn(4, 3, 10, 10) for _ in range(3)]
    if case == "first batch of zeros":
        inputs.insert(0, torch.zeros(4, 3, 10, 10))
    train_side_by_side(plain, fused, inputs)
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [False]  # decided on the probe, not on the batch


def test_a_one_pass_kernel_that_is_missing_keeps_the_two_pass_rebuild(one_pass, monkeypatch):
    # a device or dtype without the one-pass kernel: the probe finds out, and training goes on as torch's
    def missing(*args):
        raise RuntimeError("batch_norm_elemt: no kernel for these dtypes")

    monkeypatch.setattr(bn_relu, "_one_pass", missing)
    plain, fused = blocks(False), blocks(True)
    train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10) for _ in range(3)])
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [False]


def test_no_memory_for_the_probe_keeps_the_two_pass_rebuild(one_pass, monkeypatch):
    # a GPU at its limit: the probe's three tensors do not fit; the backward goes on as before the one-pass rebuild
    real = torch.empty_strided

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory (simulated)")

    monkeypatch.setattr(torch, "empty_strided", full)  # (the probe's allocations; the rebuild itself makes none so)
    plain, fused = blocks(False), blocks(True)
    try:
        train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10) for _ in range(2)])
    finally:
        monkeypatch.setattr(torch, "empty_strided", real)
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [False]


def test_a_batchnorm_input_that_is_not_dense_keeps_the_two_pass_rebuild(one_pass):
    # found by an adversarial pass: torch's CPU kernel normalises a transposed input as ((x - mean) * invstd) * w + b,
    # not by its fast path's x * alpha + beta
    class Transposed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(8, 32, bias=False)
            self.body = nn.Sequential(nn.BatchNorm1d(32), nn.ReLU(), nn.Conv1d(32, 16, 3))

        def forward(self, x):
            return self.body(self.inp(x).transpose(1, 2))

    torch.manual_seed(0)
    plain = Transposed()
    fused, report = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(8, 64, 8))
    assert len(report.changes) == 1
    train_side_by_side(plain, fused, [torch.zeros(8, 64, 8)] + [torch.randn(8, 64, 8) for _ in range(3)])
    assert bn_relu._ONE_PASS_EQUAL == {} and one_pass == []


@pytest.mark.parametrize("what", ["weight", "bias", "running_mean"])
@pytest.mark.parametrize("once", [True, False])
def test_a_strided_weight_bias_or_running_statistic_rebuilds_as_the_forward_computed(one_pass, monkeypatch, what,
                                                                                     once):
    # found by an adversarial pass: torch's CPU kernel takes its other formula when any of them is not contiguous; the
    # one-pass rebuild, and the two-pass one for strided running statistics (which it does not update), took the fast
    # path's (1.9e-8 to 3.7e-8 off)
    monkeypatch.setattr(bn_relu, "ONE_PASS", once)

    def make():  # (built twice: deepcopy would make a strided parameter contiguous)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                              nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 3))
        bn = model[1]  # the earlier pair: the later, contiguous one is rebuilt first and compared first
        if what == "running_mean":
            bn.running_mean = torch.zeros(32)[::2]
        else:
            setattr(bn, what, nn.Parameter((torch.rand(32) + 0.5)[::2]))
        return model

    plain = make()
    fused, _ = memtrim.convert(make(), example_inputs=torch.randn(8, 3, 16, 16))
    assert not getattr(fused[1], what).is_contiguous()
    train_side_by_side(plain, fused, [torch.randn(8, 3, 16, 16) for _ in range(3)])
    if once:
        assert list(bn_relu._ONE_PASS_EQUAL.values()) == [True] and len(one_pass) == 1 + 3  # the later pair only


def test_a_kernel_that_rounds_otherwise_only_for_large_means_does_not_pass_the_probe(one_pass, monkeypatch):
    # found by an adversarial pass: a probe of values near 0 and 1 would not show a kernel that rounds its per-channel
    # terms otherwise, which real activations (means and scales far from 0 and 1) would
    real = bn_relu._one_pass

    def other(x, weight, bias, mean, invstd, eps):
        t = real(x, weight, bias, mean, invstd, eps)
        shape = [1, -1] + [1] * (x.dim() - 2)
        far = (mean.abs() > 5).view(shape).expand_as(t)
        return torch.where(far, torch.nextafter(t, torch.full_like(t, float("inf"))), t)

    monkeypatch.setattr(bn_relu, "_one_pass", other)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    with torch.no_grad():
        plain[0].bias.copy_(torch.linspace(-40, 40, 8))  # activations around means from -40 to 40
    fused, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10))
    train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10) for _ in range(3)])
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [False]


def test_after_the_most_probes_new_shapes_keep_the_two_pass_rebuild(one_pass, monkeypatch):
    monkeypatch.setattr(bn_relu, "_ONE_PASS_MAX_KEYS", 1)
    plain, fused = blocks(False), blocks(True)
    train_side_by_side(plain, fused, [torch.randn(4, 3, 10, 10), torch.randn(6, 3, 10, 10), torch.randn(4, 3, 10, 10)])
    assert list(bn_relu._ONE_PASS_EQUAL.values()) == [True]  # the first shape's probe only
    assert len(one_pass) == 1 + 2  # its probe, then its two steps; the second shape's step in two passes


@pytest.mark.parametrize("train", [True, False])
def test_strided_running_statistics_in_eval_rebuild_as_the_forward_computed(train):
    # found by an adversarial pass: the eval rebuild read contiguous copies of strided running statistics, and torch's
    # CPU kernel normalises strided ones by its other formula (7.5e-9 off)
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 3))
        model[1].running_mean = torch.randn(32)[::2]
        model[1].running_var = (torch.rand(32) + 0.5)[::2]
        return model.train(train)

    plain = make()
    fused, _ = memtrim.convert(make(), example_inputs=torch.randn(8, 3, 16, 16))
    fused.train(train)
    assert not fused[1].running_var.is_contiguous()
    train_side_by_side(plain, fused, [torch.randn(8, 3, 16, 16) for _ in range(2)])


def test_strided_running_statistics_in_training_rebuild_twice_with_retain_graph():
    # the rebuild reads copies of them laid out as they are, which it updates (momentum 0) without a version bump: a
    # second backward through the same graph rebuilds the same output
    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 4, 3))
        model[1].running_mean = torch.zeros(32)[::2]
        model[1].running_var = torch.ones(32)[::2]
        return model

    plain = make()
    fused, _ = memtrim.convert(make(), example_inputs=torch.randn(8, 3, 16, 16))
    x = torch.randn(8, 3, 16, 16)
    results = []
    for model in (plain, fused):
        loss = model(x).square().sum()
        first = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        results.append(first + torch.autograd.grad(loss, list(model.parameters())))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    for name in ("running_mean", "running_var"):
        assert torch.equal(getattr(plain[1], name), getattr(fused[1], name))


@pytest.mark.parametrize("eps, train", [(0.0, True), (-1e-5, True), (-1e-5, False), (0.0, False)])
def test_an_eps_torch_refuses_is_refused_as_torch_refuses_it(eps, train):
    # found by an adversarial pass: torch's F.batch_norm (2.13) raises for eps <= 0 in training and eps < 0 in eval;
    # the fused module called torch's ops directly and trained on
    outcomes = []
    for model in (blocks(False), blocks(True)):
        model[1].eps = eps
        model.train(train)
        try:
            model(torch.randn(4, 3, 10, 10)).sum().backward()
            outcomes.append(None)
        except ValueError as e:
            outcomes.append(str(e))
    assert (outcomes[0] is None) == (outcomes[1] is None), outcomes
    if outcomes[0] is not None:
        assert outcomes[0] in outcomes[1]


def test_a_torch_function_mode_sees_torch_batch_norm_and_training_stays_torchs(one_pass):
    # found by an adversarial pass: the forward's torch._batch_norm_impl_index (for the one-pass rebuild's statistics)
    # is an op a user's TorchFunctionMode that watches or replaces torch.batch_norm would not know
    class Seen(torch.overrides.TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.names = set()

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.add(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    plain, fused = blocks(False), blocks(True)
    x = torch.randn(4, 3, 10, 10)
    with Seen() as seen:
        grads = [torch.autograd.grad(m(x).square().sum(), list(m.parameters())) for m in (plain, fused)]
    assert "batch_norm" in seen.names and "_batch_norm_impl_index" not in seen.names
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    assert one_pass == []  # the two-pass rebuild there


def test_the_probe_leaves_the_users_random_numbers_alone(one_pass):
    # dropout after the first comparison draws the same masks as in the unconverted model
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.Dropout(0.5), nn.Conv2d(8, 4, 3))
    fused, report = memtrim.convert(copy.deepcopy(plain), example_inputs=torch.randn(2, 3, 10, 10))
    assert any(c.after == "memtrim.nn.BatchNormReLU2d" for c in report.changes)
    inputs = [torch.randn(4, 3, 10, 10) for _ in range(3)]
    grads = []
    for model in (plain, fused):
        torch.manual_seed(1)
        grads.append([torch.autograd.grad(model(x).square().sum(), list(model.parameters())) for x in inputs])
    for a, b in zip(*grads):
        for p, q in zip(a, b):
            assert torch.equal(p, q)
    assert len(one_pass) == 1 + 3


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_on_cuda_the_one_pass_rebuild_gives_the_two_pass_rebuilds_gradients(one_pass, monkeypatch, dtype):
    # on an H200 batch_norm_elemt matched cuDNN's kernel at 112², 56² and 28² in float32 and not at 14² or 7²
    # (benchmarks/bn_rebuild_kernels.py): whatever the comparison finds at each shape here, every step gives the
    # gradients of the rebuild before (deterministic kernels, so that a difference is the rebuild's)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    torch.manual_seed(0)
    layers = []
    for cin, cout, stride in ((3, 16, 1), (16, 32, 2), (32, 32, 2)):  # BatchNorms at 56², 28² and 14²
        layers += [nn.Conv2d(cin, cout, 3, stride=stride, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
    plain = nn.Sequential(*layers, nn.Conv2d(32, 4, 3)).to("cuda", dtype)
    converted, report = memtrim.convert(plain, example_inputs=torch.randn(2, 3, 56, 56, device="cuda", dtype=dtype))
    assert len(report.changes) == 3
    two_pass = copy.deepcopy(converted)
    for step in range(3):
        x = torch.randn(16, 3, 56, 56, device="cuda", dtype=dtype)
        grads = []
        for model, once in ((converted, True), (two_pass, False)):
            monkeypatch.setattr(bn_relu, "ONE_PASS", once)
            grads.append(torch.autograd.grad(model(x).square().sum(), list(model.parameters())))
        for a, b in zip(*grads):
            assert torch.equal(a, b), step
    equal = sum(bn_relu._ONE_PASS_EQUAL.values())
    assert len(bn_relu._ONE_PASS_EQUAL) == 3 and len(one_pass) == 3 + 3 * equal, bn_relu._ONE_PASS_EQUAL


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_converted_resnet_step_captured_in_a_cuda_graph_trains_as_the_plain_ones_and_keeps_less(
        monkeypatch):
    # a step that waits on the host is captured in a CUDA graph (PyTorch's whole-network capture) to stop waiting:
    # memtrim's Python runs once, at the capture, and each replay runs the recorded kernels, the rebuilds in backward
    # among them; the replays train as the plain model's graph does, bit for bit, and the capture's peak (what the
    # graph's pool holds) is lower
    from memtrim.models.torchvision_resnet import TorchvisionBasicBlock, TorchvisionResNet

    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    torch.manual_seed(0)
    plain = TorchvisionResNet(TorchvisionBasicBlock, [1, 1, 1, 1], num_classes=10).cuda()
    x = torch.randn(8, 3, 64, 64, device="cuda")
    converted, report = memtrim.convert(copy.deepcopy(plain), example_inputs=x)
    assert any(c.after == "memtrim.nn.BatchNormReLU2d" for c in report.changes), report
    peaks = [captured_training(model, x, lambda out: out.square().mean()) for model in (plain, converted)]
    for (name, a), b in zip(plain.state_dict().items(), converted.state_dict().values()):
        assert torch.equal(a, b), name
    assert peaks[1] < peaks[0], peaks

"""Activation offloading: bitwise the same training; on CPU a no-op that says so; on CUDA the saved activations
leave the device (bytes from the allocator)."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.errors import InvalidInputError, MemtrimStateError
from memtrim.models import GPTConfig, SmallGPT


def _gpt(device="cpu"):
    torch.manual_seed(0)
    return SmallGPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, vocab_size=128)).to(device)


def _grads_after_step(model, x, y):
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_on_cpu_with_include_cpu_the_handle_says_nothing_is_pinned():
    # include_cpu copies the saved tensors, into memory that is not pinned without an accelerator (the note said
    # pinned; found by an adversarial pass)
    handle = memtrim.offload_module(_gpt(), min_bytes=0, include_cpu=True)
    assert "copied to host memory" in handle.note and "nothing is pinned" in handle.note


def test_on_cpu_nothing_moves_and_the_handle_says_so():
    model = _gpt()
    x = torch.randint(0, 128, (2, 32))
    plain = copy.deepcopy(model)
    handle = memtrim.offload_module(model, min_bytes=0)
    assert "nothing is moved" in handle.note
    with memtrim.OffloadActivations(min_bytes=0) as hooks:
        out = model(x)
    assert hooks.offloaded_bytes == 0
    assert torch.equal(out, plain(x))
    for a, b in zip(_grads_after_step(model, x, x), _grads_after_step(plain, x, x)):
        assert torch.equal(a, b)
    handle.remove()
    assert "forward" not in model.__dict__
    handle.remove()  # a second call does nothing


def test_bad_input_and_double_offload_raise():
    model = _gpt()
    # host="meta", the planner's prediction, on real tensors: backward failed with torch's bare "Cannot copy out of
    # meta tensor" (an adversarial pass on 2026-12-03)
    with pytest.raises(InvalidInputError, match="host='meta' is how memtrim.plan predicts .* host='cpu'"):
        memtrim.offload_module(model, include_cpu=True, host="meta")
    with pytest.raises(InvalidInputError, match="host='meta' is how memtrim.plan predicts"):
        with memtrim.OffloadActivations(min_bytes=0, include_cpu=True, host="meta"):
            model(torch.randint(0, 128, (2, 32)))
    with pytest.raises(InvalidInputError, match="model must be a torch.nn.Module"):
        memtrim.offload_module(3)
    with pytest.raises(InvalidInputError, match="min_bytes must be an int >= 0"):
        memtrim.offload_module(model, min_bytes=-1)
    memtrim.offload_module(model)
    with pytest.raises(MemtrimStateError, match="already has a forward"):
        memtrim.offload_module(model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_saved_activations_leave_the_device_and_training_is_bitwise():
    model = _gpt("cuda")
    plain = copy.deepcopy(model)
    x = torch.randint(0, 128, (8, 32), device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out_plain = plain(x)
    held_plain = torch.cuda.memory_allocated() - base
    del out_plain
    memtrim.offload_module(model, min_bytes=0)
    base = torch.cuda.memory_allocated()
    out = model(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base
    del out
    assert held < held_plain / 2, (held, held_plain)
    for a, b in zip(_grads_after_step(model, x, x), _grads_after_step(plain, x, x)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_copy_out_copy_back_path_is_bitwise(dropout):
    # include_cpu sends CPU tensors through the same pack/unpack as an accelerator's: every saved activation is
    # copied out and back (views, the attention's saved tensors, dropout masks), and training stays bitwise
    torch.manual_seed(0)
    model = SmallGPT(GPTConfig(n_layer=2, d_model=64, n_head=4, seq_len=32, vocab_size=128, dropout=dropout))
    plain = copy.deepcopy(model)
    x = torch.randint(0, 128, (2, 32))
    torch.manual_seed(1)
    with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) as hooks:
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    torch.manual_seed(1)
    F.cross_entropy(plain(x).flatten(0, 1), x.flatten()).backward()
    assert hooks.offloaded_bytes > 0
    for (name, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad), name


def _offloaded_and_plain_grads(make_model, x):
    """The model's gradients after a step with every saved tensor offloaded (the hooks: their bytes), and without."""
    def run(offloaded):
        torch.manual_seed(0)
        model = make_model()
        hooks = memtrim.OffloadActivations(min_bytes=0, include_cpu=True) if offloaded else contextlib.nullcontext()
        with hooks:
            out = model(x.clone())  # (a tensor made for the step: a leaf the caller keeps stays where it is)
        out.square().sum().backward()
        return [p.grad for p in model.parameters()], hooks

    (got, hooks), (expected, _) = run(offloaded=True), run(offloaded=False)
    return got, expected, hooks


def test_a_3d_activation_and_the_2d_view_the_next_linear_saves_are_one_copy():
    # a (batch, seq, features) ReLU output is saved by the ReLU as it is and by the next Linear as a (batch * seq,
    # features) view: copied twice until 2026-12-02 (an adversarial pass), the README's "copied once" held for 2-D only
    got, expected, hooks = _offloaded_and_plain_grads(
        lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64)),
        torch.randn(4, 16, 32) * 2)
    assert hooks.offloaded_bytes == 4 * 16 * 32 * 4 + 4 * 16 * 64 * 4  # the input, the ReLU's output: once each
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


class _TrimmedConv(torch.nn.Module):
    """HF Wav2Vec2's positional convolution: conv, trimmed by [..., :-1] (a slice with gaps), then GELU."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(32, 32, 5, padding=2)

    def forward(self, x):
        return F.gelu(self.conv(x)[:, :, :-1])


def test_a_saved_slice_with_gaps_comes_back_with_its_strides():
    # found by an adversarial pass on HF Wav2Vec2: the copy of the trimmed convolution output (strides (1280, 40, 1)
    # over (2, 32, 39)) came back contiguous, and GELU's backward took another kernel: other bits (3.8e-6 off on the
    # convolution's weight gradient); the storage elements it reaches are copied now, and viewed back as they were
    got, expected, hooks = _offloaded_and_plain_grads(_TrimmedConv, torch.randn(2, 32, 40) * 3)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # the input (2, 32, 40), and the slice: the elements from its first to its last, gaps included
    assert hooks.offloaded_bytes == 2 * 32 * 40 * 4 + (2 * 32 * 40 - 1) * 4


def test_a_tensor_and_its_transpose_are_one_copy():
    # saved as it is (by a matmul as its second operand) and transposed (by another as its first): copied twice
    # until 2026-12-02, the README's limit "one storage saved through two views of different strides"
    def run(offloaded):
        torch.manual_seed(0)
        a, b = torch.randn(16, 24, requires_grad=True), torch.randn(24, 16, requires_grad=True)
        hooks = memtrim.OffloadActivations(min_bytes=0, include_cpu=True) if offloaded else contextlib.nullcontext()
        with hooks:
            h = torch.tanh(a @ b)  # h (16, 16): saved by tanh as its output
            out = (h @ b.t()) + (h.t() @ a)  # h.t() saved by the second matmul; h by the first
        out.square().sum().backward()
        return (a.grad, b.grad), hooks

    (ga, gb), hooks = run(offloaded=True)
    ea, eb = run(offloaded=False)[0]
    assert torch.equal(ga, ea) and torch.equal(gb, eb)
    assert hooks.offloaded_bytes == 16 * 16 * 4  # h once (a and b are leaves the caller keeps: left in place)


def test_one_context_entered_again_inside_itself_offloads_and_trains_as_without_it():
    # one context shared by nested blocks (`with off:` in a block that a block under `with off:` calls): what it left
    # in place was passed to itself, a RecursionError (torch's save_on_cpu nests so; an adversarial pass on 2026-12-03)
    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16))

    x = torch.randn(4, 16)
    expected = None
    for shared in (None, memtrim.OffloadActivations(min_bytes=0, include_cpu=True)):
        torch.manual_seed(0)
        model = make_model()
        with shared or contextlib.nullcontext():
            h = model[1](model[0](x))
            with shared or contextlib.nullcontext():
                h = model[2](h)
            h = h * x  # after the inner exit: the outer context still offloads
        h.square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        if shared is None:
            expected = grads
        else:
            assert shared.offloaded_bytes > 0
            assert all(torch.equal(a, b) for a, b in zip(grads, expected))


def test_a_prediction_on_fake_tensors_moves_what_autograd_keeps_to_meta_and_back_in_backward():
    """memtrim.plan predicts offloading on fake CPU tensors standing in for an accelerator's: saved tensors wait on
    "meta" (no allocation), so the device holds no activation between forward and backward, and backward gets copies."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
        x = torch.randn(32, 64)
        for min_bytes in (0, 1 << 30):
            with memtrim.track(model) as tracker:
                doubled = x * 2  # the first Linear's saved input: a tensor made inside, so a copy frees it
                before = tracker.live_bytes("cpu")
                with memtrim.OffloadActivations(min_bytes=min_bytes, include_cpu=True, host="meta") as hooks:
                    out = model(doubled)
                    del doubled
                left = tracker.live_bytes("cpu") - before  # what the forward leaves on the device
                waiting = tracker.live_bytes("meta")
                out.sum().backward()
            output, relu, first_input = 32 * 64 * 4, 32 * 256 * 4, 32 * 64 * 4
            if min_bytes == 0:  # ReLU's output is saved twice (by the ReLU and by the second Linear), copied once
                moved = relu + first_input
                assert (left, waiting, hooks.offloaded_bytes) == (output - first_input, moved, moved)
            else:  # nothing is that large: all stays on the device
                assert (left, waiting, hooks.offloaded_bytes) == (output + relu, 0, 0)
            assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())
            model.zero_grad()
    with pytest.raises(InvalidInputError, match="host must be 'cpu'"):
        memtrim.OffloadActivations(host="cuda")


def test_a_tensor_saved_by_two_ops_is_copied_once_unless_changed_in_between():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8)
    with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) as hooks:
        out = model(x)
    # the batch (kept by the first Linear) and ReLU's output (kept by the ReLU and by the second Linear): once each
    assert hooks.offloaded_bytes == x.nbytes + 4 * 16 * 4
    out.sum().backward()
    plain(x).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    a = torch.randn(4, 8, requires_grad=True)
    with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) as hooks:
        t = a * 1
        outputs = [t.sin()]  # keeps t (while its output's graph lives)
        outputs.append(t.cos())  # keeps the same t: no second copy
        t.add_(1)  # new values in the same storage and view
        outputs.append(t.sin())  # keeps the changed t: a copy of its own
    assert hooks.offloaded_bytes == 2 * t.nbytes and len(outputs) == 3


@pytest.mark.parametrize("min_bytes", [0, 1 << 20])  # copied, or left where it is
def test_a_saved_tensor_changed_in_place_raises_as_without_offloading(min_bytes):
    # autograd skips its version check for tensors that go through saved-tensor hooks: without ours a tensor left in
    # place gave a silently wrong gradient (cos of the changed values), and a copied one trained where torch raises
    def step(offload, change):
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 8)
        w = torch.randn(8, requires_grad=True)
        with memtrim.OffloadActivations(min_bytes=min_bytes, include_cpu=True) if offload else contextlib.nullcontext():
            x = w * 1
            y = x.sin() + lin(x).sum()
            if change == "activation":
                x.add_(1)
                y = y + lin(x).sum()  # saves the changed x again: a copy of its own
        if change == "parameter":
            with torch.no_grad():
                lin.weight.mul_(2)  # Linear saved weight.t() (never copied)
        y.sum().backward()

    for change in ("activation", "parameter"):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            step(False, change)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            step(True, change)


def test_a_tensor_changed_in_place_then_saved_through_another_view_raises_after_it_died():
    """sigmoid keeps its output a; a.mul_(2); fc2 keeps a view of a: torch raises in backward. Offloaded, a had died
    by backward (nothing to read its version from) and its copy trained silently with the values before the change."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(4, 1)

        def forward(self, x):
            a = torch.sigmoid(self.fc1(x))
            a.mul_(2.0)
            return self.fc2(a[:, :4])

    for offload in (False, True):
        with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) if offload else contextlib.nullcontext():
            loss = Block()(torch.randn(3, 8)).sum()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_saved_temporary_view_is_checked_through_its_base():
    """fc2 keeps a[:, :4], a slice that dies at once; a is changed in place and lives through backward: torch raises,
    and the copy, checked through the dead slice, trained silently with the old values."""
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(4, 1)

        def forward(self, x):
            a = self.fc1(x)
            y = self.fc2(a[:, :4])
            a.mul_(2.0)
            return y, a

    for offload in (False, True):
        with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) if offload else contextlib.nullcontext():
            y, a = Block()(torch.randn(3, 8))
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (y.sum() + a.sum()).backward()


def test_the_tracker_sees_what_offloading_leaves_in_place_as_kept_for_backward():
    """offload_module on a CPU model moves nothing, but its hooks hid the saved tensors from the tracker's: the
    activations at the start of backward read 3,076 B instead of 527,364 B, the rest filed as temporaries."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))
    x = torch.randn(16, 64)
    live, grads = {}, {}
    for offloaded in (False, True):
        model = copy.deepcopy(base)
        if offloaded:
            memtrim.offload_module(model, min_bytes=0)
        with memtrim.track(model) as tracker:
            loss = model(x).square().sum()
            live[offloaded] = tracker.live_by_category()["activations"]
            loss.backward()
        grads[offloaded] = [p.grad for p in model.parameters()]
    assert live[True] == live[False] >= 2 * 16 * 256 * 4  # the two ReLU outputs (kept by the ReLUs and the Linears)
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    model = copy.deepcopy(base)
    memtrim.offload_module(model, min_bytes=0)
    with memtrim.track(model):  # what offloading leaves in place is checked under the tracker's hooks too
        loss = model(x).sum()
    with torch.no_grad():
        model[2].weight.mul_(2)  # saved by model[2], changed before backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_a_conjugate_view_is_not_the_copy_of_the_tensor_it_views():
    # x.conj() has x's storage, offset, shape, stride and version, and other values
    def grads(offload):
        torch.manual_seed(0)
        a = torch.randn(4, dtype=torch.cfloat, requires_grad=True)
        b = torch.randn(4, dtype=torch.cfloat, requires_grad=True)
        with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) if offload else contextlib.nullcontext():
            x = a * 1
            loss = (x * b).abs().sum() + (x.conj() * b).abs().sum() + (torch._neg_view(x) * b).abs().sum()
        loss.backward()
        return a.grad, b.grad

    for got, want in zip(grads(True), grads(False)):
        assert torch.equal(got, want)


def test_the_copy_keeps_the_layout_of_channels_last_activations():
    # a contiguous copy of a channels_last activation sends batch norm's backward down another kernel: other bits
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU())
    model = model.to(memory_format=torch.channels_last)
    plain = copy.deepcopy(model)
    x = torch.randn(4, 8, 16, 16).to(memory_format=torch.channels_last)
    with memtrim.OffloadActivations(min_bytes=0, include_cpu=True):
        loss = model(x).pow(2).sum()
    loss.backward()
    plain(x).pow(2).sum().backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)


class _MaskedScores(torch.nn.Module):
    """Attention scores times a causal mask buffer expanded to (batch, heads, T, T): the multiply saves the expanded
    view, which reads each of its 16 KiB storage's elements 32 times."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(32, 32)
        self.register_buffer("mask", torch.tril(torch.ones(1, 1, 64, 64)))

    def forward(self, x, mask=None):
        h = self.q(x).view(8, 64, 4, 8).transpose(1, 2)
        return (h @ h.transpose(-1, -2) * (self.mask if mask is None else mask).expand(8, 4, 64, 64)).sum()


def test_a_tensor_read_repeatedly_is_copied_as_its_storage_and_a_models_buffer_stays():
    # a dense copy of the expanded mask was 32x its storage (524,288 B of a 16,384 B buffer), and came back so in
    # backward: offloading raised the peak (found by an adversarial pass); offload_module leaves the buffer, which
    # stays on the device anyway, and every view of it, in place
    torch.manual_seed(0)
    model, x = _MaskedScores(), torch.randn(8, 64, 32)
    plain = copy.deepcopy(model)
    plain(x).backward()
    a = torch.randn(64, requires_grad=True)
    ones = torch.ones(64)
    for min_bytes, copied in ((256, 256), (257, 0)):  # by its storage's bytes: 64 float32, not 1000 x 64
        with memtrim.OffloadActivations(min_bytes=min_bytes, include_cpu=True) as hooks:
            loss = (a * ones.expand(1000, 64)).sum()  # the multiply saves the expanded view
        (grad,) = torch.autograd.grad(loss, a)
        assert hooks.offloaded_bytes == copied and torch.equal(grad, torch.full((64,), 1000.0))
    model.zero_grad()
    memtrim.offload_module(model, min_bytes=0, include_cpu=True)
    saved = []
    with memtrim.track(model) as tracker:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(x)  # (offload's hooks, inside, pass what they leave in place to these)
        loss.backward()
    assert any(t.untyped_storage() is model.mask.untyped_storage() for t in saved)
    assert tracker.report().peak_by_category["buffers"] == 16_384
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_a_compiled_model_offloads_trains_bitwise_and_compiles_no_hook(monkeypatch):
    # found by a pass with torch 2.11: the hooks ran inside the compiled forward, and dynamo compiled their
    # bookkeeping frame by frame at every call (past its recompile limit of 8: warnings, and compile time each step)
    from memtrim.techniques.offload import _core

    copies = []
    copy_out = _core.OffloadActivations._copy_out
    monkeypatch.setattr(_core.OffloadActivations, "_copy_out",
                        lambda self, tensor, *rest: copies.append(tensor.shape) or copy_out(self, tensor, *rest))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    plain = copy.deepcopy(model)
    memtrim.offload_module(model, min_bytes=0, include_cpu=True)
    compiled, compiled_plain = (torch.compile(m, backend="aot_eager") for m in (model, plain))
    g = torch.Generator().manual_seed(1)
    frames = []
    for _ in range(4):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        F.cross_entropy(compiled(x), y).backward()
        F.cross_entropy(compiled_plain(x), y).backward()
        frames.append(torch._dynamo.utils.counters["frames"]["total"])
        for (name, a), b in zip(model.named_parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad), name
    assert len(copies) == 4 * 3  # the compiled forward's saves (x, the GELU's input and output) went out each step
    assert frames[1:] == frames[:1] * 3  # nothing compiled after the first step

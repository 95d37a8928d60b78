"""Embedding sums rebuilt for the first norm (convert's ``embedding_sum``) and ``memtrim.recompute_modules``, against
plain PyTorch training: bitwise, with the bytes from the tracker."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memtrim
from memtrim.models import SmallGPT
from memtrim.techniques import recompute as R
from memtrim.techniques.recompute import _core

from ..helpers import activation_bytes

B, T, D, V = 2, 12, 16, 32


class Embedder(nn.Module):
    """Token + position embeddings (GPT), + token types added in place (BERT), a norm, a Linear head."""

    def __init__(self, style="gpt", dropout=0.0, alpha=1):
        super().__init__()
        self.style, self.alpha = style, alpha
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(T, D)
        self.typ = nn.Embedding(2, D)
        self.drop = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)
        self.edit = None  # "lookup" or "sum": an in-place change under no_grad the trace did not see

    def forward(self, idx):
        a = self.tok(idx)
        if self.edit == "lookup":
            with torch.no_grad():
                a.mul_(2)
        p = self.pos(torch.arange(idx.shape[1], device=idx.device))
        if self.style == "bert":
            x = a + self.typ(torch.zeros_like(idx))
            x += p
        else:
            x = torch.add(a, p, alpha=self.alpha)
        if self.edit == "sum":
            with torch.no_grad():
                x.mul_(2)
        return self.head(self.ln(self.drop(x)))


IDX = torch.randint(0, V, (B, T))
SUM = B * T * D * 4  # the sum, float32


def train(model, steps=4, create_graph=False, idx=IDX):
    """Parameters after AdamW steps on a next-token loss (with a gradient penalty: create_graph)."""
    torch.manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        if create_graph:
            grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True, allow_unused=True)
            loss = loss + sum(g.square().sum() for g in grads if g is not None)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def assert_same_training(a, b, **kw):
    for x, y in zip(train(a, **kw), train(b, **kw)):
        assert torch.equal(x, y)


def sum_changes(report):
    return [c for c in report.changes if c.rule == "embedding_sum"]


@pytest.mark.parametrize("style", ["gpt", "bert"])
def test_embedding_sum_rebuilt_for_the_norm(style):
    torch.manual_seed(0)
    plain = Embedder(style)
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    (change,) = sum_changes(report)
    assert change.bytes_saved == SUM and report.bitwise
    held = activation_bytes(plain, IDX, model=plain)
    assert activation_bytes(converted, IDX, model=converted) == held - report.bytes_saved
    # the LayerNorm excluded: it keeps its input as torch's does
    excluded = copy.deepcopy(plain)
    _, report = memtrim.convert(excluded, example_inputs=(IDX,), module_filter=lambda name, m: name != "ln")
    assert not sum_changes(report)
    assert any(s.rule == "embedding_sum" and s.reason == "excluded by module_filter" for s in report.skipped)
    assert_same_training(converted, plain)
    assert_same_training(converted, plain, create_graph=True)


def test_small_gpt_keeps_no_embedding_sum_and_trains_bitwise():
    torch.manual_seed(0)
    plain = SmallGPT(n_layer=2, d_model=32, n_head=2, seq_len=T, vocab_size=V)
    plain.head.weight = plain.tok.weight  # tied, as GPT-2 ties them
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    assert [c.bytes_saved for c in sum_changes(report)] == [B * T * 32 * 4]
    for a, b in zip(train(converted), train(plain)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["dropout", "alpha", "frozen"])
def test_other_sums_are_kept_as_torch_keeps_them(case):
    torch.manual_seed(0)
    plain = Embedder(dropout=0.1 if case == "dropout" else 0.0, alpha=2 if case == "alpha" else 1)
    if case == "frozen":
        plain.tok.weight.requires_grad_(False)
        plain.pos.weight.requires_grad_(False)
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    assert not sum_changes(report)  # dropout's output is kept; alpha=2 and no graph save nothing (undone)
    assert_same_training(converted, plain)


@pytest.mark.parametrize("style", ["gpt", "bert"])
@pytest.mark.parametrize("edit", ["lookup", "sum"])
def test_an_edit_after_the_trace_keeps_the_sum(edit, style):
    """The runtime checks: the trace saw no edit; a later forward changes the token lookup before the sum, or the
    sum itself, in place under no_grad (its grad_fn graph stays the additions')."""
    torch.manual_seed(0)
    plain = Embedder(style)
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    assert sum_changes(report)
    plain.edit = converted.edit = edit
    assert activation_bytes(converted, IDX, model=converted) == activation_bytes(plain, IDX, model=plain) - \
        sum(c.bytes_saved for c in report.changes if c.rule != "embedding_sum")
    assert_same_training(converted, plain)


def test_embedding_sum_forward_without_backward_frees_everything():
    torch.manual_seed(0)
    model = Embedder()
    memtrim.convert(model, example_inputs=(IDX,))
    with memtrim.track(model) as tracker:
        out = model(IDX)
        assert tracker.live_by_category()["activations"] > 0
        del out
        gc.collect()
        assert tracker.live_by_category()["activations"] == 0
    assert not _core._REGISTRY


def test_recompute_sum_installer_alone():
    torch.manual_seed(0)
    plain = Embedder()
    model = copy.deepcopy(plain)
    handle = R.recompute_sum([model.ln], [model.tok, model.pos], owner="tok + pos")
    scope = R.keep_recipes_in(model.ln)
    assert activation_bytes(model, IDX, model=model) == activation_bytes(plain, IDX, model=plain) - SUM
    assert_same_training(model, plain)
    handle.remove()
    scope.remove()
    assert activation_bytes(model, IDX, model=model) == activation_bytes(plain, IDX, model=plain)


def test_while_a_cuda_graph_is_captured_the_sum_is_kept_as_usual(monkeypatch):
    # its bit-for-bit check makes the host wait for the GPU, which fails a capture (and a decision taken at the capture
    # is every replay's): the sum is kept there as torch keeps it (capturing() itself is True only on a CUDA device,
    # tests/techniques/test_bn_relu.py captures converted models on one)
    from memtrim.techniques.recompute import _sites

    torch.manual_seed(0)
    plain = Embedder()
    model = copy.deepcopy(plain)
    handle = R.recompute_sum([model.ln], [model.tok, model.pos], owner="tok + pos")
    scope = R.keep_recipes_in(model.ln)
    monkeypatch.setattr(_sites, "capturing", lambda x: True)
    assert activation_bytes(model, IDX, model=model) == activation_bytes(plain, IDX, model=plain)
    assert_same_training(model, plain)
    monkeypatch.undo()
    assert activation_bytes(model, IDX, model=model) == activation_bytes(plain, IDX, model=plain) - SUM
    handle.remove()
    scope.remove()


# ---------------------------------------------------------------------- recompute_modules
GPT = dict(n_layer=2, d_model=32, n_head=2, seq_len=T, vocab_size=V)


def test_recompute_modules_after_convert_saves_the_mlp_hidden_bitwise():
    torch.manual_seed(0)
    plain = SmallGPT(**GPT)
    model = copy.deepcopy(plain)
    memtrim.convert(model, example_inputs=(IDX,))
    converted = activation_bytes(model, IDX, model=model)
    handle = memtrim.recompute_modules(model, ["blocks.0.mlp.fc", "blocks.1.mlp.fc"], example_inputs=(IDX,))
    hidden = B * T * 4 * 32 * 4  # fc's output, float32
    assert handle.bytes_saved == 2 * hidden
    assert activation_bytes(model, IDX, model=model) == converted - 2 * hidden
    assert_same_training(model, plain)
    handle.remove()
    assert activation_bytes(model, IDX, model=model) == converted


def test_recompute_modules_on_a_plain_model_and_by_class():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D), nn.SiLU(), nn.Linear(D, 4))
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    handle = memtrim.recompute_modules(model, lambda name, m: name in ("0", "2"), example_inputs=x)
    assert handle.names == ["0", "2"]
    assert handle.bytes_saved == 5 * (48 + D) * 4  # the inputs of the GELU and the SiLU
    for a, b in zip(run_grads(model, x), run_grads(plain, x)):
        assert torch.equal(a, b)


def run_grads(model, x):
    return torch.autograd.grad(model(x).square().sum(), list(model.parameters()))


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.block = nn.Sequential(nn.Linear(D, D), nn.GELU())
        self.drop = nn.Dropout(0.5)
        self.bn = nn.BatchNorm1d(D)
        self.view = nn.Flatten(0, 0)
        self.last = nn.Linear(D, D)
        self.act = nn.GELU()

    def forward(self, x):
        h = self.fc(x)
        h = self.block(h * h)  # fc's output is kept by this module's own code
        h = self.act(self.bn(self.drop(self.view(h))))
        return self.last(h)  # last's output is kept by nothing


@pytest.mark.parametrize("name, expected", [
    ("block", "calls other modules"), ("drop", "draws random numbers"), ("bn", "writes a buffer"),
    ("view", "not return one tensor of its own"), ("last", "nothing to save"),
    ("nope", "expected names of submodules"),
    ("inputs", r"^memtrim.recompute_modules: the model failed on example_inputs"),  # it said memtrim.convert
])
def test_recompute_modules_refuses_what_it_cannot_rebuild(name, expected):
    model = Odd()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(memtrim.InvalidInputError, match=expected):
        memtrim.recompute_modules(model, ["drop" if name == "inputs" else name],
                                  example_inputs=torch.randn(4, D + (name == "inputs")))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # buffers untouched


def test_recompute_modules_refuses_a_module_the_example_inputs_do_not_reach_and_names_the_batch_as_a_fix():
    # a mixture's expert no example token was routed to: the message said only to choose a module the forward calls
    # (an adversarial pass on 2026-12-03)
    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D)) for _ in range(2))

        def forward(self, x):
            return self.experts[int(x.sum() > 1e9)](x)  # the example batch reaches expert 0 only

    with pytest.raises(memtrim.InvalidInputError, match="'experts.1.0' is not called .* example inputs that reach it"):
        memtrim.recompute_modules(Routed(), ["experts.0.0", "experts.1.0"], example_inputs=torch.randn(4, D))


def test_recompute_modules_refuses_uninitialized_lazy_modules_as_convert_does():
    # torch's "Attempted to use an uninitialized parameter" came out of the trace (found by an adversarial pass)
    model = nn.Sequential(nn.LazyLinear(48), nn.GELU(), nn.Linear(48, D))
    with pytest.raises(memtrim.InvalidInputError, match="recompute_modules: 2 parameters are uninitialized lazy"):
        memtrim.recompute_modules(model, ["0"], example_inputs=torch.randn(4, D))
    model(torch.randn(4, D))  # materialised: taken
    assert memtrim.recompute_modules(model, ["0"], example_inputs=torch.randn(4, D)).bytes_saved == 4 * 48 * 4


def test_recompute_modules_refuses_hooked_modules_and_missing_inputs():
    model = nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D))
    model[0].register_forward_hook(lambda m, a, o: o * 2)
    with pytest.raises(memtrim.InvalidInputError, match="forward hooks"):
        memtrim.recompute_modules(model, ["0"], example_inputs=torch.randn(4, D))
    with pytest.raises(memtrim.InvalidInputError, match="example_inputs are required"):
        memtrim.recompute_modules(model, ["2"], example_inputs=())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_embedding_sum_and_recomputed_modules_train_bitwise():
    torch.manual_seed(0)
    plain = nn.Sequential(Embedder("bert"), nn.Linear(V, 4 * V), nn.GELU(), nn.Linear(4 * V, V)).cuda()
    model = copy.deepcopy(plain)
    idx = IDX.cuda()
    _, report = memtrim.convert(model, example_inputs=(idx,))
    assert [c.bytes_saved for c in sum_changes(report)] == [SUM]
    handle = memtrim.recompute_modules(model, ["1"], example_inputs=(idx,))
    assert handle.bytes_saved == B * T * 4 * V * 4
    for a, b in zip(train(model, idx=idx), train(plain, idx=idx)):
        assert torch.equal(a, b)


class Scaled(nn.Linear):
    """A Linear whose forward reads a buffer and branches on ``training``."""

    def __init__(self, n_in, n_out):
        super().__init__(n_in, n_out)
        self.register_buffer("shift", torch.randn(n_out))

    def forward(self, x):
        out = super().forward(x) + self.shift
        return out * 2 if self.training else out


def scaled_mlp():
    return nn.Sequential(Scaled(D, 48), nn.GELU(), nn.Linear(48, D))


def test_recompute_modules_rebuilds_with_the_forwards_buffers_and_mode():
    torch.manual_seed(0)
    plain = scaled_mlp()
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    memtrim.recompute_modules(model, ["0"], example_inputs=x)
    grads = []
    for m in (model, plain):  # a buffer replaced between forward and backward: torch used the forward's output
        loss = m(x).square().sum()
        m[0].shift = torch.zeros(48)
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    loss = model(x).square().sum()
    with torch.no_grad():
        model[0].shift.add_(1)  # changed in place: autograd's error, not another output
    with pytest.raises(RuntimeError, match="modified by an inplace operation.*torch itself may not need it"):
        loss.backward()
    loss = model(x).square().sum()
    model.eval()  # the other branch of its forward: refused, not rebuilt
    with pytest.raises(memtrim.ConvertError, match="training: True -> False"):
        loss.backward()


def test_recompute_modules_leaves_a_parametrized_weight_alone():
    """Weight dropout registered after recompute_modules: the weight is drawn at each access, so the output is
    kept as torch keeps it."""
    from torch.nn.utils import parametrize

    class WeightDrop(nn.Module):
        def forward(self, w):
            return F.dropout(w, 0.5, True)

    torch.manual_seed(0)
    plain = scaled_mlp()
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    memtrim.recompute_modules(model, ["0"], example_inputs=x)
    for m in (model, plain):
        parametrize.register_parametrization(m[0], "weight", WeightDrop())
    grads = []
    for m in (model, plain):
        torch.manual_seed(3)
        grads.append(torch.autograd.grad(m(x).square().sum(), list(m.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_recompute_modules_by_a_second_name_and_twice():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D))
    model.alias = model[0]
    x = torch.randn(5, D)
    handle = memtrim.recompute_modules(model, ["alias"], example_inputs=x)
    assert handle.names == ["alias"] and handle.bytes_saved == 5 * 48 * 4
    with pytest.raises(memtrim.InvalidInputError, match="recomputed already"):
        memtrim.recompute_modules(model, ["0"], example_inputs=x)
    handle.remove()
    assert memtrim.recompute_modules(model, ["0", "alias"], example_inputs=x).names == ["0"]


@pytest.mark.parametrize("where", ["embedding", "norm", "chosen", "global"])
def test_a_hook_that_runs_before_memtrims_leaves_the_output_kept(where):
    """A forward hook registered after memtrim with prepend=True (or a global one) runs before memtrim's and may
    return another output than forward's: that output is kept as torch keeps it, not rebuilt by forward."""
    torch.manual_seed(0)
    plain = nn.Sequential(Embedder(), nn.Linear(V, 48), nn.GELU(), nn.Linear(48, V))
    model = copy.deepcopy(plain)
    memtrim.convert(model, example_inputs=(IDX,))
    memtrim.recompute_modules(model, ["1"], example_inputs=(IDX,))
    removers = []
    if where == "global":
        hook = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out * 1.5 if type(mod) is nn.LayerNorm else None)
        removers.append(hook.remove)
    else:
        for m in (model, plain):
            target = {"embedding": m[0].tok, "norm": m[0].ln, "chosen": m[1]}[where]
            removers.append(target.register_forward_hook(lambda mod, args, out: out * 1.5, prepend=True).remove)
    try:
        assert_same_training(model, plain)
    finally:
        for remove in removers:
            remove()


def test_recompute_modules_refuses_a_rebuild_after_the_modules_state_changed():
    class Gain(nn.Linear):
        def forward(self, x):
            return super().forward(x) * self._gain * self.scale

    torch.manual_seed(0)
    model = nn.Sequential(Gain(D, 48), nn.GELU(), nn.Linear(48, D))
    model[0]._gain, model[0].scale = 2.0, torch.full((48,), 0.5)  # a private number, a tensor that is no buffer
    x = torch.randn(5, D)
    memtrim.recompute_modules(model, ["0"], example_inputs=x)
    for change, expected in ((lambda g: setattr(g, "_gain", 3.0), "_gain: 2.0 -> 3.0"),
                             (lambda g: g.scale.mul_(2), "scale: a tensor at version 0 -> a tensor at version 1"),
                             (lambda g: setattr(g, "scale", torch.ones(48)), "scale: a tensor"),
                             (lambda g: setattr(g, "extra", 1), "extra: unset -> 1")):
        model[0]._gain, model[0].scale = 2.0, torch.full((48,), 0.5)
        model[0].__dict__.pop("extra", None)
        loss = model(x).square().sum()
        change(model[0])
        with pytest.raises(memtrim.ConvertError, match=expected):
            loss.backward()


class Gated(nn.Module):
    """Llama's MLP: convert keeps gate's and up's outputs, as the SiLU's input and the product's sources."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, 48, bias=False), nn.Linear(D, 48, bias=False)
        self.down_proj, self.act_fn = nn.Linear(48, D, bias=False), nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_recompute_modules_after_convert_rebuilds_the_gated_mlps_up_projection():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, D), Gated())
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    _, report = memtrim.convert(model, example_inputs=x)
    assert any(c.rule == "gated_mlp" for c in report.changes)
    held = activation_bytes(model, x, model=model)
    handle = memtrim.recompute_modules(model, ["1.up_proj"], example_inputs=x)
    assert handle.bytes_saved == 5 * 48 * 4  # up's output: the product's recipe keeps up's input instead
    assert activation_bytes(model, x, model=model) == held - 5 * 48 * 4
    for a, b in zip(run_grads(model, x), run_grads(plain, x)):
        assert torch.equal(a, b)


def test_recompute_modules_refuses_a_rebuild_that_saves_nothing():
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))
    model[1].requires_grad_(False)  # a frozen Linear keeps no input: a recipe would keep it in the output's place
    x = torch.randn(5, D)
    held = activation_bytes(model, x, model=model)
    with pytest.raises(memtrim.InvalidInputError, match="saves 0 B .*inputs would be kept in their place"):
        memtrim.recompute_modules(model, ["1"], example_inputs=x)
    assert activation_bytes(model, x, model=model) == held  # undone


def test_recompute_modules_under_autocast_keeps_the_output_and_trains_as_torch():
    # autocast picks the Linear's dtype (bfloat16) and keeps its own casts: a rebuild without the forward's autocast
    # state made a float32 tensor (ConvertError in backward); the call under autocast now keeps its output
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D))
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    memtrim.recompute_modules(model, ["0"], example_inputs=x)
    grads = []
    for m in (plain, model):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().square().mean()
        grads.append(torch.autograd.grad(loss, list(m.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    for a, b in zip(run_grads(model, x), run_grads(plain, x)):  # and outside autocast it still rebuilds
        assert torch.equal(a, b)


@pytest.mark.parametrize("technique", ["recompute_modules", "convert"])
def test_a_backward_called_inside_autocast_rebuilds_as_the_forward_ran(technique):
    # forward outside autocast, backward inside it (a loop whose autocast block wraps the backward too): the rebuild
    # ran under the backward's autocast and came out bfloat16, refused with a ConvertError naming convert, which the
    # user had not called (recompute_modules; found by an adversarial pass); torch trains there
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, 48), nn.SiLU(), nn.Linear(48, 4))
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    if technique == "convert":
        assert memtrim.convert(model, example_inputs=(x,))[1].changes
    else:
        memtrim.recompute_modules(model, ["0"], example_inputs=x)
    grads = []
    for m in (plain, model):
        loss = m(x).square().mean()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            grads.append(torch.autograd.grad(loss, list(m.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_recompute_modules_convert_and_checkpoint_of_the_gated_mlp_compose():
    # inside a checkpointed region the SiLU's producer scope used to pack gate's recipe sources (2 saves) where the
    # recomputation saved gate's output itself (1): torch's CheckpointError in backward
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), Gated())
    model = copy.deepcopy(plain)
    x = torch.randn(5, D)
    memtrim.convert(model, example_inputs=x)
    memtrim.recompute_modules(model, ["2.gate_proj"], example_inputs=x)
    memtrim.checkpoint_modules(model, ["2"])
    for _ in range(2):  # twice: nothing left over from the first backward
        for a, b in zip(run_grads(model, x), run_grads(plain, x)):
            assert torch.equal(a, b)


def test_an_embedding_given_max_norm_after_convert_keeps_its_output():
    # max_norm renormalises the weight in place in the forward: the rebuild would renormalise it again in backward (not
    # idempotent to the last bit: silently different training; two forwards before one backward raised). A setting
    # changed since the rule looked now leaves the output kept
    torch.manual_seed(0)
    plain = Embedder("gpt")
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    assert sum_changes(report)
    for m in (plain, converted):
        m.tok.max_norm = 0.5
    assert_same_training(converted, plain)
    for m in (plain, converted):  # two forwards before one backward
        torch.manual_seed(2)
        loss = m(IDX).square().mean() + m(IDX.flip(0)).square().mean()
        loss.backward()
    for a, b in zip(plain.parameters(), converted.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


def test_an_embedding_weight_changed_between_forward_and_backward_raises_as_its_limit_says():
    torch.manual_seed(0)
    converted = Embedder("gpt")
    _, report = memtrim.convert(converted, example_inputs=(IDX,))
    (change,) = sum_changes(report)
    assert any("in-place error" in limit and ".data" in limit for limit in change.limits)
    loss = converted(IDX).square().mean()
    with torch.no_grad():
        converted.tok.weight.mul_(0.5)  # an EMA-style edit before backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_recipe_sources_that_are_parameters_stay_on_the_device_under_offloading():
    # a recipe kept its parameters as detached aliases, which OffloadActivations copied to host memory like
    # activations: the whole embedding table at every forward (here 32 x 16 floats + 12 x 16 for the positions)
    torch.manual_seed(0)
    plain = Embedder("gpt")
    converted = copy.deepcopy(plain)
    memtrim.convert(converted, example_inputs=(IDX,))
    moved = {}
    for name, m in (("plain", plain), ("converted", converted)):
        with memtrim.OffloadActivations(min_bytes=0, include_cpu=True) as hooks:
            loss = m(IDX).square().mean()
        loss.backward()
        moved[name] = hooks.offloaded_bytes
    assert moved["converted"] < moved["plain"]  # the sum (B*T*D floats) is rebuilt; no weight is copied
    assert moved["plain"] - moved["converted"] >= SUM
    for a, b in zip(plain.parameters(), converted.parameters()):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)


class ScaledEmbedding(nn.Embedding):
    """BART's word embedding: the lookup times a scale (1.0 included)."""

    def forward(self, input):
        return super().forward(input) * 1.0


def test_a_lookup_that_computes_more_is_reported_not_silently_kept():
    # BART's scaled word embedding and learned positions were neither converted nor listed in the report
    torch.manual_seed(0)
    model = Embedder("gpt")
    model.tok = ScaledEmbedding(V, D)
    _, report = memtrim.convert(model, example_inputs=(IDX,))
    assert not sum_changes(report)
    (line,) = [s for s in report.skipped if s.modules == ("tok",)]
    assert "computes more than a lookup (embedding, mul)" in line.reason
    _, plain_report = memtrim.convert(Embedder("gpt"), example_inputs=(IDX,))  # plain lookups: converted, no such line
    assert sum_changes(plain_report)
    assert not [s for s in plain_report.skipped if "computes more than a lookup" in s.reason]


class Noisy(nn.Module):
    """A leaf module that draws random numbers through an op the old list of random ops did not name."""

    def __init__(self, draw):
        super().__init__()
        self.weight, self.draw = nn.Parameter(torch.randn(D, D) / D ** 0.5), draw

    def forward(self, x):
        return self.draw(nn.functional.linear(x, self.weight))


class Counting(nn.Module):
    """A leaf module that assigns its buffers anew at each call (a call counter and a running average)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5)
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        h = nn.functional.linear(x, self.weight)
        self.count = self.count + 1
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h


@pytest.mark.parametrize("draw", [
    lambda h: nn.functional.rrelu(h, training=True), lambda h: h * torch.empty_like(h).exponential_(),
    lambda h: h[:, torch.randperm(h.shape[1])], lambda h: nn.functional.gumbel_softmax(h),
], ids=["rrelu", "exponential_", "randperm", "gumbel_softmax"])
def test_recompute_modules_refuses_every_random_draw_aten_knows(draw):
    # only bernoulli, dropout, rand*, uniform, normal, randint and multinomial were refused: the rebuild of these drew
    # other numbers (gradients 0.026 to 0.87 off)
    model = nn.Sequential(Noisy(draw), nn.Linear(D, D))
    with pytest.raises(memtrim.InvalidInputError, match="draws random numbers"):
        memtrim.recompute_modules(model, ["0"], example_inputs=torch.randn(4, D))


def test_recompute_modules_refuses_a_module_that_assigns_its_buffers_anew():
    # the rebuild ran the update once more per step: count 6 after 3 steps where plain training has 3
    model = nn.Sequential(Counting(), nn.GELU(), nn.Linear(D, D))
    with pytest.raises(memtrim.InvalidInputError, match="assigns its own tensor.s. count, ema anew"):
        memtrim.recompute_modules(model, ["0"], example_inputs=torch.randn(4, D))
    assert model[0].count.item() == 0  # the trace ran on a copy's state: put back


class Attending(nn.Module):
    """A leaf module calling scaled_dot_product_attention without dropout (aten tags the kernel as one that may draw)
    and keeping the transposed weight it makes afresh at each call."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(D, D) / D ** 0.5)

    def forward(self, x):
        self.wt = self.weight.t()
        q = (x @ self.wt).unsqueeze(1)
        return nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.0).squeeze(1)


def test_recompute_modules_takes_a_kernel_that_may_draw_but_does_not_and_a_cache_made_afresh():
    # both were refused once random ops and reassigned tensors were: the attention as "draws random numbers", the
    # transposed weight as a counter
    torch.manual_seed(0)
    model = nn.Sequential(Attending(), nn.GELU(), nn.Linear(D, D))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 3, D)
    memtrim.recompute_modules(model, ["0"], example_inputs=x)
    for a, b in zip(run_grads(model, x), run_grads(plain, x)):
        assert torch.equal(a, b)


def test_recompute_modules_inside_a_checkpointed_module_says_so():
    # it said the module's output is kept by no later layer, and to choose "an MLP's first Linear": the one chosen
    model = nn.Sequential(nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D)), nn.Linear(D, D))
    memtrim.checkpoint_modules(model, ["0"])
    with pytest.raises(memtrim.InvalidInputError, match="'0.0' is inside '0', which memtrim.checkpoint_modules"):
        memtrim.recompute_modules(model, ["0.0"], example_inputs=torch.randn(4, D))


class HFStyleLayer(nn.Module):
    """A layer checkpointed as HF's GradientCheckpointingLayer is after gradient_checkpointing_enable()."""

    def __init__(self, checkpointing="hf"):
        super().__init__()
        self.gradient_checkpointing = checkpointing == "hf"  # HF's flag ("torch": torch's checkpoint alone)
        self.checkpointing = checkpointing
        self.mlp = nn.Sequential(nn.Linear(D, 48), nn.GELU(), nn.Linear(48, D))

    def forward(self, x):
        if self.checkpointing is None:
            return self.mlp(x)
        return torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=False)


@pytest.mark.parametrize("around", ["hf_checkpointing", "offload_module", "torch_checkpoint"])
def test_recompute_modules_inside_checkpointing_or_offloading_says_which(around):
    # it said the module's output is kept by no later layer, and to choose "an MLP's first Linear": the one chosen
    # (found by an adversarial pass with HF's gradient_checkpointing_enable and offload_module(include_cpu=True))
    checkpointing = {"hf_checkpointing": "hf", "torch_checkpoint": "torch", "offload_module": None}[around]
    model = nn.Sequential(HFStyleLayer(checkpointing), nn.Linear(D, D))
    if around == "offload_module":
        memtrim.offload_module(model, min_bytes=0, include_cpu=True)
    expected = {"hf_checkpointing": r"inside '0', which HF's gradient checkpointing recomputes .*"
                                    r"gradient_checkpointing_disable",
                "offload_module": r"inside the model, which memtrim.offload_module offloads .* first, then "
                                  r"offload_module",
                "torch_checkpoint": r"no later layer keeps .* Inside a region torch's own checkpoint recomputes"}
    with pytest.raises(memtrim.InvalidInputError, match=expected[around]):
        memtrim.recompute_modules(model, ["0.mlp.0"], example_inputs=torch.randn(4, D))


class SharedActivation(nn.Module):
    """Two MLPs calling one GELU module: both Linears' outputs are kept by the same consumer."""

    def __init__(self):
        super().__init__()
        self.act = nn.GELU()
        self.a1, self.a2, self.b1, self.b2 = (nn.Linear(D, 48), nn.Linear(48, D), nn.Linear(D, 48),
                                              nn.Linear(48, D))

    def forward(self, x):
        x = x + self.a2(self.act(self.a1(x)))
        return x + self.b2(self.act(self.b1(x)))


def test_two_handles_sharing_a_consumer_keep_their_savings_when_one_is_removed():
    # the second handle found the GELU's consumer scope installed and did not own it: removing the first took it,
    # and the second's saving went with it while its bytes_saved still claimed it (found by an adversarial pass)
    torch.manual_seed(0)
    model, x = SharedActivation(), torch.randn(5, D)
    plain = copy.deepcopy(model)
    base = activation_bytes(model, x, model=model)
    first = memtrim.recompute_modules(model, ["a1"], example_inputs=x)
    second = memtrim.recompute_modules(model, ["b1"], example_inputs=x)
    assert first.bytes_saved == second.bytes_saved == 5 * 48 * 4  # each Linear's output, float32
    assert base - activation_bytes(model, x, model=model) == 2 * 5 * 48 * 4
    first.remove()
    assert base - activation_bytes(model, x, model=model) == second.bytes_saved
    for a, b in zip(run_grads(model, x), run_grads(plain, x)):
        assert torch.equal(a, b)
    second.remove()
    assert activation_bytes(model, x, model=model) == base
    assert "_memtrim_consumer_scope" not in model.act.__dict__ and not model.act._forward_pre_hooks

"""memtrim.techniques.recompute against plain PyTorch: bitwise outputs and gradients, bytes held from the tracker."""

import copy
import gc
import math
import pickle
import threading
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import memtrim
from memtrim.measure.hooks import top_saved_tensors_hooks
from memtrim.techniques import recompute as R
from memtrim.techniques.recompute import _core

from ..helpers import ClipsItsOutput, activation_bytes


# ---------------------------------------------------------------------- the patterns, written as the libraries do
class NewGELU(nn.Module):
    """HF's NewGELUActivation: 8 pointwise ops keeping 4 input-sized tensors."""

    def forward(self, input):
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


class Conv1D(nn.Module):
    """HF's Conv1D (GPT-2): addmm on a 2-D view of the input."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class MLP(nn.Module):
    def __init__(self, act, consumer="linear"):
        super().__init__()
        self.consumer = consumer
        self.fc1 = nn.Linear(16, 48)
        self.act = act
        self.fc2 = Conv1D(16, 48) if consumer == "conv1d" else nn.Linear(48, 16)

    def forward(self, x):
        a = self.act(self.fc1(x))
        if self.consumer == "functional":  # F.linear in the parent's own forward
            return F.linear(a, self.fc2.weight, self.fc2.bias)
        return self.fc2(a)


class GatedMLP(nn.Module):
    """Llama's MLP."""

    def __init__(self, hidden=16, inter=48):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: one ReLU module called twice."""

    def __init__(self, c=8):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def act_to_consumer(model, producer=R.recompute_output):
    producer(model.act)
    R.keep_recipes_in(model if model.consumer == "functional" else model.fc2)
    return model


def float64_pair(act, consumer, install):
    """An MLP around ``act`` in float64, a copy with ``install`` applied, and an input."""
    torch.manual_seed(0)
    plain = MLP(copy.deepcopy(act), consumer).double()
    return plain, install(copy.deepcopy(plain)), X.double()


def fuse_block(block):
    block.bn1.__class__ = memtrim.nn.BatchNormReLU2d
    block.relu.__class__ = R.PassThroughReLU
    R.keep_recipes_in(block.conv2)
    return block


def run(model, x, create_graph=False):
    leaf = x.clone().requires_grad_()
    out = model(leaf)
    loss = out.square().sum()
    params = [leaf, *model.parameters()]
    if create_graph:  # a gradient penalty: backward through the input gradient
        (gx,) = torch.autograd.grad(loss, leaf, create_graph=True)
        loss = loss + gx.square().sum()
    return out.detach(), [g.detach() for g in torch.autograd.grad(loss, params)]


def assert_bitwise(a, b):
    assert torch.equal(a[0], b[0])
    assert len(a[1]) == len(b[1])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


def held(model, x):
    return activation_bytes(model, x, model=model)


X = torch.randn(3, 5, 16)
INTER = 3 * 5 * 48 * 4  # one intermediate-sized float32 tensor


# ---------------------------------------------------------------------- 1. act -> consumer
@pytest.mark.parametrize("consumer", ["linear", "conv1d", "functional"])
@pytest.mark.parametrize("act", [nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Mish(), nn.Hardswish(), NewGELU(),
                                 nn.Tanh(), nn.Sigmoid(), nn.ReLU()], ids=lambda a: type(a).__name__)
def test_act_output_rebuilt_at_the_consumer_bitwise(act, consumer):
    plain, converted, x = float64_pair(act, consumer, act_to_consumer)
    assert_bitwise(run(converted, x), run(plain, x))
    assert_bitwise(run(converted, x, create_graph=True), run(plain, x, create_graph=True))  # double backward exact


@pytest.mark.parametrize("consumer", ["linear", "conv1d", "functional"])
@pytest.mark.parametrize("act", [nn.GELU(), nn.SiLU(), nn.Mish()], ids=lambda a: type(a).__name__)
def test_act_that_keeps_its_input_drops_its_output(act, consumer):
    torch.manual_seed(0)
    plain = MLP(act, consumer)
    converted = act_to_consumer(copy.deepcopy(plain))
    assert held(converted, X) == held(plain, X) - INTER


class ConvMLP(nn.Module):
    """timm ConvNeXt's conv_mlp: 1x1 convolutions on a channels-last activation (dense, not contiguous)."""

    def __init__(self, c=8, inter=24):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Conv2d(c, inter, 1), nn.GELU(), nn.Conv2d(inter, c, 1)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_channels_last_act_output_rebuilt_at_a_1x1_conv():
    torch.manual_seed(0)
    plain = ConvMLP().to(memory_format=torch.channels_last)
    converted = copy.deepcopy(plain)
    R.recompute_output(converted.act)
    R.keep_recipes_in(converted.fc2)
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    assert not plain.act(plain.fc1(x)).is_contiguous()  # the case: dense in another order
    assert_bitwise(run(converted, x), run(plain, x))
    assert held(converted, x) == held(plain, x) - 2 * 24 * 5 * 5 * 4


def test_output_keeping_act_keeps_the_recipe_for_its_own_backward_too():
    # tanh keeps its output, and so does the Linear after it: one tensor in all; with recipes: the input, once
    torch.manual_seed(0)
    plain = MLP(nn.Tanh())
    converted = act_to_consumer(copy.deepcopy(plain))
    assert held(converted, X) == held(plain, X)  # tanh's input replaces its output: nothing saved, nothing lost
    storages = []
    converted.act.register_forward_hook(lambda m, a, out: storages.append(weakref.ref(out.untyped_storage())))
    out = converted(X.clone().requires_grad_())
    gc.collect()
    assert storages[0]() is None and out.grad_fn is not None  # nobody keeps the tanh output


def test_inplace_act_keeps_its_output_as_usual():
    torch.manual_seed(0)
    plain = MLP(nn.ReLU(inplace=True))
    converted = act_to_consumer(copy.deepcopy(plain))
    assert held(converted, X) == held(plain, X)
    assert_bitwise(run(converted, X), run(plain, X))


def test_rebuilt_once_per_backward_and_shared_by_every_holder():
    calls, recipes = [], []

    class Two(nn.Module):  # the activation output read by two Linears
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(16, 48), nn.Linear(48, 8), nn.Linear(48, 8)

        def forward(self, x):
            h = self.fc1(x)
            a = F.gelu(h)
            R.mark_recomputable(a, lambda t: calls.append(1) or F.gelu(t), h, owner="gelu")
            recipes.append(R.recipe_of(a))
            with R.recipes_honoured():
                return self.fc2(a) + self.fc3(a)

    torch.manual_seed(0)
    model = Two()
    out = model(X.clone().requires_grad_())
    out.sum().backward(retain_graph=True)
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2  # a second backward over the retained graph rebuilds once more
    assert recipes[0].cache is None  # released after the last holder


# ---------------------------------------------------------------------- 1b. rebuilt from the producer's own node
def _clamp_output(module, args, output):
    with torch.no_grad():  # no graph: the output keeps its grad_fn, only its version moves
        output.clamp_(max=0.05)


def _clamp_input(module, args):
    with torch.no_grad():
        args[0].clamp_(max=0.01)


NODE_ACTS = [nn.GELU(), nn.GELU("tanh"), nn.SiLU(), nn.Mish(), nn.Hardswish(), nn.Hardsigmoid(), nn.Softplus(2, 10),
             nn.ELU(0.5), nn.SELU(), nn.CELU(0.7), nn.LeakyReLU(0.2), nn.Hardtanh(-2, 2), nn.ReLU6(), nn.LogSigmoid()]


def op_output_to_consumer(model):
    return act_to_consumer(model, R.recompute_op_output)


@pytest.mark.parametrize("consumer", ["linear", "conv1d", "functional"])
@pytest.mark.parametrize("act", NODE_ACTS, ids=lambda a: type(a).__name__)
def test_op_output_rebuilt_from_its_own_node_bitwise(act, consumer):
    plain, converted, x = float64_pair(act, consumer, op_output_to_consumer)
    assert_bitwise(run(converted, x), run(plain, x))
    try:
        twice = run(plain, x, create_graph=True)
    except RuntimeError as e:  # torch has no second derivative of hardsigmoid: the converted model says the same
        with pytest.raises(RuntimeError, match="not implemented"):
            run(converted, x, create_graph=True)
        assert "not implemented" in str(e) and isinstance(act, nn.Hardsigmoid)
    else:
        assert_bitwise(run(converted, x, create_graph=True), twice)  # double backward exact
    assert held(converted, x) == held(plain, x) - INTER * 2  # float64


class ClippedGELU(ClipsItsOutput, nn.GELU):
    """Activation clipping in the module's own forward, switched on later in training."""


def test_op_output_changed_in_place_by_its_own_forward_is_kept():
    # found by an adversarial pass: a clamp under no_grad after the op, in the module's forward, leaves the op's node;
    # the tag took the clamped version for the op's own (convert's trace, before the clip was on, saw one gelu), and
    # the consumer rebuilt the unclamped output (4x off plain in fc2's weight gradient). A tag now needs the version
    # the op left
    plain, converted, x = float64_pair(ClippedGELU(), "linear", op_output_to_consumer)
    for m in (plain, converted):
        m.act.clip = 0.3
    assert_bitwise(run(converted, x), run(plain, x))


def test_in_place_op_output_is_kept_as_torch_keeps_it():
    # an in-place activation's output is its input at version 1: not tagged (torch's silu_ keeps a copy of its input
    # anyway, so a rebuild saved nothing; convert makes such activations out of place first)
    plain, converted, x = float64_pair(nn.SiLU(inplace=True), "linear", op_output_to_consumer)
    assert_bitwise(run(converted, x), run(plain, x))
    assert held(converted, x) == held(plain, x)


@pytest.mark.parametrize("global_hook", [False, True], ids=["prepended", "global"])
def test_op_output_changed_in_place_by_a_hook_before_the_tag_is_kept(global_hook):
    # found by an adversarial pass: a user's forward hook that runs before memtrim's (prepend=True, or a global one)
    # and clamps the output in place under no_grad leaves the op's node; the tag took the clamped version for the op's
    # own, and the consumer rebuilt the unclamped output (0.17 off plain in float64)
    plain, converted, x = float64_pair(nn.GELU(), "linear", op_output_to_consumer)
    handles = []
    for m in (plain, converted):
        if global_hook:
            handles.append(torch.nn.modules.module.register_module_forward_hook(
                lambda module, args, out, m=m: _clamp_output(module, args, out) if module is m.act else None))
        else:
            m.act.register_forward_hook(_clamp_output, prepend=True)
    try:
        assert_bitwise(run(converted, x), run(plain, x))
    finally:
        for h in handles:
            h.remove()


class NormLinear(nn.Module):
    def __init__(self, norm, consumers=1):
        super().__init__()
        self.norm = norm
        self.fcs = nn.ModuleList(nn.Linear(16, 8) for _ in range(consumers))  # q, k, v

    def forward(self, x):
        h = self.norm(x)
        return sum(fc(h) for fc in self.fcs)


class PreNormLinear(NormLinear):
    """A norm after a layer (a norm without parameters on an input without grad has no node: nothing to rebuild)."""

    def __init__(self, norm, consumers=1):
        super().__init__(norm, consumers)
        self.pre = nn.Linear(16, 16)

    def forward(self, x):
        return super().forward(self.pre(x))


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: the norm on a channels-last view, its output permuted back (a view of the op's output)."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias,
                            self.eps).permute(0, 3, 1, 2)


class VarianceEpsilonNorm(nn.Module):
    """A LayerNorm as some libraries spell it: its eps under another name."""

    def __init__(self, n):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(n) + 0.5), nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-3

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.variance_epsilon)


@pytest.mark.parametrize("norm, eps", [(nn.LayerNorm(16), "eps"), (nn.LayerNorm(16, elementwise_affine=False), "eps"),
                                       (nn.LayerNorm(16, bias=False), "eps"),
                                       (VarianceEpsilonNorm(16), "variance_epsilon")],
                         ids=["affine", "no-affine", "no-bias", "variance_epsilon"])
def test_layer_norm_rebuilt_from_its_own_node_once_for_every_consumer(norm, eps):
    torch.manual_seed(0)
    plain = PreNormLinear(norm, consumers=3).double()
    converted = copy.deepcopy(plain)
    R.recompute_op_output(converted.norm, eps=eps)
    for fc in converted.fcs:
        R.keep_recipes_in(fc)
    x = X.double()
    assert_bitwise(run(converted, x), run(plain, x))
    assert_bitwise(run(converted, x, create_graph=True), run(plain, x, create_graph=True))
    assert held(converted, x) == held(plain, x) - 3 * 5 * 16 * 8

    class Norms(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    calls: list[str] = []
    loss = converted(x.clone().requires_grad_()).sum()
    with Norms():
        loss.backward()
    assert calls.count("native_layer_norm.default") == 1  # three consumers, one rebuild


def test_layer_norm_eps_changed_between_forward_and_backward_rebuilds_the_forward():
    torch.manual_seed(0)
    plain, converted = NormLinear(nn.LayerNorm(16)), NormLinear(nn.LayerNorm(16))
    converted.load_state_dict(plain.state_dict())
    R.recompute_op_output(converted.norm, eps="eps")
    R.keep_recipes_in(converted.fcs[0])
    results = []
    for model in (plain, converted):
        leaf = X.clone().requires_grad_()
        loss = model(leaf).square().sum()
        model.norm.eps = 0.5  # torch's Linear kept the forward's output; the rebuild reads the eps the forward read
        results.append(torch.autograd.grad(loss, [leaf, *model.parameters()]))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_view_of_a_layer_norm_output_rebuilt_at_a_1x1_conv():
    torch.manual_seed(0)
    plain = nn.Sequential(LayerNorm2d(8), nn.Conv2d(8, 8, 1))
    converted = copy.deepcopy(plain)
    R.recompute_op_output(converted[0], eps="eps")
    R.keep_recipes_in(converted[1])
    x = torch.randn(2, 8, 5, 5)
    assert_bitwise(run(converted, x), run(plain, x))
    assert held(converted, x) == held(plain, x) - 2 * 8 * 5 * 5 * 4


def test_a_node_is_tagged_only_as_the_op_it_rebuilds():
    x = torch.randn(3, 4, requires_grad=True)
    norm = F.layer_norm(x, (4,))
    assert not _core.tag_output(norm, "norm")  # a LayerNorm's node without its eps
    assert not _core.tag_output(F.gelu(x), "gelu", eps=1e-5)  # any other op's with one
    assert not _core.tag_output(torch.tanh(x), "tanh")  # tanh's node keeps its output, not its input
    assert not _core.tag_output(F.gelu(x.detach()), "gelu")  # no node
    a = F.gelu(x)
    a.mul_(2)
    assert not _core.tag_output(a, "gelu")  # changed in place: its node is the multiplication's
    assert _core.tag_output(F.gelu(x), "gelu") and _core.tag_output(norm, "norm", eps=1e-5)


def test_a_backward_after_another_freed_the_node_names_the_fix():
    # an auxiliary loss on the norm's output backpropagated first frees the norm's node; the head's gradient alone
    # then needs the norm's output, which torch kept and the recipe must rebuild from that node
    torch.manual_seed(0)
    plain = PreNormLinear(nn.LayerNorm(16))
    converted = copy.deepcopy(plain)
    R.recompute_op_output(converted.norm, eps="eps")
    R.keep_recipes_in(converted.fcs[0])
    grads = []
    for model, retain in ((plain, False), (converted, True)):
        h = model.norm(model.pre(X))
        out = model.fcs[0](h)
        h.sum().backward(retain_graph=retain)
        grads.append(torch.autograd.grad(out.sum(), model.fcs[0].weight))
    assert torch.equal(*grads[0], *grads[1])
    h = converted.norm(converted.pre(X))
    out = converted.fcs[0](h)
    h.sum().backward()
    with pytest.raises(memtrim.ConvertError, match=r"LayerNorm .*earlier backward.*freed.*retain_graph=True"):
        torch.autograd.grad(out.sum(), converted.fcs[0].weight)


def test_a_recipe_made_from_an_op_output_keeps_its_node_not_the_output():
    # fc's output rebuilt from the norm's output, itself rebuilt from the norm's node (recompute_modules after
    # convert): the registry recipe's source is the node, so the norm's output is not held by it
    torch.manual_seed(0)
    plain = NormLinear(nn.LayerNorm(16))
    plain.act = nn.GELU()
    plain.forward = lambda x: plain.act(plain.fcs[0](plain.norm(x)))
    converted = copy.deepcopy(plain)
    converted.forward = lambda x: converted.act(converted.fcs[0](converted.norm(x)))
    R.recompute_op_output(converted.norm, eps="eps")
    R.keep_recipes_in(converted.fcs[0])
    R.recompute_output(converted.fcs[0], parameters=True)
    R.keep_recipes_in(converted.act)
    x = X.clone()
    assert_bitwise(run(converted, x), run(plain, x))
    assert held(converted, x) == held(plain, x) - 3 * 5 * 16 * 4 - 3 * 5 * 8 * 4  # the norm's and fc's outputs


# ---------------------------------------------------------------------- 2. pointwise module: checkpoint the call
def test_pointwise_module_keeps_only_its_input():
    torch.manual_seed(0)
    plain = MLP(NewGELU())
    converted = copy.deepcopy(plain)
    R.checkpoint_call(converted.act)
    assert held(plain, X) == 5 * INTER  # NewGELU's input and 3 intermediates, fc2's input
    assert held(converted, X) == 2 * INTER  # NewGELU's input (kept by checkpoint), fc2's input
    both = act_to_consumer(copy.deepcopy(converted))
    assert held(both, X) == INTER  # and with fc2 keeping the recipe: the input alone
    loaded = pickle.loads(pickle.dumps(converted))  # (torch.save(model)): the forward is bound to the copy's act
    forward = loaded.act.forward
    assert getattr(forward, "__self__", forward).module is loaded.act and held(loaded, X) == 2 * INTER
    for model in (converted, both, loaded):
        assert_bitwise(run(model, X), run(plain, X))


class CountingNewGELU(NewGELU):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input):
        self.calls += 1
        return super().forward(input)


@pytest.mark.parametrize("create_graph", [False, True])
def test_checkpointed_activation_and_its_consumer_share_one_recompute(create_graph):
    """NOTE [ one recompute for a checkpointed activation and its consumers ]: checkpointed and rebuilt for fc2, the
    activation runs twice per step (forward, then once in backward for both), not three times; gradients bitwise
    (with a gradient penalty: to rounding); the bytes held are the input's alone, as before."""
    torch.manual_seed(0)
    plain = MLP(CountingNewGELU(), consumer="conv1d")
    converted = copy.deepcopy(plain)
    R.checkpoint_call(converted.act)
    act_to_consumer(converted)
    converted.act.calls = 0
    got, want = run(converted, X, create_graph), run(plain, X, create_graph)
    if create_graph:
        # the penalty's second-order terms reach fc1's output through the recomputed forward, not the original one:
        # the same terms summed in another order, so equal to float32 rounding (torch's default tolerances), not bitwise
        torch.testing.assert_close(got, want)
    else:
        assert_bitwise(got, want)
    if not create_graph:  # (a gradient penalty runs backward twice, each rebuilding: counted by plain rules)
        assert converted.act.calls == 2
    assert held(converted, X) == INTER


def shared_recompute_pair():
    """A GPT-2 style MLP, and its copy whose NewGELU is checkpointed and rebuilt for its Conv1D (one recompute)."""
    torch.manual_seed(0)
    plain = MLP(NewGELU(), consumer="conv1d")
    converted = copy.deepcopy(plain)
    R.checkpoint_call(converted.act)
    act_to_consumer(converted)
    return plain, converted


def test_shared_recompute_without_the_consumer_in_backward():
    """A backward that never reaches the consumer (gradients of the activation's output alone): the activation's
    backward recomputes by itself, bitwise."""
    plain, converted = shared_recompute_pair()
    grads = []
    for model in (plain, converted):
        leaf = X.clone().requires_grad_()
        a = model.act(model.fc1(leaf))
        grads.append(torch.autograd.grad(a.square().sum(), [leaf, *model.fc1.parameters()]))
    for g, h in zip(*grads):
        assert torch.equal(g, h)


def test_checkpoint_call_under_an_outer_checkpoint_and_removal():
    torch.manual_seed(0)
    plain = MLP(NewGELU())
    converted = act_to_consumer(copy.deepcopy(plain))
    handle = R.checkpoint_call(converted.act)

    class Outer(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False)

    outer = Outer

    assert_bitwise(run(outer(converted), X), run(outer(plain), X))
    assert held(outer(converted), X) <= held(outer(plain), X)
    handle.remove()
    assert "forward" not in converted.act.__dict__


# ---------------------------------------------------------------------- 3. gated MLP
def test_gated_mlp_keeps_gate_and_up_outputs_only():
    torch.manual_seed(0)
    plain = GatedMLP()
    converted = copy.deepcopy(plain)
    R.recompute_gated_mlp(converted)
    assert held(plain, X) == 4 * INTER  # g (silu), a and u (mul), m (down)
    assert held(converted, X) == 2 * INTER  # g and u
    for create_graph in (False, True):
        assert_bitwise(run(converted.double(), X.double(), create_graph), run(plain.double(), X.double(),
                                                                               create_graph))


def test_gated_mlp_with_another_product_keeps_it():
    class Scaled(GatedMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x) * 2)

    torch.manual_seed(0)
    plain = Scaled()
    converted = copy.deepcopy(plain)
    R.recompute_gated_mlp(converted)
    assert held(converted, X) == held(plain, X) - INTER  # a still rebuilt; the product (not a * u) is kept
    assert_bitwise(run(converted, X), run(plain, X))


@pytest.mark.parametrize("where", ["act after", "act first", "up after", "down before", "down first"])
def test_gated_mlp_keeps_what_was_changed_in_place_without_a_graph(where):
    # found by an adversarial pass: an act output, up output or product clamped in place under no_grad (a forward
    # hook, activation clipping) kept its node, and the product was rebuilt from the values before the clamp (7e-2
    # off plain in float64 after 4 steps); down's input was recorded at its version then
    torch.manual_seed(0)
    plain = GatedMLP().double()
    model = copy.deepcopy(plain)
    name, early = {"act after": ("act_fn", False), "act first": ("act_fn", True), "up after": ("up_proj", False),
                   "down before": ("down_proj", None), "down first": ("down_proj", True)}[where]
    for m in (plain, model):
        if m is model and early is not None:
            R.recompute_gated_mlp(model)
        sub = m.get_submodule(name)
        if name == "down_proj":
            sub.register_forward_pre_hook(_clamp_input, prepend=bool(early))
        else:
            sub.register_forward_hook(_clamp_output, prepend=early)
    if early is None:
        R.recompute_gated_mlp(model)
    assert_bitwise(run(model, X.double()), run(plain, X.double()))


def test_gated_mlps_sharing_one_act_module_keep_nothing_outside_their_calls():
    # recompute_gated_mlp on two MLPs whose act is one module: each act call runs both MLPs' act hooks; the MLP not
    # running must keep nothing (its call's end, which clears its state, never comes)
    torch.manual_seed(0)
    plain = nn.Sequential(GatedMLP(), GatedMLP())
    plain[1].act_fn = plain[0].act_fn
    model = copy.deepcopy(plain)
    for mlp in model:
        R.recompute_gated_mlp(mlp)
    assert_bitwise(run(model, X), run(plain, X))
    assert top_saved_tensors_hooks() is None
    assert held(model, X) == held(plain, X) - 4 * INTER  # each MLP: a and m
    gc.collect()
    assert not _core._REGISTRY  # the first MLP's hooks, run by its act outside its call, hold no output


def test_gated_mlp_calling_its_act_twice_opens_one_scope():
    class Twice(GatedMLP):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) + self.act_fn(x).sum()

    torch.manual_seed(0)
    plain = Twice()
    model = copy.deepcopy(plain)
    R.recompute_gated_mlp(model)
    assert_bitwise(run(model, X), run(plain, X))
    assert top_saved_tensors_hooks() is None


class UpFirst(GatedMLP):
    def forward(self, x):
        u = self.up_proj(x)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * u)


@pytest.mark.parametrize("cls", [GatedMLP, UpFirst])
@pytest.mark.parametrize("hooked", [None, "act_fn", "up_proj", "pickled before"])
def test_gated_mlp_scope_starts_once_a_and_u_are_made(monkeypatch, cls, hooked):
    # the consumer scope's hooks cost Python at every save: they start in the later of the act's and up's hooks, so
    # gate's, up's and the act's saves (5 of a Llama MLP's 9) pass none. A forward hook another installer puts on
    # the act or up after ours may close a scope it opened before (a producer scope): then the scope spans the call
    torch.manual_seed(0)
    plain = cls().double()
    model = copy.deepcopy(plain)
    R.recompute_gated_mlp(model)
    if hooked == "pickled before":  # hooks pickled before the ids of ours on the act and up were kept: unknown
        gated = next(h.__self__ for h in model._forward_pre_hooks.values())
        gated.__setstate__({"owner": gated.owner})
    elif hooked is not None:
        for m in (plain, model):
            m.get_submodule(hooked).register_forward_hook(lambda mod, args, out: None)
    seen = []
    handle_of = _core._handle_of

    def counted(tensor, outer):
        seen.append(tuple(tensor.shape))
        return handle_of(tensor, outer)

    monkeypatch.setattr(_core, "_handle_of", counted)
    model(X.double().requires_grad_())
    # gate's and up's saves, their input (a 2-D view) and weight (transposed), pass the scope's hooks only when it
    # spans the call
    assert ((15, 16) in seen, (16, 48) in seen) == ((False, False) if hooked is None else (True, True))
    assert held(model.float(), X) == held(plain.float(), X) - 2 * INTER  # a and m, either way
    assert_bitwise(run(model.double(), X.double()), run(plain.double(), X.double()))
    assert top_saved_tensors_hooks() is None


@pytest.mark.parametrize("replaced", ["act_fn", "up_proj"])
def test_gated_mlp_whose_act_or_up_is_replaced_after_runs_as_torch(replaced):
    # found by an adversarial pass: an act swapped for a function after convert (del, then assign) made the check of
    # which hooks follow ours raise AttributeError at every call
    torch.manual_seed(0)
    plain = GatedMLP().double()
    model = copy.deepcopy(plain)
    R.recompute_gated_mlp(model)
    for m in (plain, model):
        delattr(m, replaced)
        setattr(m, replaced, F.silu if replaced == "act_fn" else copy.deepcopy(plain.gate_proj))
    assert_bitwise(run(model, X.double()), run(plain, X.double()))
    assert top_saved_tensors_hooks() is None


def test_a_hook_registered_on_an_unpickled_model_replaces_none_of_memtrims():
    # torch numbers hook handles from 0 in each process and keys a module's hooks by that number: found by an
    # adversarial pass, a hook registered on a model torch.load-ed in another process took the id of memtrim's hook
    # on the act and replaced it (the MLP's saving gone, silently). A new process is simulated by numbering from the
    # loaded hooks' lowest id on
    from torch.utils.hooks import RemovableHandle

    torch.manual_seed(0)
    plain = GatedMLP()
    model = copy.deepcopy(plain)
    R.recompute_gated_mlp(model)
    data = pickle.dumps(model)
    saved = RemovableHandle.next_id
    ours = {name: list(m._forward_hooks) for name, m in model.named_modules()}
    RemovableHandle.next_id = min(i for ids in ours.values() for i in ids if i >= 0)  # (-n: a fixed key of memtrim's)
    try:
        loaded = pickle.loads(data)
        handles = [m.register_forward_hook(lambda mod, args, out: None) for m in loaded.modules()]
    finally:
        RemovableHandle.next_id = max(RemovableHandle.next_id, saved)
    for handle in handles:
        handle.remove()
    assert {name: list(m._forward_hooks) for name, m in loaded.named_modules()} == ours
    assert held(loaded, X) == held(plain, X) - 2 * INTER


def test_remove_leaves_no_memtrim_object_on_the_modules():
    # found by an adversarial pass: the mark that keeps hook ids apart after unpickling stayed after remove(), and a
    # model pickled then needed memtrim to load
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), GatedMLP(), nn.Linear(16, 16))
    handles = [R.recompute_gated_mlp(model[1]), R.keep_recipes_in(model[2]), R.recompute_output(model[0])]
    assert all("_memtrim_hook_ids" in m.__dict__ for m in (model[0], model[1], model[1].act_fn, model[2]))
    handles[0].remove()
    assert "_memtrim_hook_ids" not in model[1].act_fn.__dict__
    assert "_memtrim_hook_ids" in model[0].__dict__  # its hooks are still there
    for handle in handles[1:]:
        handle.remove()
    assert not [(n, k) for n, m in model.named_modules() for k in vars(m) if "memtrim" in k]


# ---------------------------------------------------------------------- 4. BatchNorm + ReLU with a shared ReLU
def test_shared_relu_fused_at_one_call_site_only():
    torch.manual_seed(0)
    plain = nn.Sequential(BasicBlock(), BasicBlock())
    converted = copy.deepcopy(plain)
    for block in converted:
        fuse_block(block)
    x = torch.randn(2, 8, 6, 6)
    one = 2 * 8 * 6 * 6 * 4
    assert held(converted, x) == held(plain, x) - 2 * one  # each block: the first ReLU's output
    for dtype in (torch.float32, torch.float64):
        # the second call site still relus, and the first one's output is rebuilt by the same batch_norm call
        assert_bitwise(run(converted.to(dtype), x.to(dtype)), run(plain.to(dtype), x.to(dtype)))
    with torch.no_grad():
        assert torch.equal(converted(x.double()), plain(x.double()))


def test_pass_through_relu_relus_anything_else():
    relu = nn.ReLU(inplace=True)
    relu.__class__ = R.PassThroughReLU
    x = torch.randn(10)
    assert torch.equal(relu(x.clone()), torch.relu(x))


# ---------------------------------------------------------------------- guards
@pytest.mark.parametrize("install", [act_to_consumer, op_output_to_consumer], ids=["forward", "node"])
def test_inplace_edit_of_a_source_or_of_the_tensor_raises_like_autograd(install):
    class EditsSource(MLP):
        def forward(self, x):
            h = self.fc1(x)
            y = self.fc2(self.act(h))
            h.mul_(2)  # GELU keeps h (its node too: the node's rebuild unpacks it, with autograd's check)
            return y

    class EditsOutput(MLP):
        def forward(self, x):
            a = self.act(self.fc1(x))
            y = self.fc2(a)
            a.mul_(2)  # fc2 kept a (as a recipe here)
            self.last = a  # checked while a is alive (see test_edit_of_a_dead_output_uses_its_value_at_save_time)
            return y + a.sum()

    class EditsOutputWithoutGrad(MLP):
        def forward(self, x):
            a = self.act(self.fc1(x))
            y = self.fc2(a)
            with torch.no_grad():
                a.mul_(2)  # a's node stays GELU's, its version moves
            self.last = a
            return y

    for cls in (EditsSource, EditsOutput, EditsOutputWithoutGrad):
        for convert in (False, True):
            model = cls(nn.GELU())
            if convert:
                install(model)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                model(X.clone().requires_grad_()).sum().backward()


def test_edit_of_a_dead_output_uses_its_value_at_save_time():
    # torch raises here; the recipe cannot see an edit of a tensor that died (it keeps no reference to it), and
    # rebuilds the value fc2 saw, so the gradient is that of the computation that ran
    class EditsOutput(MLP):
        def forward(self, x):
            a = self.act(self.fc1(x))
            y = self.fc2(a)
            a.mul_(2)
            return y + a.sum()

    class Clones(MLP):
        def forward(self, x):
            a = self.act(self.fc1(x))
            y = self.fc2(a)
            a = a.clone().mul_(2)
            return y + a.sum()

    torch.manual_seed(0)
    model = act_to_consumer(EditsOutput(nn.GELU()))
    reference = Clones(nn.GELU())
    reference.load_state_dict(model.state_dict())
    assert_bitwise(run(model, X), run(reference, X))


def test_bn_relu_double_backward_is_torchs():
    # the rebuilt output is the forward's bit for bit, so a gradient penalty through it is torch's
    torch.manual_seed(0)
    plain = nn.Sequential(nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)).double()
    fused = copy.deepcopy(plain)
    fused[0].__class__ = memtrim.nn.BatchNormReLU1d
    fused[1] = nn.Identity()
    R.keep_recipes_in(fused[2])
    x = torch.randn(4, 8, dtype=torch.float64)
    results = []
    for model in (plain, fused):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(model(leaf).square().sum(), leaf, create_graph=True)
        results.append(torch.autograd.grad(g.square().sum(), [leaf, *model.parameters()]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_forward_without_backward_frees_everything():
    torch.manual_seed(0)
    models = [act_to_consumer(MLP(nn.GELU())), GatedMLP(), fuse_block(BasicBlock())]
    R.recompute_gated_mlp(models[1])
    for model, x in zip(models, (X, X, torch.randn(2, 8, 6, 6))):
        with memtrim.track(model) as tracker:
            out = model(x.clone().requires_grad_())
            assert tracker.live_by_category()["activations"] > 0
            del out
            gc.collect()
            assert tracker.live_by_category()["activations"] == 0
        assert not _core._REGISTRY
        assert top_saved_tensors_hooks() is None


def test_outer_saved_tensor_hooks_see_what_they_see_in_the_unconverted_model():
    # hooks other than memtrim's may pack lossily (to bfloat16): a recipe rebuilt from packed sources would not be
    # the packed tensor, so under them the consumer scopes stand aside and the hooks get what torch saves (they got
    # the recipe's sources before: fc1's output twice, for GELU and for fc2's recipe)
    torch.manual_seed(0)
    plain = MLP(nn.GELU())
    model = act_to_consumer(copy.deepcopy(plain))
    seen, grads = [], []
    for m in (plain, model):
        saved = []

        def pack(t, saved=saved):
            saved.append((tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = m(X.clone().requires_grad_())
        out.sum().backward()
        seen.append(saved)
        grads.append([p.grad for p in m.parameters()])
    assert seen[0] == seen[1] and len(seen[0]) >= 4
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_steps_aside_under_torch_compile_and_torch_func():
    torch.manual_seed(0)
    plain = MLP(nn.GELU())
    converted = act_to_consumer(copy.deepcopy(plain))
    plain_gated = GatedMLP()
    R.recompute_gated_mlp(gated := copy.deepcopy(plain_gated))
    torch._dynamo.reset()
    for model, original in ((converted, plain), (gated, plain_gated)):
        compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break would raise
        out = compiled(X)
        assert torch.equal(out, torch.compile(original, fullgraph=True)(X))
        out.sum().backward()
    params = dict(converted.named_parameters())

    def loss(p, model, x):
        return torch.func.functional_call(model, p, (x,)).square().sum()

    a = torch.func.grad(loss)(params, converted, X)
    b = torch.func.grad(loss)(dict(plain.named_parameters()), plain, X)
    for k in a:
        assert torch.equal(a[k], b[k])


def test_threads_run_their_own_recipes():
    torch.manual_seed(0)
    plain = GatedMLP()
    reference = run(plain, X)
    results, errors = [None] * 4, []

    def work(i):
        try:
            model = copy.deepcopy(plain)
            R.recompute_gated_mlp(model)
            for _ in range(3):
                results[i] = run(model, X)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for result in results:
        assert_bitwise(result, reference)


def test_mark_refuses_what_it_cannot_rebuild():
    h = torch.randn(4, 6, requires_grad=True) * 1
    assert not R.mark_recomputable(h[1:], torch.relu, h, owner="view")  # not a whole storage
    a = torch.relu_(h.clone())
    assert not R.mark_recomputable(h, torch.relu, h, owner="in place")  # output is its own source
    with torch.no_grad():
        assert not R.mark_recomputable(torch.relu(h), torch.relu, h, owner="no grad")
    assert R.mark_recomputable(a, torch.relu, h, owner="ok") and R.is_recomputable(a)
    a.add_(1)
    assert not R.is_recomputable(a)  # changed since it was marked


class ScaledNorm(nn.Module):
    """A norm taking keyword and constant arguments, as HF forwards do (``norm(hidden_states=x, scale=...)``)."""

    def __init__(self, d=16):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.eps = 1e-5

    def forward(self, x, scale=1.0, shift=None):
        y = F.layer_norm(x, x.shape[-1:], self.weight * scale, None, self.eps)
        return y if shift is None else y + shift


class NormThenLinear(nn.Module):
    def __init__(self, call):
        super().__init__()
        self.norm, self.fc, self.call = ScaledNorm(), nn.Linear(16, 16), call

    def forward(self, x):
        return self.fc(self.call(self.norm, x))


NORM_CALLS = {
    "positional": lambda norm, x: norm(x),
    "constant": lambda norm, x: norm(x, 3.0),
    "keywords": lambda norm, x: norm(x=x, scale=0.5),
    "tensor keyword": lambda norm, x: norm(x, shift=x[..., :1] * 2, scale=2.0),
}


@pytest.mark.parametrize("call", NORM_CALLS.values(), ids=NORM_CALLS.keys())
def test_producer_called_with_keywords_and_constants_rebuilds_the_same_call(call):
    # the rebuild reruns the call with its constants and keyword names, the tensors swapped for the kept sources
    torch.manual_seed(0)
    plain = NormThenLinear(call).double()
    converted = copy.deepcopy(plain)
    R.recompute_output(converted.norm, parameters=True, keeps_output=False)
    R.keep_recipes_in(converted.fc)
    x = X.double()
    assert_bitwise(run(converted, x), run(plain, x))
    assert held(converted, X.double()) < held(plain, X.double())  # the norm's output was not kept by the Linear


def test_producer_setting_changed_before_backward_raises_naming_it_for_a_keyword_call():
    torch.manual_seed(0)
    model = NormThenLinear(NORM_CALLS["keywords"])
    R.recompute_output(model.norm, owner="blocks.0.norm", parameters=True, keeps_output=False)
    R.keep_recipes_in(model.fc)
    loss = model(X.clone().requires_grad_()).square().sum()
    model.norm.eps = 0.1
    with pytest.raises(memtrim.ConvertError, match=r"blocks\.0\.norm .*settings changed.*eps: 1e-05 -> 0\.1"):
        loss.backward()


class CacheWritingAttention(nn.Module):
    """A leaf attention (its own weights, no submodules) that appends its keys to the cache it is given."""

    def __init__(self, d=8):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Parameter(torch.randn(d, d) * 0.3) for _ in range(3))

    def forward(self, x, past_key_values=None):
        k = x @ self.wk
        if past_key_values is not None:
            k = past_key_values.update(k)
        v = (x @ self.wv).repeat(1, k.shape[1] // x.shape[1], 1)
        return ((x @ self.wq) @ k.transpose(1, 2)).softmax(-1) @ v


class AttentionThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.out = CacheWritingAttention(), nn.Linear(8, 8)

    def forward(self, x):
        from .test_checkpoint import DynamicCache

        return self.out(self.attn(x, past_key_values=DynamicCache()))


def test_a_producer_given_an_object_it_changes_keeps_its_output():
    # the rebuild passes the call's non-tensor arguments again: a cache would get the keys a second time and the
    # rebuilt output would differ (7.6e-6 here before: silently different gradients); such a call keeps its output
    torch.manual_seed(0)
    plain = AttentionThenLinear()
    converted = copy.deepcopy(plain)
    R.recompute_output(converted.attn, parameters=True, strict=True)
    R.keep_recipes_in(converted.out)
    x = torch.randn(2, 5, 8)
    assert_bitwise(run(converted, x), run(plain, x))
    with pytest.raises(memtrim.InvalidInputError, match="key/value cache"):  # and recompute_modules says why
        memtrim.recompute_modules(copy.deepcopy(plain), ["attn"], example_inputs=x)


def test_shared_recompute_under_a_gradient_penalty_runs_the_users_hook_once():
    # found by an adversarial pass: with create_graph=True the shared recompute took torch.autograd.grad with
    # respect to the saved inputs themselves, which runs the hooks registered on them: a hook doubling fc1's output
    # gradient doubled the inner gradient too, and every gradient came out 0.2-0.9 off
    plain, converted = shared_recompute_pair()
    grads = []
    for model in (converted, plain):
        leaf = X.clone().requires_grad_()
        h = model.fc1(leaf)
        h.register_hook(lambda grad: grad * 2)
        loss = model.fc2(model.act(h)).square().sum()
        (dx,) = torch.autograd.grad(loss, leaf, create_graph=True)
        grads.append(torch.autograd.grad(loss + dx.square().sum(), list(model.parameters())))
    # to float32 rounding, as test_checkpointed_activation_and_its_consumer_share_one_recompute says why
    for mine, torchs in zip(*grads):
        torch.testing.assert_close(mine, torchs)

"""verify's contract at its edges (issue 10, items 11 and 12): a comparison that cannot mean anything raises a
MemtrimError naming what was expected and what was found; OptimizerInBackward works without extra arguments."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.models import SeedMLP

from ..helpers import adam, identity, seed_mlp_batches


def batches(n=3):
    return seed_mlp_batches(n=n, batch=8)


def zero_every_parameter(model, optimizer):
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model, optimizer


# ---------------------------------------------------------------- item 11: shared models, OptimizerInBackward


def test_make_model_returning_the_same_instance_raises():
    model = SeedMLP()
    with pytest.raises(memtrim.InvalidInputError, match=r"make_model returned the same SeedMLP object twice"):
        memtrim.verify(lambda: model, adam, batches(), F.nll_loss, zero_every_parameter)


def test_models_sharing_a_parameter_raise():
    shared = torch.nn.Linear(784, 256)  # built once, outside the factory

    def make():
        model = SeedMLP()
        model.fc1 = shared
        return model

    with pytest.raises(memtrim.InvalidInputError, match=r"share .*fc1\.weight"):
        memtrim.verify(make, adam, batches(), F.nll_loss, identity)


def test_models_sharing_a_buffer_raise():
    running_mean = torch.zeros(32)

    def make():
        model = torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 10),
                                    torch.nn.LogSoftmax(dim=1))
        model[1].running_mean = running_mean
        return model

    with pytest.raises(memtrim.InvalidInputError, match=r"share .*1\.running_mean"):
        memtrim.verify(make, adam, batches(), F.nll_loss, identity)


def test_transform_returning_the_baseline_optimizer_raises():
    made = []

    def make_optimizer(model):
        made.append(adam(model))
        return made[-1]

    with pytest.raises(memtrim.InvalidInputError, match=r"the baseline's optimizer"):
        memtrim.verify(SeedMLP, make_optimizer, batches(), F.nll_loss, lambda m, o: (m, made[0]))


def test_tied_parameters_inside_one_model_are_fine():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(784, 784)
            self.b = torch.nn.Linear(784, 784)
            self.b.weight = self.a.weight
            self.out = torch.nn.Linear(784, 10)

        def forward(self, x):
            return F.log_softmax(self.out(self.b(torch.relu(self.a(x)))), dim=1)

    assert memtrim.verify(Tied, adam, batches(), F.nll_loss, identity).bitwise


def in_backward(model, optimizer):
    return model, memtrim.OptimizerInBackward(optimizer, model=model)


def test_optimizer_in_backward_works_without_compare_grads():
    report = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, in_backward)
    assert report.ok and report.bitwise and report.steps == 3
    assert report.grads_compared is False
    assert "gradients not compared" in str(report) and "OptimizerInBackward" in str(report)
    report.assert_ok()


def test_optimizer_in_backward_with_compare_grads_true_raises():
    with pytest.raises(memtrim.InvalidInputError, match=r"compare_grads=True.*OptimizerInBackward"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, in_backward, compare_grads=True)


def test_plain_run_compares_gradients():
    report = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, identity)
    assert report.grads_compared is True and "not compared" not in str(report)


def test_the_docstring_example_runs():
    example = re.search(r"Example::\n\n(.*?)(?:\n\s*\n|\Z)", memtrim.verify.__doc__, re.S).group(1)
    namespace = {"memtrim": memtrim, "torch": torch, "F": F, "SeedMLP": SeedMLP, "batches": batches(10),
                 "convert": memtrim.convert}
    exec(compile("\n".join(line[8:] for line in example.splitlines()), "verify-docstring", "exec"), namespace)


def test_transform_returning_convert_s_pair_says_so():
    with pytest.raises(memtrim.InvalidInputError, match=r"convert returns \(model, report\)"):
        memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, lambda m, o: (memtrim.convert(m), o))


# ---------------------------------------------------------------- item 12: arguments of the wrong kind


@pytest.mark.parametrize("kwargs, message", [
    (dict(make_model=SeedMLP()), r"make_model must build a new model on each call.*got a SeedMLP instance"),
    (dict(make_optimizer=torch.optim.Adam), r"make_optimizer must be a function of the model.*got the class Adam"),
    (dict(make_optimizer=lambda: None), r"make_optimizer must accept one argument"),
    (dict(make_model=lambda seed: SeedMLP()), r"make_model must be callable with no arguments"),
    (dict(loss_fn=lambda out: out.sum()), r"loss_fn must accept two arguments"),
    (dict(transform=lambda model: model), r"transform must accept two arguments"),
    (dict(batches=[torch.randn(8, 784)]), r"batch 0 must be an \(inputs, targets\) pair, got a Tensor"),
    (dict(batches=[(torch.randn(8, 784),) * 3]), r"batch 0 must be an \(inputs, targets\) pair, got a tuple of 3"),
    (dict(batches=5), r"batches must be an iterable of \(inputs, targets\) pairs, got int"),
    (dict(steps=1.5), r"steps must be a positive int or None, got 1.5"),
    (dict(steps=True), r"steps must be a positive int or None, got True"),
    (dict(rtol="0"), r"rtol must be a finite number >= 0, got '0'"),
    (dict(atol=float("nan")), r"atol must be a finite number >= 0, got nan"),
    (dict(seed=0.5), r"seed must be an int, got 0.5"),
    (dict(compare_grads="yes"), r"compare_grads must be True, False or None"),
    # raw torch and Python errors before (plan already said these)
    (dict(loss_fn=lambda out, y: F.nll_loss(out, y, reduction="none")),
     r"loss_fn\(output, targets\) must return a scalar tensor, got a tensor of shape \(8,\). Reduce it"),
    (dict(loss_fn=lambda out, y: F.nll_loss(out, y).item()), r"must return a scalar tensor, got a float.*no .item\(\)"),
    (dict(batches=[(x.double(), y) for x, y in batches()]),
     r"the baseline's step 0 failed \(RuntimeError: mat1 and mat2 must have the same dtype"),
])
def test_wrong_arguments_raise_invalid_input(kwargs, message):
    args = dict(make_model=SeedMLP, make_optimizer=adam, batches=batches(), loss_fn=F.nll_loss, transform=identity)
    args.update({k: v for k, v in kwargs.items() if k in args})
    options = {k: v for k, v in kwargs.items() if k not in args}
    with pytest.raises(memtrim.InvalidInputError, match=message) as info:
        memtrim.verify(args["make_model"], args["make_optimizer"], args["batches"], args["loss_fn"],
                       args["transform"], **options)
    assert str(info.value).startswith("memtrim.verify: ")


def test_an_optimizer_of_a_model_captured_from_outside_raises():
    # lambda m: SGD(model.parameters()) trained neither run: a 10x learning rate compared "bitwise" (adversarial pass)
    outer = SeedMLP()

    def ten_times(model, optimizer):
        return model, torch.optim.SGD(model.parameters(), lr=1.0)

    with pytest.raises(memtrim.InvalidInputError, match=r"make_optimizer\(model\) returned an optimizer stepping 8 "
                                                        r"of its 8 parameters that are not the model's"):
        memtrim.verify(SeedMLP, lambda m: torch.optim.SGD(outer.parameters(), lr=0.1), batches(), F.nll_loss,
                       ten_times)
    for memtrims in (lambda m: memtrim.CPUOffloadOptimizer(outer.parameters(), torch.optim.SGD, lr=0.1),
                     lambda m: memtrim.LowBitAdamW(outer.parameters())):  # host copies, or 8-bit state: still checked
        with pytest.raises(memtrim.InvalidInputError, match="stepping 8 of its 8 parameters that are not the model's"):
            memtrim.verify(SeedMLP, memtrims, batches(), F.nll_loss, ten_times)
    assert memtrim.verify(SeedMLP, lambda m: memtrim.CPUOffloadOptimizer(m.parameters(), torch.optim.SGD, lr=0.1),
                          batches(), F.nll_loss, identity, compare_grads=False).bitwise
    # a transform's optimizer may step copies of the parameters (CPUOffloadOptimizer): one that trains nothing
    # diverges from the baseline instead
    report = memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, lambda m, o: (m, torch.optim.SGD(outer.parameters())))
    assert not report.ok


def test_gradients_an_offloading_optimizer_keeps_on_the_host_are_compared_where_they_are():
    # CPUOffloadOptimizer moves each gradient to its host copy: verify reported "DIVERGED at step 0, grad: inf"
    def offload(model, optimizer):
        return model, memtrim.CPUOffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)

    report = memtrim.verify(SeedMLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches(), F.nll_loss,
                            offload)
    assert report.ok and report.bitwise and report.grads_compared

    def offload_doubled_gradients(model, optimizer):  # the same parameters, every gradient twice the baseline's
        for p in model.parameters():
            p.register_hook(lambda g: 2 * g)
        return model, memtrim.CPUOffloadOptimizer(model.parameters(), torch.optim.SGD, lr=0.05)

    report = memtrim.verify(SeedMLP, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), batches(), F.nll_loss,
                            offload_doubled_gradients)
    assert not report.ok and report.first_divergence.step == 0
    assert report.first_divergence.tensor.startswith("grad:") and math.isfinite(report.first_divergence.max_abs_error)


def _rewinds_the_generator_after_backward(model, optimizer):
    """A broken replay: each step's backward puts the global generator back where its forward started, so every
    step draws the same dropout mask."""
    def rewind_in_backward(module, args, output):
        state = rng_before.pop()
        output.register_hook(lambda grad: torch.set_rng_state(state))

    rng_before = []
    model.register_forward_pre_hook(lambda m, args: rng_before.append(torch.get_rng_state()))
    model.register_forward_hook(rewind_in_backward)
    return model, optimizer


def test_a_step_that_leaves_the_generator_elsewhere_diverges():
    # before: verify reseeded before every step and called this "bitwise"; the loop seeded once differs by 0.15
    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(784, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 10),
                                   torch.nn.LogSoftmax(dim=1))

    report = memtrim.verify(make_model, adam, batches(), F.nll_loss, _rewinds_the_generator_after_backward)
    assert not report.ok and not report.bitwise
    assert (report.first_divergence.step, report.first_divergence.tensor) == (0, "rng:cpu")


def test_verify_leaves_the_callers_generators_as_they_were():
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    queued = ([c and c[0] for c in torch.cuda._lazy_seed_tracker.get_calls()]
              if hasattr(torch.cuda, "_lazy_seed_tracker") and not torch.cuda.is_initialized() else None)
    assert memtrim.verify(SeedMLP, adam, batches(), F.nll_loss, identity).bitwise
    assert torch.equal(torch.get_rng_state(), state)
    if queued is not None:  # no CUDA seed queued for when CUDA starts (it would replace the caller's)
        assert [c and c[0] for c in torch.cuda._lazy_seed_tracker.get_calls()] == queued


class _KeywordMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = SeedMLP()

    def forward(self, pixels, scale=1.0):
        return self.mlp(pixels * scale)


def test_a_dict_batch_is_passed_as_keyword_arguments():
    # as convert and plan take it (model(**batch)); verify called model(batch), which failed inside the model
    keyword = [({"pixels": x, "scale": 0.5}, y) for x, y in batches()]
    assert memtrim.verify(_KeywordMLP, adam, keyword, F.nll_loss, identity).bitwise


class _NoisySGD(torch.optim.SGD):
    """Gradient noise: its step draws from the global generator."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.add_(torch.randn_like(p) * 1e-3)
        return super().step()


def test_an_optimizer_drawing_in_its_step_is_compared_from_its_own_backward():
    # both runs' steps ran back to back: the identity diverged at param:, and OptimizerInBackward, which draws inside
    # backward and trains bitwise as the standard loop, was reported at rng:cpu (second adversarial pass)
    def noisy(m):
        return _NoisySGD(m.parameters(), lr=0.1)

    assert memtrim.verify(SeedMLP, noisy, batches(), F.nll_loss, identity).bitwise
    in_backward = memtrim.verify(SeedMLP, noisy, batches(), F.nll_loss,
                                 lambda m, o: (m, memtrim.OptimizerInBackward(o, model=m)))
    assert in_backward.bitwise, in_backward


def test_a_lazy_module_is_told_to_run_a_forward_first():
    # it raised torch's ValueError from reading an uninitialized parameter's storage
    with pytest.raises(memtrim.InvalidInputError, match=r"'0.weight' is not initialized yet \(a lazy module\).*Run one "
                                                        "forward"):
        memtrim.verify(lambda: torch.nn.Sequential(torch.nn.LazyLinear(10), torch.nn.LogSoftmax(dim=1)), adam,
                       batches(), F.nll_loss, identity)


# ---------------------------------------------------------------- buffers assigned anew, batches written into


class Averaging(torch.nn.Module):
    """A model whose forward assigns its buffers anew (a call counter and a running average)."""

    def __init__(self, decay=0.9, updates=1):
        super().__init__()
        self.fc, self.decay, self.updates = torch.nn.Linear(6, 3), decay, updates
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        h = self.fc(x)
        for _ in range(self.updates):
            self.count = self.count + 1
            self.ema = self.decay * self.ema + (1 - self.decay) * h.detach().mean(0)
        return h


def small_batches(n=3):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def with_updates(model, optimizer, **settings):
    for name, value in settings.items():
        setattr(model, name, value)
    return model, optimizer


@pytest.mark.parametrize("settings", [{"decay": 0.5}, {"updates": 2}], ids=["another decay", "updated twice"])
def test_a_buffer_assigned_anew_in_forward_is_compared_as_it_is_now(settings):
    # the buffers were paired once, before training: the tensors a forward replaced were compared, and both
    # transforms were reported bitwise
    report = memtrim.verify(Averaging, adam, small_batches(), F.cross_entropy,
                            lambda m, o: with_updates(m, o, **settings))
    assert not report.ok and str(report.first_divergence).startswith("step 0, buffer:")
    assert memtrim.verify(Averaging, adam, small_batches(), F.cross_entropy, identity).bitwise


def test_each_run_gets_its_own_copy_of_the_batch_and_what_it_writes_there_is_compared():
    # a baseline that writes into its input (an in-place first activation) handed the transformed run another batch:
    # a false divergence at step 0; a transform that writes into the batch where the baseline does not was bitwise
    def writes_into_input():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(6, 3))

    assert memtrim.verify(writes_into_input, adam, small_batches(), F.cross_entropy, identity).bitwise

    def out_of_place():
        model = writes_into_input()
        model[0].inplace = False
        return model

    report = memtrim.verify(out_of_place, adam, small_batches(), F.cross_entropy,
                            lambda m, o: with_updates(m[0], o, inplace=True) and (m, o))
    assert not report.ok and str(report.first_divergence).startswith("step 0, batch:0")


def test_a_transform_that_adds_its_own_buffer_is_compared_on_the_baselines_and_says_so():
    # any buffer the transform added made verify refuse the comparison ("A transform must keep the parameters...")
    def counting(model, optimizer):
        model.register_buffer("calls", torch.zeros(()), persistent=False)
        return model, optimizer

    report = memtrim.verify(Averaging, adam, small_batches(), F.cross_entropy, counting)
    assert report.bitwise and any("own buffers (calls)" in note for note in report.notes)



class _Wrapped(torch.nn.Module):
    """A transform's wrapper: the model under ``inner`` (its names prefixed) and a buffer of its own."""

    def __init__(self, inner, decay=None):
        super().__init__()
        self.inner = inner
        self.register_buffer("seen", torch.zeros(3))
        if decay is not None:
            inner.decay = decay

    def forward(self, x):
        return self.inner(x)


@pytest.mark.parametrize("decay, bitwise", [(None, True), (0.5, False)])
def test_a_transform_that_wraps_the_model_and_adds_a_buffer_is_compared_by_the_names_under_its_prefix(decay, bitwise):
    # found by an adversarial pass: refused, with a message about parameters ("must keep the parameters it trains")
    # where the README allows a transform its own buffers
    report = memtrim.verify(Averaging, adam, small_batches(), F.cross_entropy,
                            lambda m, o: (_Wrapped(m, decay), o))
    assert report.bitwise is bitwise, str(report)
    if not bitwise:
        assert str(report.first_divergence).startswith("step 0, buffer:ema"), str(report)

def test_batches_in_other_containers_and_sparse_tensors_are_copied_and_compared_as_dense_ones():
    # a sparse tensor in the batch crashed the batch comparison ("unsupported memory format"); an OrderedDict or a
    # named tuple was not copied, so a model writing into its input still gave a false divergence
    import collections

    Pair = collections.namedtuple("Pair", "x extra")

    class Writes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.act, self.fc = torch.nn.LeakyReLU(0.1, inplace=True), torch.nn.Linear(6, 3)

        def forward(self, x, extra=None):
            return self.fc(self.act(x))

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 6, generator=g) for _ in range(3)]
    ys = [torch.randint(0, 3, (4,), generator=g) for _ in range(3)]
    sparse = torch.eye(4).to_sparse()
    for wrap in (lambda x: collections.OrderedDict(x=x, extra=sparse), lambda x: Pair(x, sparse)):
        report = memtrim.verify(Writes, adam, [(wrap(x), y) for x, y in zip(xs, ys)], F.cross_entropy, identity)
        assert report.bitwise, str(report)

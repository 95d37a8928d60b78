"""OptimizerInBackward: bitwise equal to plain training for every per-parameter optimizer and every feature."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memtrim
from memtrim.models import SeedMLP, SmallGPT

from ..helpers import seed_mlp_batches as mlp_batches


def gpt_batches(n=10):
    g = torch.Generator().manual_seed(2)
    return [(t, t) for t in (torch.randint(0, 64, (4, 16), generator=g) for _ in range(n))]


def small_gpt():
    return SmallGPT(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64)


def lm_loss(out, targets):
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())


class SignSGD(torch.optim.Optimizer):
    """A third-party-style per-parameter optimizer."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["count"] = state.get("count", torch.zeros(())) + 1
                    p.add_(p.grad.sign(), alpha=-group["lr"])


OPTIMIZERS = {
    "SGD": lambda p, fe: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4, foreach=fe),
    "Adam": lambda p, fe: torch.optim.Adam(p, lr=1e-3, foreach=fe),
    "AdamW-amsgrad": lambda p, fe: torch.optim.AdamW(p, lr=1e-3, amsgrad=True, foreach=fe),
    "Adamax": lambda p, fe: torch.optim.Adamax(p, lr=1e-3, foreach=fe),
    "NAdam": lambda p, fe: torch.optim.NAdam(p, lr=1e-3, foreach=fe),
    "RAdam": lambda p, fe: torch.optim.RAdam(p, lr=1e-3, foreach=fe),
    "RMSprop": lambda p, fe: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5, centered=True, foreach=fe),
    "Adagrad": lambda p, fe: torch.optim.Adagrad(p, lr=1e-2, foreach=fe),
    "Adadelta": lambda p, fe: torch.optim.Adadelta(p, lr=1.0, foreach=fe),
    "SignSGD (third-party)": lambda p, fe: SignSGD(p),
}


def in_backward(**options):
    def transform(model, optimizer):
        return model, memtrim.OptimizerInBackward(optimizer, model=model, **options)

    return transform


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("workload", ["mlp", "gpt"])
def test_every_optimizer_bitwise(name, foreach, workload):
    if name == "SignSGD (third-party)" and foreach:
        pytest.skip("no foreach variant")
    make_model, batches, loss_fn = (
        (SeedMLP, mlp_batches(), F.nll_loss) if workload == "mlp" else (small_gpt, gpt_batches(), lm_loss)
    )
    report = memtrim.verify(
        make_model, lambda m: OPTIMIZERS[name](m.parameters(), foreach), batches, loss_fn,
        in_backward(bucket_bytes=16 * 1024), compare_grads=False,
    )
    assert report.bitwise, str(report)
    assert report.steps == 10


def test_param_groups_with_different_hyperparameters():
    def make_optimizer(model):
        return torch.optim.AdamW(
            [{"params": [model.fc1.weight, model.fc2.weight], "lr": 1e-2, "weight_decay": 0.1},
             {"params": [p for n, p in model.named_parameters() if n not in ("fc1.weight", "fc2.weight")]}],
            lr=1e-3, betas=(0.8, 0.99),
        )

    report = memtrim.verify(SeedMLP, make_optimizer, mlp_batches(), F.nll_loss, in_backward(), compare_grads=False)
    assert report.bitwise


def run(model, optimizer, batches, loss_fn=F.nll_loss, backward=None, scheduler=None, per_step=None):
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        (backward or (lambda loss: loss.backward()))(loss)
        if per_step is not None:
            per_step(model, optimizer)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def twins(make_model=SeedMLP, seed=0):
    torch.manual_seed(seed)
    a = make_model()
    b = copy.deepcopy(a)
    return a, b


def assert_same(a, b):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("on_wrapper", [False, True])
def test_scheduler_reaches_the_real_update(on_wrapper):
    a, b = twins()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    sched_a = torch.optim.lr_scheduler.StepLR(opt_a, step_size=2, gamma=0.1)
    inner = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    opt_b = memtrim.OptimizerInBackward(inner, model=b)
    sched_b = torch.optim.lr_scheduler.StepLR(opt_b if on_wrapper else inner, step_size=2, gamma=0.1)
    run(a, opt_a, mlp_batches(), scheduler=sched_a)
    run(b, opt_b, mlp_batches(), scheduler=sched_b)
    assert opt_b.param_groups[0]["lr"] == opt_a.param_groups[0]["lr"] == pytest.approx(0.1 * 0.1**5)
    assert_same(a, b)


def test_clip_grad_norm_two_pass_bitwise():
    a, b = twins()
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = memtrim.OptimizerInBackward(torch.optim.Adam(b.parameters(), lr=1e-2), model=b, clip_grad_norm=0.5)
    norms = []

    def clip(model, optimizer):
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))

    run(a, opt_a, mlp_batches(), per_step=clip)
    run(b, opt_b, mlp_batches(), backward=opt_b.backward)
    assert max(norms) > 0.5  # clipping really happened
    assert float(opt_b.last_total_norm) == norms[-1]
    assert_same(a, b)


def test_clip_grad_norm_needs_backward_method():
    model = SeedMLP()
    opt = memtrim.OptimizerInBackward(torch.optim.Adam(model.parameters()), model=model, clip_grad_norm=1.0)
    x, y = mlp_batches(1)[0]
    opt.zero_grad()  # opens the step: only then does backward update
    with pytest.raises(memtrim.OptimizerInBackwardError, match=r"opt.backward\(loss\)"):
        F.nll_loss(model(x), y).backward()
    opt.zero_grad()
    opt.backward(F.nll_loss(model(x), y))  # the two-pass way works


def test_clip_grad_value_bitwise():
    a, b = twins()
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1)
    opt_b = memtrim.OptimizerInBackward(torch.optim.SGD(b.parameters(), lr=0.1), model=b, clip_grad_value=0.01)
    run(a, opt_a, mlp_batches(), per_step=lambda m, o: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01))
    run(b, opt_b, mlp_batches())
    assert_same(a, b)


@pytest.mark.parametrize("clip", [None, 0.5])
def test_gradient_accumulation_bitwise(clip):
    a, b = twins()
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = memtrim.OptimizerInBackward(torch.optim.Adam(b.parameters(), lr=1e-2), model=b, clip_grad_norm=clip)
    batches = mlp_batches(12)
    for start in range(0, 12, 3):
        micro = batches[start:start + 3]
        opt_a.zero_grad()
        for x, y in micro:
            (F.nll_loss(a(x), y) / 3).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(a.parameters(), clip)
        opt_a.step()
        opt_b.zero_grad()
        for x, y in micro[:-1]:
            with opt_b.accumulate():
                (F.nll_loss(b(x), y) / 3).backward()
        opt_b.backward(F.nll_loss(b(micro[-1][0]), micro[-1][1]) / 3)
        opt_b.step()
        assert_same(a, b)
    for p in b.parameters():
        assert p.grad is None


def test_two_backwards_without_accumulation_raise():
    model = SeedMLP()
    opt = memtrim.OptimizerInBackward(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    x, y = mlp_batches(1)[0]
    opt.zero_grad()
    F.nll_loss(model(x), y).backward()
    with pytest.raises(memtrim.OptimizerInBackwardError, match="accumulate"):
        F.nll_loss(model(x), y).backward()
    opt.zero_grad()
    F.nll_loss(model(x), y).backward()  # a new step is fine


def test_grad_scaler_with_injected_inf():
    a, b = twins()
    scaler_a = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    scaler_b = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = memtrim.OptimizerInBackward(torch.optim.Adam(b.parameters(), lr=1e-2), model=b, scaler=scaler_b)
    batches = mlp_batches(8)
    batches[3] = (batches[3][0].clone().index_fill_(1, torch.tensor([5]), float("inf")), batches[3][1])
    scales = []
    for x, y in batches:
        opt_a.zero_grad()
        scaler_a.scale(F.nll_loss(a(x), y)).backward()
        scaler_a.step(opt_a)
        scaler_a.update()
        opt_b.zero_grad()
        opt_b.backward(scaler_b.scale(F.nll_loss(b(x), y)))
        scaler_b.step(opt_b)
        scaler_b.update()
        assert scaler_a.get_scale() == scaler_b.get_scale()
        scales.append(scaler_b.get_scale())
        assert_same(a, b)
    assert scales[3] < scales[2]  # the inf step was skipped and lowered the scale
    assert all(torch.isfinite(p).all() for p in b.parameters())


class WithFrozenUnusedTied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(784, 32)
        self.frozen = torch.nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.unused = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 32, bias=False)
        self.tied = torch.nn.Linear(32, 32, bias=False)
        self.tied.weight = self.head.weight
        self.out = torch.nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.frozen(self.embed(x)))
        h = self.tied(torch.relu(self.head(h)))
        return F.log_softmax(self.out(h), dim=1)


def test_frozen_unused_and_tied_parameters():
    report = memtrim.verify(
        WithFrozenUnusedTied, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), mlp_batches(), F.nll_loss,
        in_backward(bucket_bytes=0), compare_grads=False,
    )
    assert report.bitwise


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.a = torch.nn.Linear(784, 64)
        self.block = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x):
        h = self.a(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return F.log_softmax(self.out(h), dim=1)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks(reentrant):
    report = memtrim.verify(
        lambda: Checkpointed(reentrant), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), mlp_batches(),
        F.nll_loss, in_backward(bucket_bytes=0), compare_grads=False,
    )
    assert report.bitwise


@pytest.mark.parametrize("direction", ["plain->wrapper", "wrapper->plain"])
def test_state_dict_round_trip_mid_training(direction):
    reference, model = twins()
    opt_ref = torch.optim.Adam(reference.parameters(), lr=1e-2)
    run(reference, opt_ref, mlp_batches(10))
    batches = mlp_batches(10)
    first = torch.optim.Adam(model.parameters(), lr=1e-2)
    if direction == "wrapper->plain":
        first = memtrim.OptimizerInBackward(first, model=model)
    run(model, first, batches[:5])
    saved = copy.deepcopy(first.state_dict())
    second = torch.optim.Adam(model.parameters(), lr=1e-2)
    if direction == "plain->wrapper":
        second = memtrim.OptimizerInBackward(second, model=model)
    else:
        first.remove()
    second.load_state_dict(saved)
    run(model, second, batches[5:])
    assert_same(reference, model)


def test_gradients_alive_never_exceed_the_largest_bucket():
    model = SmallGPT(n_layer=2, d_model=64, n_head=4, seq_len=32, vocab_size=128)
    opt = memtrim.OptimizerInBackward(torch.optim.AdamW(model.parameters()), model=model, bucket_bytes=64 * 1024,
                                      peak="lowest")
    idx = torch.randint(0, 128, (4, 32))
    run(model, opt, [(idx, idx)], loss_fn=lm_loss)
    with memtrim.track(model, opt) as tracker:
        run(model, opt, [(idx, idx)], loss_fn=lm_loss)
    report = tracker.report()
    largest = opt.largest_bucket_bytes
    total = sum(p.numel() * 4 for p in model.parameters())
    assert largest < total / 4
    assert max(e.by_category["gradients"] for e in report.timeline) <= largest


def test_peak_drops_by_about_the_gradients():
    def measure(wrap):
        torch.manual_seed(0)
        model = SmallGPT(n_layer=2, d_model=128, n_head=4, seq_len=16, vocab_size=2048)
        opt = torch.optim.AdamW(model.parameters())
        if wrap:
            opt = memtrim.OptimizerInBackward(opt, model=model, bucket_bytes=0, peak="lowest")
        idx = torch.randint(0, 2048, (2, 16))
        run(model, opt, [(idx, idx)], loss_fn=lm_loss)
        with memtrim.track(model, opt) as tracker:
            run(model, opt, [(idx, idx)], loss_fn=lm_loss)
        return tracker.report(), opt

    plain, _ = measure(False)
    fused, opt = measure(True)
    grads = plain.peak_by_category["gradients"]
    assert plain.peak_phase == "optimizer"
    assert grads == sum(p.numel() * 4 for p in opt.optimizer.param_groups[0]["params"])
    saved = plain.peak_bytes - fused.peak_bytes
    # The fused step peaks inside backward, at the update of the largest bucket (the LM head, updated first):
    # that bucket's gradient is alive, and so are the activations (and backward temporaries) the rest of
    # backward still needs. The saving is exactly the gradients minus what is still alive there.
    assert fused.peak_phase == "backward"
    assert 0 < fused.peak_by_category["gradients"] <= opt.largest_bucket_bytes
    assert saved == grads - fused.peak_by_category["gradients"] - fused.peak_by_category["activations"] + (
        plain.peak_by_category["temporaries"] - fused.peak_by_category["temporaries"]
    )
    assert saved > 0.5 * grads


def test_bad_input():
    model = SeedMLP()
    other = SeedMLP()
    with pytest.raises(memtrim.InvalidInputError, match="does not own"):
        memtrim.OptimizerInBackward(torch.optim.Adam(other.parameters()), model=model)
    with pytest.raises(memtrim.InvalidInputError, match="LBFGS needs a closure"):
        memtrim.OptimizerInBackward(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(memtrim.InvalidInputError, match="built torch.optim.Optimizer"):
        memtrim.OptimizerInBackward(torch.optim.Adam)
    with pytest.raises(memtrim.InvalidInputError, match="clip_grad_norm must be a positive"):
        memtrim.OptimizerInBackward(torch.optim.Adam(model.parameters()), clip_grad_norm=-1)
    opt = memtrim.OptimizerInBackward(torch.optim.Adam(model.parameters()))
    with pytest.raises(memtrim.MemtrimStateError, match="already wrapped"):
        memtrim.OptimizerInBackward(opt)
    with pytest.raises(memtrim.InvalidInputError, match=r"closures are not supported.*use_pl_optimizer=False"):
        opt.step(lambda: 0.0)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad"])
def test_fused_implementations_bitwise(name):
    make = {
        "SGD": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
        "Adam": lambda p: torch.optim.Adam(p, lr=1e-3, fused=True),
        "AdamW": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
        "Adagrad": lambda p: torch.optim.Adagrad(p, lr=1e-2, fused=True),
    }[name]
    try:
        make([torch.nn.Parameter(torch.zeros(1))]).step()
    except (RuntimeError, TypeError) as e:  # older torch: no fused kernel on this device
        pytest.skip(f"fused {name} unavailable here: {e}")
    report = memtrim.verify(SeedMLP, lambda m: make(m.parameters()), mlp_batches(), F.nll_loss,
                            in_backward(bucket_bytes=64 * 1024), compare_grads=False)
    assert report.bitwise, str(report)

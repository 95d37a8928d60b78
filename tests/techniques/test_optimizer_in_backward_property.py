"""A seeded property test: random training loops, each written the usual way, bitwise equal with and without
OptimizerInBackward (parameters and optimizer state)."""

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memtrim

STEPS = 4
OPTIMIZERS = [
    lambda p, fe, r: torch.optim.SGD(p, lr=0.05, momentum=r.choice([0.0, 0.9]), weight_decay=r.choice([0, 1e-3]),
                                     foreach=fe),
    lambda p, fe, r: torch.optim.Adam(p, lr=1e-2, amsgrad=r.choice([False, True]), foreach=fe),
    lambda p, fe, r: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.05, foreach=fe),
    lambda p, fe, r: torch.optim.RMSprop(p, lr=1e-3, centered=r.choice([False, True]), foreach=fe),
    lambda p, fe, r: torch.optim.Adagrad(p, lr=1e-2, foreach=fe),
    lambda p, fe, r: torch.optim.NAdam(p, lr=1e-2, foreach=fe),
]


class Experts(nn.Module):
    def __init__(self, d_in=6, d_out=3):
        super().__init__()
        self.inp = nn.Linear(d_in, 12)
        self.experts = nn.ModuleList([nn.Linear(12, 12), nn.Linear(12, 12)])
        self.out = nn.Linear(12, d_out)

    def forward(self, x, experts=(0, 1)):
        h = torch.tanh(self.inp(x))
        return self.out(sum(self.experts[i](h) for i in experts))


def build(case, seed):
    torch.manual_seed(seed)
    model = Experts(d_in=6 if seed == 0 else 3, d_out=3)
    r = random.Random(case * 10 + seed)
    groups = [{"params": list(model.parameters())}]
    if r.random() < 0.5:
        head = [model.out.weight, model.out.bias]
        rest = [p for p in model.parameters() if all(p is not h for h in head)]
        groups = [{"params": head, "lr": 3e-3}, {"params": rest}]
    return model, r, groups


@dataclass
class Loop:
    """One random training loop, drawn from its case number: the options, and the micro-batches of each step."""

    make: Callable
    foreach: bool
    clip: tuple[str, float] | None
    use_scaler: bool
    use_sched: bool
    micro: int
    two_models: bool
    freeze_until: int
    set_to_none: bool
    bucket_bytes: int
    peak: str
    data: list = field(default_factory=list)  # data[step][micro-batch] = (x, y, both experts)


def draw(case):
    r = random.Random(case)
    loop = Loop(
        make=r.choice(OPTIMIZERS),
        foreach=r.choice([False, True]),
        clip=r.choice([None, None, ("norm", 0.3), ("value", 0.02)]),
        use_scaler=r.random() < 0.3,
        use_sched=r.random() < 0.5,
        micro=r.choice([1, 2, 3]),
        two_models=r.random() < 0.4,
        freeze_until=r.choice([0, 0, 2]),
        set_to_none=r.random() < 0.7,
        bucket_bytes=r.choice([0, 512, 1 << 20]),
        peak=r.choice(["never_higher", "lowest"]),
    )
    g = torch.Generator().manual_seed(100 + case)
    loop.data = [[(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g), r.random() < 0.5)
                  for _ in range(loop.micro)] for _ in range(STEPS)]
    if loop.use_scaler:
        x, y, e = loop.data[1][-1]
        loop.data[1][-1] = (x.clone().index_fill_(1, torch.tensor([2]), float("inf")), y, e)
    return loop


def setup(case, loop, wrapped):
    """One or two models (the second fed by the first), each with its optimizer, scaler and scheduler."""
    models, opts, scheds, scalers = [], [], [], []
    for seed in range(2 if loop.two_models else 1):
        model, mr, groups = build(case, seed)
        if loop.freeze_until:
            model.inp.requires_grad_(False)
        inner = loop.make(groups, loop.foreach, mr)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if loop.use_scaler else None
        opt = inner
        if wrapped:
            clip = loop.clip
            opt = memtrim.OptimizerInBackward(
                inner, model=model, bucket_bytes=loop.bucket_bytes, peak=loop.peak, scaler=scaler,
                clip_grad_norm=clip[1] if clip and clip[0] == "norm" else None,
                clip_grad_value=clip[1] if clip and clip[0] == "value" else None,
            )
        models.append(model)
        opts.append(opt)
        scalers.append(scaler)
        scheds.append(torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if loop.use_sched else None)
    return models, opts, scheds, scalers


def train_step(loop, step, k, models, opt, scaler, wrapped):
    """Model ``k``'s step: zero_grad, the micro-batches' backward passes, (clipping,) the optimizer's step."""
    model = models[k]
    opt.zero_grad(set_to_none=loop.set_to_none)
    for i, (x, y, both) in enumerate(loop.data[step]):
        if k == 1:  # the second model reads the first one's output (not detached): a GAN-like loop
            x = torch.cat([models[0](x), x[:, :0]], 1)
        loss = F.cross_entropy(model(x, (0, 1) if both or i == 0 else (0,)), y) / loop.micro
        if scaler is not None:
            loss = scaler.scale(loss)
        last = i == loop.micro - 1
        if not wrapped:
            loss.backward()
        elif not last:
            with opt.accumulate():
                loss.backward()
        else:
            opt.backward(loss)
    if not wrapped:
        if scaler is not None:
            scaler.unscale_(opt)
        params = [p for group in opt.param_groups for p in group["params"]]
        if loop.clip and loop.clip[0] == "norm":  # the usual loop's clip, over the model's parameters in order
            torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip[1])
        elif loop.clip:
            torch.nn.utils.clip_grad_value_(params, loop.clip[1])
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()


def run(case, wrapped):
    loop = draw(case)
    models, opts, scheds, scalers = setup(case, loop, wrapped)
    for step in range(STEPS):
        if step == loop.freeze_until:
            for model in models:
                model.inp.requires_grad_(True)
        for k, (opt, sched, scaler) in enumerate(zip(opts, scheds, scalers)):
            train_step(loop, step, k, models, opt, scaler, wrapped)
            if sched is not None:
                sched.step()
    return models, opts


@pytest.mark.parametrize("case", range(40))
def test_random_training_loops_are_bitwise_equal(case):
    plain_models, plain_opts = run(case, wrapped=False)
    models, opts = run(case, wrapped=True)
    for plain, model in zip(plain_models, models):
        for (name, a), b in zip(plain.named_parameters(), model.parameters()):
            assert torch.equal(a, b), (case, name)
    for plain, opt in zip(plain_opts, opts):
        sa, sb = plain.state_dict(), opt.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        for key, state in sa["state"].items():
            for name, value in state.items():
                other = sb["state"][key][name]
                assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, (case, name)

"""CPUOffloadOptimizer: bitwise the standard loop where host and device are one (CPU), gradients freed on the device
as soon as they are ready, accumulation, schedulers, param groups, state_dict both ways, bad input."""

import copy

import pytest
import torch
import torch.nn.functional as F

import memtrim
from memtrim.errors import InvalidInputError
from memtrim.models import GPTConfig, SmallGPT


def _gpt():
    torch.manual_seed(0)
    return SmallGPT(GPTConfig(n_layer=2, d_model=32, n_head=4, seq_len=16, vocab_size=64))


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batches(n=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("optimizer_class, options", [
    (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True}),
    (torch.optim.Adam, {"lr": 1e-3, "amsgrad": True}),
])
def test_bitwise_equal_to_the_standard_loop_on_cpu(optimizer_class, options):
    report = memtrim.verify(
        _gpt, lambda m: optimizer_class(m.parameters(), **options), _batches(), _loss,
        lambda m, o: (m, memtrim.CPUOffloadOptimizer(m.parameters(), optimizer_class, **options)),
        compare_grads=False,
    )
    assert report.ok and report.bitwise


def test_gradients_leave_the_device_as_soon_as_ready_and_accumulate_on_the_host():
    model = _gpt()
    plain = copy.deepcopy(model)
    opt = memtrim.CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    ref = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    (x1, y1), (x2, y2) = _batches(2)
    for m in (model, plain):
        _loss(m(x1), y1).backward()
        _loss(m(x2), y2).backward()  # accumulation: two micro-batches
    assert all(p.grad is None for p in model.parameters())
    for h, p in zip(opt.host_parameters(), plain.parameters()):
        assert torch.equal(h.grad, p.grad)
    opt.step()
    ref.step()
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    assert set(opt.state) == set(model.parameters())  # keyed by the device parameters, as a plain optimizer's


def test_scheduler_param_groups_and_state_dict_round_trip():
    model = _gpt()
    plain = copy.deepcopy(model)
    groups = lambda m: [{"params": list(m.blocks.parameters()), "lr": 1e-3},  # noqa: E731
                        {"params": [p for n, p in m.named_parameters() if not n.startswith("blocks.")], "lr": 3e-3}]
    opt = memtrim.CPUOffloadOptimizer(groups(model), torch.optim.AdamW, offload_gradients=False)
    ref = torch.optim.AdamW(groups(plain))
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (opt, ref)]
    for x, y in _batches(3):
        for m, o, s in ((model, opt, scheds[0]), (plain, ref, scheds[1])):
            o.zero_grad()
            _loss(m(x), y).backward()
            o.step()
            s.step()
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref.param_groups]
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    again = torch.optim.AdamW(groups(copy.deepcopy(plain)))
    again.load_state_dict(opt.state_dict())  # loads into the plain optimizer
    assert torch.equal(again.state_dict()["state"][0]["exp_avg"], ref.state_dict()["state"][0]["exp_avg"])


@pytest.mark.parametrize("args, kwargs, message", [
    ((), {"optimizer_class": torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())}, "optimizer_class must be"),
    ((), {"optimizer_class": "adamw"}, "optimizer_class must be"),
])
def test_bad_input(args, kwargs, message):
    with pytest.raises(InvalidInputError, match=message):
        memtrim.CPUOffloadOptimizer(_gpt().parameters(), *args, **kwargs)
    with pytest.raises(InvalidInputError, match="got no parameters"):
        memtrim.CPUOffloadOptimizer([])
    with pytest.raises(InvalidInputError, match="closures"):
        memtrim.CPUOffloadOptimizer(_gpt().parameters()).step(lambda: 0.0)

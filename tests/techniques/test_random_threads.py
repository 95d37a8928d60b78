"""Recomputations (checkpoint_modules, ReversibleSequential) beside another thread drawing from torch's global
generators: the masks they rebuild are the forward's, or they raise (NOTE [ another thread's draws ] in
memtrim/techniques/_generators.py). Before 2026-12-02 the gradient was silently wrong in about a third of the steps."""

import contextlib
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memtrim


class _LoggedDropout(nn.Module):
    """Dropout logging its mask, in forward and in backward's recomputation."""

    def __init__(self):
        super().__init__()
        self.masks = {False: [], True: []}  # in backward -> masks

    def forward(self, x):
        out = F.dropout(x, 0.5, self.training)
        self.masks[torch._C._current_graph_task_id() != -1].append(out == 0)
        return out


class _DrawsFirstInForward(nn.Module):
    """What another thread's draw between the forward's looks like, made deterministic: torch.rand before the
    dropout, in forward only."""

    def forward(self, x):
        if torch._C._current_graph_task_id() == -1:
            torch.rand(64)
        return F.dropout(x, 0.5, self.training)


def _model(how, dropout):
    torch.manual_seed(0)
    if how == "reversible":
        blocks = [memtrim.AdditiveCoupling(nn.Sequential(nn.Linear(8, 8), dropout()),
                                           nn.Sequential(nn.Linear(8, 8), dropout())) for _ in range(2)]
        return memtrim.ReversibleSequential(*blocks).double(), 16, memtrim.ReversibleError
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), dropout(), nn.Tanh()) for _ in range(3)]).double()
    if how == "checkpoint_modules":
        memtrim.checkpoint_modules(model, lambda name, module: name in {"0", "1", "2"})
    return model, 8, memtrim.MemtrimStateError


class _Thread:
    """A second thread for the duration: ``draws`` calls torch.rand in a loop, else it only waits."""

    def __init__(self, draws):
        self.stop, self.draws = threading.Event(), draws

    def _run(self):
        while not self.stop.is_set():
            if self.draws:
                torch.rand(64)
            else:
                self.stop.wait(0.001)

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("how", ["reversible", "checkpoint_modules"])
def test_a_draw_between_the_forwards_draws_raises_naming_the_fix(how):
    model, width, error = _model(how, _DrawsFirstInForward)
    with _Thread(draws=False), pytest.raises(error, match="drew other random numbers in its recomputation.*another "
                                                          r"thread.*torch.Generator of their own"):
        model(torch.randn(4, width, dtype=torch.float64)).sum().backward()


@pytest.mark.parametrize("how", ["reversible", "checkpoint_modules"])
def test_beside_a_thread_drawing_every_mask_is_the_forwards_or_it_raises(how):
    model, width, error = _model(how, _LoggedDropout)
    drops = [m for m in model.modules() if isinstance(m, _LoggedDropout)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the other thread's draws land between this thread's calls
    raised = 0
    try:
        with _Thread(draws=True):
            for _ in range(20):
                for d in drops:
                    d.masks = {False: [], True: []}
                try:
                    model(torch.randn(4, width, dtype=torch.float64)).sum().backward()
                except error as e:
                    assert "another thread" in str(e)
                    raised += 1
                    continue
                for d in drops:
                    assert len(d.masks[True]) == len(d.masks[False]) == 1
                    assert torch.equal(d.masks[True][0], d.masks[False][0])  # (differed in a third of steps)
    finally:
        sys.setswitchinterval(interval)
    assert raised > 0  # the thread drew constantly: most steps see it


@pytest.mark.parametrize("how", ["reversible", "checkpoint_modules"])
def test_beside_a_thread_that_draws_nothing_training_is_unchanged(how):
    # watched (another thread runs) or not, the gradients are the same; checkpointed ones are plain training's
    _assert_an_idle_thread_changes_nothing(how, lambda: nn.Dropout(0.5))


def _assert_an_idle_thread_changes_nothing(how, dropout):
    def grads(how, thread):
        model, width, _ = _model(how, dropout)
        torch.manual_seed(1)
        with _Thread(draws=False) if thread else contextlib.nullcontext():
            for _ in range(3):
                model(torch.randn(4, width, dtype=torch.float64)).sum().backward()
        return [p.grad for p in model.parameters()]

    watched = grads(how, thread=True)
    expected = grads("plain" if how == "checkpoint_modules" else how, thread=False)
    assert all(torch.equal(a, b) for a, b in zip(watched, expected, strict=True))


class _ReseedsInBackward(nn.Module):
    """Moves the global generator in backward's recomputation by a call no torch-function mode sees: the change is
    seen at the next call, a Tensor operator."""

    def forward(self, x):
        y = F.dropout(x, 0.5, self.training)
        if torch._C._current_graph_task_id() != -1:
            torch.manual_seed(123)
        return y + 0 * (y == 0)


def test_a_race_seen_at_a_tensor_operator_raises_there():
    # raised as a TypeError inside `y == 0`, it became NotImplemented and `y == 0` said False: training went on
    model, width, error = _model("checkpoint_modules", _ReseedsInBackward)
    with _Thread(draws=False), pytest.raises(error, match="drew other random numbers in its recomputation"):
        model(torch.randn(4, width, dtype=torch.float64)).sum().backward()


class _ReseedsThenCalls(nn.Module):
    """Sets the global generator by a call no torch-function mode sees (a reseed, the end of fork_rng), then calls a
    submodule and draws its dropout."""

    def __init__(self, how):
        super().__init__()
        self.how, self.linear = how, nn.Linear(8, 8)

    def forward(self, x):
        if self.how == "reseed":
            torch.manual_seed(123)
            return F.dropout(torch.tanh(self.linear(x)), 0.5, self.training)
        with torch.random.fork_rng():
            return F.dropout(torch.tanh(self.linear(x)), 0.5, self.training)


@pytest.mark.parametrize("what", ["reseed", "fork_rng"])
@pytest.mark.parametrize("how", ["reversible", "checkpoint_modules"])
def test_a_reseed_in_the_forward_beside_an_idle_thread_trains_as_without_it(how, what):
    # found by an adversarial pass: the change was named by the call after it, a Linear in the forward and memtrim's
    # own read of a parameter's version in the recomputation: a false error at every step beside any idle thread
    # (tqdm's monitor thread is one)
    _assert_an_idle_thread_changes_nothing(how, lambda: _ReseedsThenCalls(what))

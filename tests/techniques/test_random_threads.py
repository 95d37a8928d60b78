"""Recomputations (checkpoint_modules, ReversibleSequential) beside another thread drawing from torch's global
generators: the masks they rebuild are the forward's, or they raise (NOTE [ another thread's draws ] in
memtrim/techniques/_generators.py). Before 2026-12-02 the gradient was silently wrong in about a third of the steps.
OptimizerInBackward's two passes (clip_grad_norm=, scaler=) beside one: the other thread's draws are its own
(NOTE [ a backward run twice ]); they were rewound, and drawn again."""

import contextlib
import re
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


class _DrawsOnRequest:
    """A second thread drawing ``torch.rand(4)`` from the global generator each time :meth:`draw` asks it to (and
    waits for it): another thread's draw made deterministic, landing inside a backward."""

    def __init__(self):
        self.asked, self.done, self.draws = threading.Event(), threading.Event(), []
        self.stopped = False

    def _run(self):
        while True:
            self.asked.wait()
            self.asked.clear()
            if self.stopped:
                return
            self.draws.append(torch.rand(4))
            self.done.set()

    def draw(self):
        self.asked.set()
        self.done.wait()
        self.done.clear()

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped = True
        self.asked.set()
        self.thread.join()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _clipped_runs(hook, steps=3, thread=None, checkpointed=False):
    """Parameters (and the global generator's state after each step) of the standard loop and of OptimizerInBackward
    with clip_grad_norm=, ``hook`` on the hidden activation of each, ``thread`` alive around both."""
    runs = []
    with thread if thread is not None else contextlib.nullcontext():
        for wrapped in (False, True):
            model = _mlp()
            if wrapped and checkpointed:
                memtrim.checkpoint_modules(model, ["0"])
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            if wrapped:
                opt = memtrim.OptimizerInBackward(opt, model=model, clip_grad_norm=0.5, bucket_bytes=0)
            states = []
            torch.manual_seed(5)
            data = torch.Generator().manual_seed(5)  # (not the global generator: the other thread draws from it)
            for _ in range(steps):
                opt.zero_grad()
                hidden = model[1](model[0](torch.randn(6, 8, generator=data)))
                hidden.register_hook(hook)
                loss = F.cross_entropy(model[2](hidden), torch.randint(0, 4, (6,), generator=data))
                if wrapped:
                    opt.backward(loss)
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                states.append(torch.get_rng_state())
            runs.append((model, states))
    (a, states_a), (b, states_b) = runs
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    return states_a, states_b


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_drawing_backward_with_two_passes_beside_an_idle_thread_is_bitwise(checkpointed):
    # the noise is drawn again by the updating pass, from where the measuring pass drew it; the generator ends where
    # one pass leaves it (with a checkpointed layer, its recomputation's draws too)
    states_a, states_b = _clipped_runs(lambda g: g + 0.01 * torch.randn_like(g), thread=_Thread(draws=False),
                                       checkpointed=checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(states_a, states_b, strict=True))


def _hooked_step(own, outside=None):
    """One clipped step of an OptimizerInBackward over ``_mlp()``'s first layer, ``own`` on its weight's gradient
    (reached by both passes) and ``outside`` on the last layer's (a leaf outside the wrapper: only the second pass
    reaches it, before the first layer's, as a GAN's discriminator); ``opt.backward``'s error, if any, and the
    wrapper."""
    model = _mlp()
    opt = memtrim.OptimizerInBackward(torch.optim.SGD(model[0].parameters(), lr=0.1), model=model[0],
                                      clip_grad_norm=0.5)
    opt.zero_grad()
    model[0].weight.register_hook(own)
    if outside is not None:
        model[2].weight.register_hook(outside)
    try:
        opt.backward(model(torch.randn(6, 8)).sum())
    except memtrim.OptimizerInBackwardError as e:
        return e, opt
    return None, opt


def test_a_thread_drawing_during_the_first_pass_only_raises_after_the_update():
    # found by an adversarial pass: the global generator is put back for the second pass, and another thread's draw in
    # the first was drawn again, silently (20,334 of 53,363 of its dropout masks repeated an earlier one); the second
    # pass then ends elsewhere than the first, and that is said (a thread drawing as much in each pass is not seen)
    other = _DrawsOnRequest()
    passes = []

    def hook(grad):
        passes.append(1)
        if len(passes) == 1:
            other.draw()
        return grad

    with other:
        error, opt = _hooked_step(hook)
    assert error is not None and re.search(r"second pass drew other random numbers than its first \(the global "
                                           r"generator ended elsewhere\): another thread drew.*torch.Generator of "
                                           r"its own", str(error))
    with pytest.raises(memtrim.OptimizerInBackwardError, match="cannot be applied as the standard loop would"):
        opt.step()


@pytest.mark.parametrize("explicit", [False, True])
def test_a_second_pass_drawing_first_where_the_first_did_not_raises(explicit):
    # a GAN's generator loss through the discriminator, in small: the discriminator's hooks draw in the second pass
    # only, before the generator's, which then drew other noise than its norm was measured on (0.00323 off with the
    # global generator, 0.0393 with one of its own, after 3 steps; found by an adversarial pass)
    g = torch.Generator().manual_seed(3)

    def draw(shape):
        return torch.randn(shape, generator=g) if explicit else torch.randn(shape)

    error, _ = _hooked_step(lambda grad: grad + 0.01 * draw(grad.shape), lambda grad: grad)
    assert error is None  # the outside hook draws nothing: the passes agree
    error, opt = _hooked_step(lambda grad: grad + 0.01 * draw(grad.shape), lambda grad: grad + 0.01 * draw(grad.shape))
    assert error is not None and "second pass drew" in str(error) and "another model's parameters" in str(error)
    with pytest.raises(memtrim.OptimizerInBackwardError, match="cannot be applied as the standard loop would"):
        opt.step()


def test_a_generator_another_thread_draws_from_between_the_passes_raises():
    # found by an adversarial pass: setting it back for the second pass gave the other thread its numbers twice
    g = torch.Generator().manual_seed(3)
    passes = []

    def hook(grad):
        passes.append(1)
        noise = torch.randn(grad.shape, generator=g)
        if len(passes) == 1:
            torch.rand(4, generator=g)  # what the other thread does, made deterministic
        return grad + 0.01 * noise

    error, opt = _hooked_step(hook)
    assert error is not None and "a torch.Generator ended elsewhere" in str(error)
    with pytest.raises(memtrim.OptimizerInBackwardError, match="cannot be applied as the standard loop would"):
        opt.step()


class _TanhDropout(nn.Module):
    """(Defined here: dynamo compiles no frame of torch.nn's own files, such as a Sequential's forward.)"""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(torch.tanh(self.lin(x)), 0.5, self.training)


class _CompiledDropoutBlock(nn.Module):
    """A block whose child is compiled and draws a dropout mask from the global generator."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner()
        self.inner.compile(backend="aot_eager")

    def forward(self, x):
        return torch.relu(self.inner(x))


def _torch_sequential():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.5))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")  # dynamo's own, tracing
@pytest.mark.parametrize("inner", [_TanhDropout, _torch_sequential])
def test_beside_an_idle_thread_a_compiled_child_compiles_once_and_trains_as_plain(inner):
    # before: the watch read the global generators at each op inside the compiled child, which dynamo cannot trace:
    # a graph break at every op, and the watch compiled as frames of its own, once per op signature (5 graphs and
    # 28 frames in 12 steps, against 1 graph plain, then torch's recompile limit). Dynamo compiles nothing of torch's
    # own Sequential, plain: there the watch alone made 5 graphs
    from torch._dynamo.utils import counters

    def train(checkpointed):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), _CompiledDropoutBlock(inner), nn.Linear(8, 1)).double()
        if checkpointed:
            memtrim.checkpoint_modules(model, _CompiledDropoutBlock)
        torch.manual_seed(1)
        compiled = []  # (graphs, frames) after each step
        with _Thread(draws=False):
            for _ in range(12):
                model(torch.randn(4, 8, dtype=torch.float64)).sum().backward()
                compiled.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
        return [p.grad for p in model.parameters()], compiled

    grads, compiled = train(checkpointed=True)
    plain_grads, plain_compiled = train(checkpointed=False)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    assert compiled[-1][0] == plain_compiled[-1][0] == (1 if inner is _TanhDropout else 0)  # the graphs plain makes
    # and nothing more compiled after the first step (dynamo tries some of memtrim's own functions once as frames of
    # their own, the recomputation's version check, a global pre-hook, among them: they make no graph)
    assert len(set(compiled)) == 1

"""Small shared pieces for the tests."""

import gc

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from memtrim.models import SeedMLP, SmallGPT


class ClipsItsOutput:
    """Mixin: the module's own forward, then activation clipping of its output in place under no_grad once ``clip``
    is set (a schedule switching it on later in training; None at first)."""

    clip = None

    def forward(self, *args):
        y = super().forward(*args)
        if self.clip is not None:
            with torch.no_grad():
                y.clamp_(-self.clip, self.clip)
        return y


class SpelledRMSNorm(torch.nn.Module):
    """An RMSNorm as HF's are written (convert recognises it by its ops; its multiply by the weight keeps the weight
    only where its input needs a gradient)."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def mlp_step_setup(batch: int = 64, inplace: bool = False):
    torch.manual_seed(0)
    model = SeedMLP(inplace=inplace)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, 784)
    y = torch.randint(0, 10, (batch,))
    return model, optimizer, x, y


def seed_mlp_batches(n: int = 10, batch: int = 16, seed: int = 1):
    """``n`` (inputs, targets) batches for the seed MLP from their own generator (the global one untouched)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)) for _ in range(n)]


def adam(model):
    """``make_optimizer`` for memtrim.verify: Adam at lr 1e-3."""
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def identity(model, optimizer):
    """The ``transform`` that changes nothing."""
    return model, optimizer


def train_step(model, optimizer, x, y, loss_fn=F.nll_loss):
    loss = loss_fn(model(x), y)
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def activation_bytes(fn, *args, model=None) -> int:
    """Activation bytes autograd keeps after ``fn(*args)``, from the tracker (``model`` labels its inputs)."""
    import memtrim

    with memtrim.track(model) as tracker:
        out = fn(*args)
        held = tracker.live_by_category()["activations"]
    del out
    return held


def cuda_workload(name: str):
    """(model, AdamW, inputs, targets, loss_fn) on CUDA, from seed 0: the seed MLP at batch 256 ("mlp") or the small
    GPT, 4 layers of 256 on 8x128 tokens ("gpt"). The CUDA tracker test and benchmarks/cuda_tracker_check.py."""
    torch.manual_seed(0)
    if name == "mlp":
        model = SeedMLP().cuda()
        x, y, loss_fn = torch.randn(256, 784, device="cuda"), torch.randint(0, 10, (256,), device="cuda"), F.nll_loss
    else:
        model = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128).cuda()
        x = y = torch.randint(0, 256, (8, 128), device="cuda")

        def loss_fn(out, t):
            return F.cross_entropy(out.flatten(0, 1), t.flatten())

    return model, torch.optim.AdamW(model.parameters()), x, y, loss_fn


class AllocatorAtOpEnds(TorchDispatchMode):
    """After every op: (its name, the CUDA allocator's allocated bytes, its requested bytes, before its rounding)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        requested = torch.cuda.memory_stats().get("requested_bytes.all.current")
        self.log.append((str(func), torch.cuda.memory_allocated(), requested))
        return out


class CountOp(TorchDispatchMode):
    """Counts the calls of one aten op (``count``) while active."""

    def __init__(self, op):
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def workers_can_fork() -> bool:
    """Whether the planner's workers would trace plans here: fork is safe, and a forked child can run a backward
    (torch 2.11's CUDA build refuses one in a child forked after a backward in this process)."""
    from memtrim.planner._workers import Tracer

    with Tracer(lambda combo: combo, workers=2, expected=3) as tracer:
        return tracer.parallel


def plan_of(*techniques: str):
    """A plan of ``techniques`` as memtrim.plan makes one (its peak and times unused: ``apply`` reads the names)."""
    from memtrim.planner.api import Plan

    return Plan(techniques, 0, {}, "optimizer", 1.0, "bitwise", True)


def graph_counts(model, *args, **kwargs) -> tuple[int, int]:
    """(graphs, graph breaks) torch.compile makes of ``model(*args, **kwargs)`` (dynamo reset before and after)."""
    torch._dynamo.reset()
    try:
        explanation = torch._dynamo.explain(model)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    return explanation.graph_count, explanation.graph_break_count


def graphs_alive():
    """Tensors anywhere in the process that still carry an autograd graph (after a collection): a graph left behind
    by a forward whose graph should be gone is a leak."""
    gc.collect()
    # (by exact type: isinstance on every object wakes deprecated module attributes that warn)
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.grad_fn is not None)


def captured_training(model, x, loss_of, replays: int = 3) -> int:
    """Train ``model`` as PyTorch's whole-network CUDA graph capture does: three eager AdamW steps on a side stream,
    one step (``loss_of(model(x)).backward()``, ``opt.step()``) captured, then ``replays`` replays. Returns the
    allocator's peak during the capture above the level before (what the graph's pool holds)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def step():
        loss_of(model(x)).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (memtrim's one-pass BatchNorm rebuild probes here: none while capturing)
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            step()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)  # the gradients are then the graph's own
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    peak = torch.cuda.max_memory_allocated() - base
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return peak


def while_capturing(monkeypatch) -> None:
    """Every converted module's ``capturing()`` true for the rest of the test, as while a CUDA graph is captured
    (``guards.as_if_capturing``; true on a CUDA device only, where tests/techniques/test_bn_relu.py and
    test_convert_models.py capture converted models)."""
    from memtrim.techniques import guards

    monkeypatch.setattr(guards, "_AS_IF_CAPTURING", True)


HOST_WAIT_OPS = frozenset({"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select", "_unique2",
                           "unique_consecutive", "repeat_interleave", "bincount"})
"""aten ops whose result's size or value the host reads: on a GPU each waits for it (and fails a graph's capture)."""


class HostWaits(TorchDispatchMode):
    """Counts the :data:`HOST_WAIT_OPS` run while active, by name (on any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_WAIT_OPS:
            self.found[name] = self.found.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def sgd_steps_alike(plain, converted, inputs) -> None:
    """One SGD-with-momentum step of each model per input (loss: the output's mean square), their state_dicts
    asserted bitwise equal after each."""
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (plain, converted)]
    for step, x in enumerate(inputs):
        for model, optimizer in zip((plain, converted), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
        for (name, a), b in zip(plain.state_dict().items(), converted.state_dict().values()):
            assert torch.equal(a, b), (step, name)


def step_under_parametrize_cached(opt, loss_of, backward_inside: bool) -> None:
    """One optimizer step whose forward (``loss_of()``) runs inside ``torch.nn.utils.parametrize.cached()``, its
    backward inside that context or after it."""
    from torch.nn.utils import parametrize

    opt.zero_grad()
    with parametrize.cached():
        loss = loss_of()
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    opt.step()

"""NOTE [ keep decisions made together ] (norms/_kernels.py): in a model ``convert`` changed, the norms that decide
which features keep their input decide together, once a forward (one ``nonzero``, one wait on a GPU), and the
model trains bitwise as when each norm decides at its own call. Compared here with a copy whose norms decide alone
(the hooks taken off), under the loops that could make a decision made earlier in the forward stale."""

import contextlib
import copy
import dataclasses
import io
import pickle
import threading

import pytest
import torch
from torch import nn

import memtrim
from memtrim.techniques.norms import _kernels

from ..helpers import CountOp, SpelledRMSNorm, graph_counts, while_capturing


class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.rms, self.up = SpelledRMSNorm(n), nn.Linear(n, 2 * n)
        self.ln, self.down = memtrim.nn.LayerNorm(2 * n), nn.Linear(2 * n, n)  # (keeps its output by hand)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.ln(self.up(self.rms(x)))))


class Net(nn.Module):
    """RMSNorms (convert's RMSNorm form), memtrim's LayerNorm and a BatchNorm + LeakyReLU (BatchNormAct): every
    kind that decides."""

    def __init__(self, n=16, depth=3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(n) for _ in range(depth))
        self.bn, self.act, self.head = nn.BatchNorm1d(n), nn.LeakyReLU(0.1), nn.Linear(n, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def trained_looking(model):
    """Weights whose decisions keep some features and change as they train: a zero gamma, tiny gammas, large
    betas."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (SpelledRMSNorm, nn.LayerNorm, nn.BatchNorm1d)):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.weight[0] = 0.0
                m.weight[1:3] = 1e-3
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g))
                    m.bias[3] = 40.0 * m.weight[3]  # |beta| / |gamma| = 40 > KEEP_BOUND: kept
    return model


def batch(seed=0):
    return torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(seed))


def deciding_alone(together):
    """A copy of a converted model whose norms decide alone (the model's hooks that group them taken off)."""
    alone = copy.deepcopy(together)
    alone._forward_pre_hooks.clear()
    alone._forward_hooks.clear()
    return alone


def converted_and_alone(make=Net, trained=True, plain=None, dtype=torch.float32):
    """The converted model and a copy whose norms decide alone; ``plain``, a list, gets the unconverted model."""
    torch.manual_seed(0)
    model = (trained_looking(make()) if trained else make()).to(dtype)
    if plain is not None:
        plain.append(copy.deepcopy(model))
    together, report = memtrim.convert(model, example_inputs=(batch().to(dtype),))
    kinds = {c.rule for c in report.changes}
    assert {"norm_by_behaviour", "batchnorm_activation"} <= kinds, str(report)
    assert together._forward_pre_hooks and together._forward_hooks
    return together, deciding_alone(together)


def count_nonzero():
    return CountOp(torch.ops.aten.nonzero.default)


class KeptSeen:
    """Records every non-empty decision (so a test knows its weights kept features)."""

    def __enter__(self):
        self.seen, self.decide = [], _kernels._keep_mask

        def recording(*args):
            mask = self.decide(*args)
            self.seen.append(int(mask.sum()))
            return mask

        _kernels._keep_mask = recording
        return self

    def __exit__(self, *exc):
        _kernels._keep_mask = self.decide


def train(model, steps, between=lambda model, step: None, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(batch(seed + step)).square().mean().backward()
        opt.step()
        between(model, step)
    return [p.detach().clone() for p in model.parameters()]


def grads(model, x, plain=False, between=lambda model: None):
    """The gradients of one step (a model converted in float64); ``plain``: every norm as torch's own (a user's
    saved-tensor hooks make memtrim's LayerNorm run as torch's); ``between``: run after the forward, before the
    backward."""
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t) if plain else contextlib.nullcontext()
    with hooks:
        loss = model(x.to(torch.float64)).square().mean()
    between(model)
    loss.backward()
    found = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return found


def assert_close_to_plain(converted, plain):
    """Within float64 rounding of torch's gradients: the norms rebuild their input (NOTE [ norms that keep their
    output ]), so not bitwise; a rebuild from the wrong weights is off by 1e-4 and more."""
    assert len(converted) == len(plain)
    for a, b in zip(converted, plain):
        assert (a is None) == (b is None)
        assert a is None or torch.allclose(a, b, rtol=1e-9, atol=1e-12), (a - b).abs().max()


def assert_refused(model, x):
    """The forward is refused, at its end."""
    with pytest.raises(memtrim.ConvertError, match="without its version moving"):
        model(x)


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_one_decision_a_forward_where_each_norm_made_its_own():
    counts = []
    for trained in (False, True):
        together, alone = converted_and_alone(trained=trained)
        for model in (together, alone):
            model(batch())  # (the first forward meets each norm once)
            with count_nonzero() as counter:
                model(batch(1))
            counts.append(counter.count)
    # 3 RMSNorms, 3 LayerNorms and a BatchNorm decide alone; together, where a feature keeps its input (the trained
    # weights), each then gathers its own
    assert counts == [1, 7, 8, 7], counts


def test_decided_together_trains_bitwise_as_each_norm_alone():
    together, alone = converted_and_alone()
    with KeptSeen() as kept:
        a = train(together, 6)
    b = train(alone, 6)
    assert max(kept.seen) > 0  # features were kept
    assert_bitwise(a, b)


def test_a_data_write_between_forwards_is_seen():
    # gradient accumulation: two forwards a step, a ``.data`` write (no version moves) between them; every forward
    # must decide afresh, also where no optimizer step moved the weights' versions in between
    together, alone = converted_and_alone()
    found = []
    for model in (together, alone):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(4):
            opt.zero_grad(set_to_none=True)
            model(batch(2 * step)).square().mean().backward()
            model.blocks[step % 3].rms.weight.data[5 + step] = 0.0
            model.bn.weight.data[6 + step] = 0.0
            model(batch(2 * step + 1)).square().mean().backward()
            opt.step()
        found.append([p.detach().clone() for p in model.parameters()])
    assert_bitwise(*found)


class WritesMidForward(Net):
    """Changes the last block's norm weight inside its own forward, after the first norm decided for all: in place
    (its version moves) or through ``.data`` (it does not)."""

    write, calls = "in place", 0

    def forward(self, x):
        x = self.blocks[0](x)
        self.calls += 1  # (another feature each forward)
        with torch.no_grad():
            weight = self.blocks[2].rms.weight
            (weight.data if self.write == ".data" else weight)[4 + self.calls % 10] = 0.0
        x = self.blocks[2](self.blocks[1](x))
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_an_in_place_write_during_the_forward_is_seen():
    together, alone = converted_and_alone(WritesMidForward)
    assert_bitwise(train(together, 4), train(alone, 4))


def test_a_data_write_during_the_forward_is_refused_then_the_norms_decide_alone():
    together, alone = converted_and_alone(WritesMidForward)
    for model in (together, alone):
        model.write = ".data"
    together(batch())  # (the first forward meets each norm once: each decides alone)
    alone(batch())
    assert_refused(together, batch())
    alone(batch())
    with count_nonzero() as counter:
        together(batch())
    alone(batch())
    assert counter.count == 7  # alone from now on
    assert_bitwise(train(together, 4), train(alone, 4))


class WritesAfterUse(Net):
    """Writes the second block's norm weight through ``.data`` in its own forward, after that norm ran."""

    calls = 0

    def forward(self, x):
        x = self.blocks[1](self.blocks[0](x))
        self.calls += 1
        self.blocks[1].rms.weight.data[4 + self.calls % 10] = 0.0
        x = self.blocks[2](x)
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_a_data_write_after_the_norm_ran_trains_as_torch():
    # the norm rebuilds its input in backward from its output and the weight it computed with (a copy), and reads the
    # weight itself where torch's backward does: a weight written after the norm's call (no version moves) gives
    # torch's gradients. Before e406254 such a write was refused at the forward's end (it rebuilt from the written
    # weight); before that, found by an adversarial pass, a write to the weight of the norm that decided went unseen
    # (1e-3 off plain)
    plain = []
    together, alone = converted_and_alone(WritesAfterUse, plain=plain, dtype=torch.float64)
    # at the first forward (each norm decides at its call), and at the next ones (together)
    for step in range(3):
        found = grads(together, batch(step))
        assert_close_to_plain(found, grads(plain[0], batch(step), plain=True))
        assert_bitwise(found, grads(alone, batch(step)))


class WritesAfterItRan(Net):
    """Writes a norm's weight through ``.data`` in its own forward after that norm ran: ``block`` 0's norm is the one
    that decides for the others; ``write`` zeroes features, or clamps them (no decision changes)."""

    block, write = 0, "zero"

    def forward(self, x):
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        weight = self.blocks[self.block].rms.weight
        if self.write == "zero":
            weight.data[4:6] = 0.0
        elif self.write == "clamp":
            weight.data.clamp_(max=1.0)
        elif self.write == "replace":  # (a same-size tensor set through .data: compared, not taken for a shard)
            weight.data = weight.data.clamp(max=1.0)
        x = self.blocks[2](x)
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


@pytest.mark.parametrize("block, write, hooks", [(0, "zero", None), (0, "clamp", None), (1, "clamp", None),
                                                 (0, "replace", None), (0, "zero", "hooked"), (0, "zero", "removed")])
def test_any_data_write_after_a_norm_ran_trains_as_torch(block, write, hooks):
    # to the weight of the norm that decided for the others or of a later one, one that changes no decision (a
    # clamp), a same-size tensor set through .data, in a model with a user's hook (its norms decide alone) or one
    # removed since: torch's gradients (before e406254 refused at the forward's end; found by an adversarial pass
    # before that, each trained silently 1e-3 off plain)
    plain = []
    together, _ = converted_and_alone(WritesAfterItRan, plain=plain, dtype=torch.float64)
    for model in (together, plain[0]):
        model.block, model.write = block, None
        if hooks is not None:
            handle = model.head.register_forward_hook(lambda module, args, out: None)
            model(batch())  # (seen with the hook)
            if hooks == "removed":
                handle.remove()
        model.write = write
    for step in range(2):
        assert_close_to_plain(grads(together, batch(step)), grads(plain[0], batch(step), plain=True))


def write_every_norm(model):
    """Writes every norm's weight and bias through ``.data`` (no version moves)."""
    for m in model.modules():
        if isinstance(m, (SpelledRMSNorm, nn.LayerNorm, nn.BatchNorm1d)):
            m.weight.data[4:6] = 0.0
            m.weight.data.mul_(1.5)
            if getattr(m, "bias", None) is not None:
                m.bias.data.add_(0.25)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_data_write_between_forward_and_backward_trains_as_torch(mode):
    # torch's backward reads the written weight with the input it kept; the rebuild reads the weights the forward
    # computed with. Before e406254 it read the written ones: a write between the forward and the backward (a
    # forward hook on the model, a user's clamp) was not seen, 1e-4 off plain
    plain = []
    together, alone = converted_and_alone(plain=plain, dtype=torch.float64)
    for model in (together, alone, plain[0]):
        getattr(model, mode)()
    for step in range(2):
        expected = grads(plain[0], batch(step), plain=True, between=write_every_norm)
        assert_close_to_plain(grads(together, batch(step), between=write_every_norm), expected)
        assert_close_to_plain(grads(alone, batch(step), between=write_every_norm), expected)


class WritesAndRestores(Net):
    """Writes the second block's norm weight through ``.data`` before that norm runs, and restores it after."""

    def forward(self, x):
        x = self.blocks[0](x)
        weight = self.blocks[1].rms.weight
        kept = weight.detach().clone()
        weight.data[4:8] = 0.0
        x = self.blocks[1](x)
        weight.data.copy_(kept)
        x = self.blocks[2](x)
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_a_data_write_restored_before_the_forward_ends_is_refused():
    # found by an adversarial pass: the check at the forward's end read the weights as they were then, restored, and
    # the norm had used a decision made from the old ones (gradients 4e-3 off deciding alone, silently); the check
    # compares the decision with the copy of what the norm computed with
    plain = []
    together, _ = converted_and_alone(WritesAndRestores, plain=plain, dtype=torch.float64)
    # the first forward (each norm decides at its call, from what it computed with) trains as torch
    assert_close_to_plain(grads(together, batch()), grads(plain[0], batch(), plain=True))
    assert_refused(together, batch().double())  # (the next decides together: the write comes after)


def test_the_decisions_cost_as_many_ops_at_any_depth():
    # the norms' masks are computed at once on their concatenated weights, at the decision and at the forward's end:
    # on a GPU each op is a kernel launch, at every forward
    counts = []
    for depth in (2, 6):
        torch.manual_seed(0)
        model, _ = memtrim.convert(Net(depth=depth), example_inputs=(batch(),))
        model(batch())
        with CountOp(torch.ops.aten.abs.default) as counter:
            model(batch(1))
        counts.append(counter.count)
    assert counts[0] == counts[1] > 0, counts


def prune(module, args):
    """Network slimming: a pre-hook re-zeroes the pruned gammas through .data before each norm runs (no version
    moves)."""
    module.weight.data.mul_(module.keep)


def slimmed(block):
    block.rms.keep = (torch.arange(16) % 4 != 1).float()
    block.rms.register_forward_pre_hook(prune)


def test_a_hook_removed_lets_the_norms_decide_together_again():
    # found by an adversarial pass: removing a hook makes no hook handle, so the cached walk said "hooked" for good and
    # every later forward decided norm by norm (a wait each on a GPU)
    together, _ = converted_and_alone(trained=False)
    handle = together.head.register_forward_hook(lambda module, args, out: None)
    together(batch())
    handle.remove()
    together(batch())
    with count_nonzero() as counter:
        together(batch())
    assert counter.count == 1


@pytest.mark.parametrize("forwards_before", [0, 2])
def test_a_model_with_a_users_forward_hooks_decides_alone(forwards_before):
    # forwards_before: the modules are walked for hooks again only when torch made a hook handle since the last walk;
    # one registered after the model ran (and found no hooks) must still be seen at the next forward
    together, alone = converted_and_alone()
    for model in (together, alone):
        for _ in range(forwards_before):
            model(batch())
        for block in model.blocks:
            slimmed(block)
    together(batch())
    with count_nonzero() as counter:
        together(batch())
    assert counter.count == 7
    assert_bitwise(train(together, 5), train(alone, 5))


def test_a_hooked_block_attached_after_forwards_is_refused_not_silent():
    # a submodule attached with its hooks already registered makes no hook handle: not walked until another one is
    # made, so its norms decide together; the pruning write its hook makes is then seen at the forward's end
    together, _ = converted_and_alone()
    together(batch())
    block = together.blocks[2]
    del together.blocks[2]
    slimmed(block)
    together(batch())  # (hooks registered since: walked again, no hook in the model then)
    together.blocks.append(block)
    assert_refused(together, batch())


class Interrupted(Net):
    interrupt = False

    def forward(self, x):
        x = self.blocks[0](x)
        if self.interrupt:
            raise KeyboardInterrupt
        return super().forward(x)


def test_a_forward_interrupted_by_keyboard_interrupt_leaves_no_open_forward():
    # torch runs no forward hook, not even an always-called one, on a KeyboardInterrupt: the open forward it leaves
    # must not serve the norms called after it
    together, alone = converted_and_alone(Interrupted)

    for model in (alone, together):
        model.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            model(batch())
        model.interrupt = False
    assert len(_kernels._LOCAL.stack) == 1  # (left open by together's forward)
    found = []
    for model in (together, alone):  # a block called by itself, its weights written through .data between calls
        grads = []
        for step in range(3):
            model.blocks[0].rms.weight.data[6 + step] = 0.0
            out = model.blocks[0](batch(step))
            grads.append(torch.autograd.grad(out.square().mean(), list(model.blocks[0].parameters())))
        found.append(grads)
    assert not _kernels._LOCAL.stack
    for a, b in zip(*found):
        assert_bitwise(a, b)


def test_forwards_interrupted_again_and_again_leave_no_open_forward():
    # found by an adversarial pass: each interrupted forward left its entry (its frame, the weights' copies) under the
    # next forward's, for good; the next forward of the model drops them now
    together, _ = converted_and_alone(Interrupted)
    for _ in range(3):
        together.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            together(batch())
        together.interrupt = False
    for _ in range(2):
        together(batch())
    assert not _kernels._LOCAL.stack


def released(model):
    """ZeRO-3's parameter release in plain torch: each block's parameters set to an empty tensor through ``.data``
    after its forward, gathered again in its forward pre-hook and before its backward."""
    store = {}

    def gather(block, args=None):
        for p in block.parameters():
            p.data = store[p]

    def release(block, args, out):
        for p in block.parameters():
            store[p], p.data = p.data, torch.empty(0, dtype=p.dtype)
        out.register_hook(lambda grad: gather(block))

    for block in model.blocks:
        store.update((p, p.data) for p in block.parameters())
        block.register_forward_pre_hook(gather)
        block.register_forward_hook(release)
    return model


def test_parameters_released_after_their_block_train_as_when_each_norm_decides_alone():
    # found by an adversarial pass: the end-of-forward check read weights a sharding framework had freed or set to a
    # shard after their block ran (FSDP2 crashed, ZeRO-3's release raised a size mismatch); those are left out now
    together, alone = converted_and_alone()
    assert_bitwise(train(released(together), 3), train(released(alone), 3))


class MeanTeacher(nn.Module):
    """A student and its teacher (a copy whose parameters still require grad); the teacher's output is detached,
    and the forward moves the teacher towards the student through ``.data`` after it ran."""

    def __init__(self):
        super().__init__()
        self.student = trained_looking(Net())
        self.teacher = copy.deepcopy(self.student)

    def forward(self, x):
        target = self.teacher(x).detach()
        for s, t in zip(self.student.parameters(), self.teacher.parameters()):
            t.data.mul_(0.9).add_(0.1 * s.data)
        return self.student(x) - target


@pytest.mark.parametrize("make", ["MeanTeacher", "TeacherAfterStudent"])
def test_a_teacher_written_around_its_detached_forward_is_not_refused(make):
    # found by adversarial passes: the teacher's norms' reads were checked though their graph was gone (its output
    # detached: no backward reads them), and every step raised; and, written before its forward, a teacher's gamma
    # crossing the keep bound between the decision and its call raised
    torch.manual_seed(0)
    together, _ = memtrim.convert(globals()[make](), example_inputs=(batch(),))
    alone = deciding_alone(together)
    assert_bitwise(train(together, 3), train(alone, 3))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # (the decisions read values: a trace warns)
def test_jit_trace_of_a_converted_model_with_grad_on():
    # found by an adversarial pass: the check's dtype views are no op torch.jit.trace records (an internal assert);
    # under tracing the check stands aside
    together, _ = converted_and_alone()
    traced = torch.jit.trace(together, (batch(),), check_trace=False)
    assert traced(batch()).shape == together(batch()).shape


def test_a_model_in_shared_memory_is_not_checked():
    # Hogwild (torch's mnist_hogwild): other processes step the shared weights in place, which moves no version here;
    # plain training reads them racily too, so the check leaves weights in shared memory out (an adversarial pass:
    # 33 of 120 steps raised)
    together, _ = converted_and_alone(WritesAfterItRan)
    together.share_memory()
    together.block, together.write = 1, "clamp"
    together(batch())


def test_a_converted_model_runs_on_meta_and_under_a_fake_mode():
    # found by an adversarial pass: the decisions' nonzero raised on meta tensors and under a FakeTensorMode without a
    # shape environment (memory estimates of models bigger than the machine); there no feature keeps its input
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    together, _ = converted_and_alone()
    on_meta = copy.deepcopy(together).to("meta")
    out = on_meta(batch().to("meta"))
    out.square().mean().backward()
    assert out.is_meta and all(p.grad is not None and p.grad.is_meta for p in on_meta.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        out = together(mode.from_tensor(batch()))
        out.square().mean().backward()
    assert isinstance(out, FakeTensor)


def test_functional_call_with_fast_weights_decides_for_them():
    together, alone = converted_and_alone()
    found = []
    for model in (together, alone):
        params = dict(model.named_parameters())
        fast = {k: (v * 0.5).where(torch.arange(v.numel()).reshape(v.shape) % 5 != 0, torch.zeros(()))
                for k, v in params.items()}
        model(batch())  # decisions for the model's own weights, made first
        out = torch.func.functional_call(model, fast, (batch(1),))
        found.append(torch.autograd.grad(out.square().mean(), list(fast.values())))
    assert_bitwise(*found)


def test_two_threads_train_as_one_after_the_other():
    together, alone = converted_and_alone()

    def grads(model, seed):
        out = model(batch(seed))
        return torch.autograd.grad(out.square().mean(), list(model.parameters()))

    expected = [grads(alone, s) for s in range(4)]
    found: dict[int, list] = {}
    barrier = threading.Barrier(2)

    def work(seeds):
        barrier.wait()
        for s in seeds:
            found[s] = grads(together, s)

    threads = [threading.Thread(target=work, args=(seeds,)) for seeds in ((0, 2), (1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in range(4):
        assert_bitwise(found[s], expected[s])


class Raising(Net):
    raise_now = False

    def forward(self, x):
        x = self.blocks[0](x)
        if self.raise_now:
            raise ValueError("a failing forward")
        return super().forward(x)


def test_a_forward_that_raises_leaves_no_open_forward():
    together, alone = converted_and_alone(Raising)
    together.raise_now = True
    with pytest.raises(ValueError, match="a failing forward"):
        together(batch())
    assert not getattr(_kernels._LOCAL, "stack", [])
    together.raise_now = False
    # a block called by itself decides alone; the model trains as before
    for model in (together, alone):
        with count_nonzero() as counter:
            model.blocks[1](batch())
        assert counter.count == 2
    assert_bitwise(train(together, 3), train(alone, 3))


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copied_model_decides_together_with_its_own_norms(how):
    together, alone = converted_and_alone(trained=False)
    if how == "deepcopy":
        copied = copy.deepcopy(together)
    elif how == "pickle":
        copied = pickle.loads(pickle.dumps(together))
    else:
        buffer = io.BytesIO()
        torch.save(together, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert_bitwise(train(copied, 4), train(alone, 4))
    assert_bitwise(train(together, 4), [p.detach() for p in copied.parameters()])
    with count_nonzero() as counter:
        copied(batch())
    assert counter.count == 1


class SameName(SpelledRMSNorm):
    """Another class named ``SpelledRMSNorm`` (as in another module; pickle finds it by its qualified name)."""


SameName.__name__ = "SpelledRMSNorm"


def test_two_norm_classes_of_one_name_pickle_each_as_its_own():
    # found by the full suite: a converted norm's class is made per base class and was pickled by its name, which
    # two base classes of one name (a library's RMSNorm and a user's) share: pickling the second failed
    other = SameName
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(16, 16), cls(16), nn.Linear(16, 4)) for cls in (SpelledRMSNorm, other)]
    for model in models:
        _, report = memtrim.convert(model, example_inputs=(batch(),))
        assert [c.rule for c in report.changes] == ["norm_by_behaviour"], str(report)
    assert type(models[0][1]).__name__ == type(models[1][1]).__name__ and type(models[0][1]) is not type(models[1][1])
    for model in models:
        copied = pickle.loads(pickle.dumps(model))
        assert type(copied[1]) is type(model[1])
        assert torch.equal(copied(batch()), model(batch()))


def test_a_converted_model_saved_whole_loads_in_a_new_process(tmp_path):
    # its norms' classes are made again from their base classes there (before, only where convert had run)
    import subprocess
    import sys

    together, _ = converted_and_alone()
    torch.save(together, tmp_path / "model.pt")
    torch.save(batch(), tmp_path / "x.pt")
    script = (
        "import torch\n"
        f"model = torch.load({str(tmp_path / 'model.pt')!r}, weights_only=False)\n"
        f"out = model(torch.load({str(tmp_path / 'x.pt')!r}, weights_only=True))\n"
        "out.square().mean().backward()\n"
        f"torch.save((out.detach(), [p.grad for p in model.parameters()]), {str(tmp_path / 'out.pt')!r})\n"
        "print(type(model.blocks[0].rms).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == type(together.blocks[0].rms).__name__
    out, grads = torch.load(tmp_path / "out.pt", weights_only=True)
    expected = together(batch())
    expected.square().mean().backward()
    assert torch.equal(out, expected)
    assert_bitwise(grads, [p.grad for p in together.parameters()])


def test_a_second_convert_adds_no_hooks():
    together, _ = converted_and_alone()
    hooks = (len(together._forward_pre_hooks), len(together._forward_hooks))
    memtrim.convert(together, example_inputs=(batch(),))
    assert (len(together._forward_pre_hooks), len(together._forward_hooks)) == hooks


def test_a_model_without_deciding_norms_gets_no_hooks():
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    _, report = memtrim.convert(model, example_inputs=(torch.randn(4, 16),))
    assert report.changes and not model._forward_pre_hooks and not model._forward_hooks


def test_the_hooks_add_no_graph_break():
    torch.manual_seed(0)
    plain = trained_looking(Net())
    together, _ = memtrim.convert(copy.deepcopy(plain), example_inputs=(batch(),))
    assert graph_counts(together, batch()) == graph_counts(plain, batch())


def test_a_converted_hf_llama_decides_once_a_forward_and_trains_as_before():
    from tests.techniques.test_convert_models import ids, llama

    torch.manual_seed(0)
    plain = llama()
    together, report = memtrim.convert(copy.deepcopy(plain), example_inputs=ids())
    assert sum(c.rule == "norm_by_behaviour" for c in report.changes) == 5  # 2 a layer and the final one
    alone = deciding_alone(together)
    counts, found = [], []
    for model in (together, alone):
        model(**ids())  # (the first forward meets each norm once)
        with count_nonzero() as counter:
            model(**ids())
        counts.append(counter.count)
        trained_looking_llama(model)  # (features that keep their input: each norm then gathers its own)
        model(**ids()).logits.square().mean().backward()
        found.append([p.grad for p in model.parameters()])
    assert counts == [1, 5], counts
    assert_bitwise(*found)


def trained_looking_llama(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p[0], p[1:3] = 0.0, 1e-3


def test_transformers_own_hooks_leave_the_decisions_together():
    # found by an adversarial pass: one call with output_attentions=True leaves transformers' output-recording forward
    # hooks on every layer, and enable_input_require_grads() one on the embeddings; they never write a weight, and
    # every later forward decided alone (5 waits instead of 1)
    from tests.techniques.test_convert_models import ids, llama

    torch.manual_seed(0)
    model, _ = memtrim.convert(llama(), example_inputs=ids())
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        model(**ids(), output_attentions=True)
    model.enable_input_require_grads()
    from memtrim.techniques.guards import memtrims

    assert any(not memtrims(h) for m in model.modules() for h in (*m._forward_hooks.values(),
                                                                   *m._forward_pre_hooks.values()))
    assert _kernels._hooked(model) is False
    model(**ids())
    with count_nonzero() as counter:
        model(**ids())
    assert counter.count == 1


class RegrowsMidForward(Net):
    """Sets a zero gamma of the last block's norm back to 1 through ``.data`` in its own forward, after the first
    norm decided (the decision keeps that feature's input, which the norm no longer needs)."""

    def forward(self, x):
        x = self.blocks[0](x)
        self.blocks[2].rms.weight.data[0] = 1.0
        x = self.blocks[2](self.blocks[1](x))
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_a_decision_that_keeps_more_than_the_weights_need_is_not_refused():
    # found by an adversarial pass: the check compared the decisions whole, so a feature kept that the weight written
    # since no longer needed raised where plain trains; a kept feature's xhat is exact (gradients 2.8e-16 off plain)
    plain = []
    together, _ = converted_and_alone(RegrowsMidForward, plain=plain, dtype=torch.float64)
    for step in range(3):
        for model in (together, plain[0]):
            model.blocks[2].rms.weight.data[0] = 0.0
        assert_close_to_plain(grads(together, batch(step)), grads(plain[0], batch(step), plain=True))


class TeacherAfterStudent(nn.Module):
    """A student, then the teacher moved towards it through ``.data`` (an EMA), then the teacher, whose output is
    detached: its norms take decisions made at the student's first norm, from the teacher's weights before the EMA."""

    def __init__(self):
        super().__init__()
        self.student = trained_looking(Net())
        self.teacher = copy.deepcopy(self.student)
        with torch.no_grad():
            for model in (self.student, self.teacher):
                model.blocks[0].ln.bias[6] = 8.0
            self.student.blocks[0].ln.weight[6] = 0.0
            self.teacher.blocks[0].ln.weight[6] = 1.2  # 1.08 after the first EMA: |beta| / |gamma| 7.4, not kept;
                                                       # 0.97 after the next: 8.2, kept (decided from 1.08 before it)

    def forward(self, x):
        out = self.student(x)
        for s, t in zip(self.student.parameters(), self.teacher.parameters()):
            t.data.mul_(0.9).add_(0.1 * s.data)
        return out - self.teacher(x).detach()


class LocalLosses(Net):
    """Greedy local learning: the first two blocks' own loss is backpropagated inside the forward, after the second
    block's LayerNorm weight was zeroed through ``.data`` (``write``) after the decisions."""

    write = False

    def forward(self, x):
        x = self.blocks[0](x)
        if self.write:
            self.blocks[1].ln.weight.data[4:8] = 0.0
        x = self.blocks[1](x)
        x.square().mean().backward()
        x = self.blocks[2](x.detach())
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_a_backward_inside_the_forward_checks_its_norms_decision_before_using_it():
    # found by an adversarial pass: a backward through a norm run before its forward's end used a stale decision
    # (NaN gradients) before the check at the end refused the forward; that norm's backward reads it now
    together, _ = converted_and_alone(LocalLosses)
    together(batch())
    together.write = True
    with pytest.raises(memtrim.ConvertError, match="without its version moving"):
        together(batch())
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in together.parameters())


class ShardedBetween(nn.Module):
    """FSDP1's sharded views (``use_orig_params=True``) in plain torch: between its calls, a norm's weight and bias are
    views of this rank's shard (``.data`` set to a slice of the flat parameter, which moves no version), gathered
    again for its call and for its backward; the first norm decides for it from the shard."""

    def __init__(self, shard):
        super().__init__()
        self.a, self.lin, self.b = memtrim.nn.LayerNorm(16), nn.Linear(16, 16), memtrim.nn.LayerNorm(16)
        with torch.no_grad():
            for norm in (self.a, self.b):
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_()
            self.b.weight[0] = self.b.weight[5] = 0.0  # (features that keep their input)
        self.shard, self.full = shard, None

    def start(self):
        self.full = {p: p.data for p in (self.b.weight, self.b.bias)}
        self.release()

    def release(self):
        for p, full in self.full.items():
            p.data = full[: self.shard]

    def gather(self):
        for p, full in self.full.items():
            p.data = full

    def forward(self, x):
        h = self.lin(self.a(x))
        if self.full is None:
            return self.b(h)
        self.gather()
        out = self.b(h)
        self.release()
        out.register_hook(lambda grad: self.gather())
        return out


@pytest.mark.parametrize("shard", [1, 8])
def test_a_norm_sharded_between_its_calls_decides_from_its_full_weight(shard):
    # found by an adversarial pass: the first norm decided for the second from its one-element shard, the decision
    # held (no version moved) and kept one feature of the full weight: NaN gradients from the next step, unseen; with a
    # shard of 8, every step raised a size mismatch in the check. A decision now holds only for the shapes it was
    # made from
    torch.manual_seed(0)
    model = ShardedBetween(shard).double()
    plain = copy.deepcopy(model)
    converted, _ = memtrim.convert(model, example_inputs=(batch().double(),))
    for m in (converted, plain):
        m.start()
    for step in range(3):
        found = []
        for m, is_plain in ((converted, False), (plain, True)):
            found.append(grads(m, batch(step), plain=is_plain))
            m.release()
        assert_close_to_plain(*found)


class AuxiliaryNorm(Net):
    """A diagnostic LayerNorm whose output is only used detached, its gamma written through ``.data`` before it runs
    (``mask``), and the first two blocks' own loss backpropagated inside the forward."""

    def __init__(self):
        super().__init__()
        self.aux = memtrim.nn.LayerNorm(16)
        self.mask = False

    def forward(self, x):
        h = self.blocks[0](x)
        self.aux.weight.data[2] = 0.0 if self.mask else 1.0
        diagnostic = self.aux(h)
        h = self.blocks[1](h)
        h.square().mean().backward()
        self.stat = diagnostic.detach().abs().mean()
        h = self.blocks[2](h.detach())
        return self.head(self.act(self.bn(h.transpose(1, 2))).transpose(1, 2))


def test_a_backward_inside_the_forward_reads_only_its_own_norms_decisions():
    # found by an adversarial pass: the backward inside the forward read every decision taken so far, so a norm off its
    # path (a diagnostic used detached), whose graph is gone by the forward's end, was refused where plain trains
    plain = []
    together, _ = converted_and_alone(AuxiliaryNorm, plain=plain, dtype=torch.float64)
    together.zero_grad(set_to_none=True)  # (convert's traced forwards ran the inner backward too: README)
    for step in range(3):
        for m in (together, plain[0]):
            m.mask = step >= 1
        assert_close_to_plain(grads(together, batch(step)), grads(plain[0], batch(step), plain=True))


# ---------------------------------------------------------------------- NOTE [ the check read at the backward ]
# On a GPU the forward's end check is read when a backward reaches the model's output (no wait at the forward's
# end); READ_AT_BACKWARD_ON_CPU runs that path on the CPU.


@pytest.fixture
def read_at_backward(monkeypatch):
    monkeypatch.setattr(_kernels, "READ_AT_BACKWARD_ON_CPU", True)


def test_read_at_the_backward_a_data_write_refuses_the_backward_before_any_gradient(read_at_backward):
    together, alone = converted_and_alone(WritesMidForward)
    for model in (together, alone):
        model.write = ".data"
    together(batch())  # (the first forward meets each norm once: each decides alone)
    alone(batch())
    loss = together(batch()).square().mean()  # (not refused at its end: its flag is not read there)
    alone(batch())
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        loss.backward()
    assert all(p.grad is None for p in together.parameters())  # refused before any of the model's gradients
    with count_nonzero() as counter:
        together(batch())
    alone(batch())
    assert counter.count == 7  # alone from now on, as when refused at the forward's end
    assert_bitwise(train(together, 4), train(alone, 4))


class KeepsAnActivation(WritesMidForward):
    """Keeps the last block's output, on which a loss can be computed without passing the model's output."""

    def forward(self, x):
        x = self.blocks[0](x)
        self.calls += 1
        with torch.no_grad():
            self.blocks[2].rms.weight.data[4 + self.calls % 10] = 0.0
        self.kept = x = self.blocks[2](self.blocks[1](x))
        return self.head(self.act(self.bn(x.transpose(1, 2))).transpose(1, 2))


def test_read_at_the_backward_a_backward_that_misses_the_output_is_refused_at_the_norm(read_at_backward):
    together, _ = converted_and_alone(KeepsAnActivation)
    together(batch())
    together(batch())
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        together.kept.square().mean().backward()
    assert together.blocks[2].rms.weight.grad is None  # (refused before the norm's gradients)


def test_read_at_the_backward_trains_bitwise_as_each_norm_alone(read_at_backward):
    # no write: nothing refused, a forward no backward reaches, a graph kept for a second backward
    together, alone = converted_and_alone()
    for model in (together, alone):
        model(batch(7))  # (never backpropagated)
        out = model(batch(8))
        out.square().mean().backward(retain_graph=True)
        out.abs().mean().backward()
    assert_bitwise([p.grad for p in together.parameters()], [p.grad for p in alone.parameters()])
    for model in (together, alone):
        model.zero_grad(set_to_none=True)
    assert_bitwise(train(together, 4), train(alone, 4))


def test_read_at_the_backward_is_refused_at_the_forwards_end_under_torch_distributed(read_at_backward,
                                                                                        monkeypatch):
    # an error inside DDP's backward leaves its reducer waiting for gradients, and every later step fails
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    together, _ = converted_and_alone(WritesMidForward)
    together.write = ".data"
    together(batch())
    assert_refused(together, batch())


@pytest.mark.cuda
def test_on_cuda_the_check_is_read_at_the_backward_and_trains_as_each_norm_alone():
    together, alone = converted_and_alone(WritesMidForward)
    together, alone = together.cuda(), alone.cuda()
    # no write: bitwise as each norm alone
    for model in (together, alone):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(batch(step).cuda()).square().mean().backward()
            opt.step()
    assert_bitwise(list(together.parameters()), list(alone.parameters()))
    # a .data write: the forward is not refused, its backward is, before any of the model's gradients
    together.write = ".data"
    together.zero_grad(set_to_none=True)
    loss = together(batch().cuda()).square().mean()
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        loss.backward()
    assert all(p.grad is None for p in together.parameters())


class ReturnsAView(WritesMidForward):
    """Returns its output as a view, which the user changes in place (``logits.div_(t)``)."""

    def forward(self, x):
        return super().forward(x).view(-1, 4)


def test_read_at_the_backward_an_output_view_changed_in_place_is_refused_before_any_gradient(read_at_backward):
    # found by an adversarial pass: the in-place change rebased the view's history onto its base, the view's own node
    # (the only one hooked) was left out of the graph, and the refusal came at the last checked norm, after the head's
    # gradients (used already by an optimizer stepped in backward)
    together, _ = converted_and_alone(ReturnsAView)
    together.write = ".data"
    together(batch())
    out = together(batch())
    out.mul_(2.0)
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        out.square().mean().backward()
    assert all(p.grad is None for p in together.parameters())


@dataclasses.dataclass
class Output:
    out: torch.Tensor


class ReturnsADataclass(WritesMidForward):
    def forward(self, x):
        return Output(super().forward(x))


def test_read_at_the_backward_an_output_it_cannot_hook_is_refused_at_the_forwards_end(read_at_backward):
    # found by an adversarial pass: no tensor found in the output (a dataclass), no hook, and the refusal came after
    # the head's gradients; read at the forward's end instead, as on the CPU
    together, _ = converted_and_alone(ReturnsADataclass)
    together.write = ".data"
    together(batch())
    assert_refused(together, batch())


class ReturnsADiagnostic(Net):
    """Returns a view made under no_grad of a tensor it then changes in place (torch refuses to give its grad_fn)."""

    def forward(self, x):
        h = self.blocks[0](x) * 1.0
        with torch.no_grad():
            diagnostic = h[:, 0]
        h.add_(1.0)
        return super().forward(h), diagnostic


@pytest.mark.parametrize("gpu_path", [False, True])
def test_a_no_grad_view_in_the_output_trains_as_each_norm_alone(gpu_path, monkeypatch):
    # found by an adversarial pass: reading that view's grad_fn raised at every forward's end
    monkeypatch.setattr(_kernels, "READ_AT_BACKWARD_ON_CPU", gpu_path)
    together, alone = converted_and_alone(ReturnsADiagnostic)
    found = []
    for model in (together, alone):
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(batch(step))[0].square().mean().backward()
            opt.step()
        found.append([p.detach().clone() for p in model.parameters()])
    assert_bitwise(*found)


def test_read_at_the_backward_does_not_walk_the_model_at_every_forward(read_at_backward, monkeypatch):
    # found by an adversarial pass: each forward's output pre-hook made a hook handle, and torch's handle count moving
    # made the model's norms walk its modules for foreign hooks at every forward (1.35 ms a forward of a 32-layer
    # Llama on the CPU)
    together, _ = converted_and_alone()
    other, _ = converted_and_alone()
    walked = []
    walk = _kernels._hooked
    monkeypatch.setattr(_kernels, "_hooked", lambda model: walked.append(model) or walk(model))
    for step in range(4):
        for model in (together, other):
            model(batch(step)).square().mean().backward()
    assert walked == [together, other]  # once each (their first forward since the patch), not at every forward
    together.blocks[0].register_forward_hook(lambda *args: None)  # a hook of the user's: seen at the next forward
    together(batch())
    assert walked[-1] is together and len(walked) == 3


def in_thread(fn, *args):
    found = []
    worker = threading.Thread(target=lambda: found.append(fn(*args)))
    worker.start()
    worker.join()
    return found[0]


class AlsoReturnsItsInput(WritesMidForward):
    def forward(self, x):
        return super().forward(x), x[:, 0]


@pytest.mark.parametrize("in_a_thread", [False, True])
def test_read_at_the_backward_hooks_no_node_made_before_the_forward(in_a_thread, read_at_backward):
    # found by adversarial passes: the view of its input a model returned had its base hooked, a tensor made upstream
    # that a later forward's backward passed too; a forward no backward reached, written through .data, then had
    # that later, clean backward refused where plain trains. Then, telling nodes made in the forward by autograd's
    # node numbers, which count per thread, a forward in a thread of its own still hooked that tensor's node
    together, alone = converted_and_alone(AlsoReturnsItsInput)
    torch.manual_seed(1)
    up = nn.Linear(16, 16)
    grads = []
    for model in (together, alone):
        model(batch())  # (the first forward meets each norm once: each decides alone)
        model.zero_grad(set_to_none=True)
        up.zero_grad(set_to_none=True)
        e = up(batch(1))
        model.write = ".data"
        in_thread(model, e[:2]) if in_a_thread else model(e[:2])  # never backpropagated: never read
        model.write = "in place"
        out, first = model(e[2:])
        (out.square().mean() + first.sum()).backward()
        grads.append([p.grad.clone() for p in (*model.parameters(), *up.parameters())])
    assert_bitwise(*grads)


@pytest.mark.parametrize("clip", [None, 0.01])
def test_optimizer_in_backward_makes_the_model_walk_its_modules_once(clip, monkeypatch):
    # found by adversarial passes: OptimizerInBackward's output hooks, made at every forward, and with clipping the
    # global forward pre-hook and loss pre-hook of opt.backward(loss)'s two passes, made at every step, moved torch's
    # hook handle count, and the converted model's norms walked its modules for foreign hooks at every forward (1.3
    # ms a forward of a 32-layer Llama on the CPU)
    together, _ = converted_and_alone()
    opt = memtrim.OptimizerInBackward(torch.optim.AdamW(together.parameters(), lr=0.05), model=together,
                                      clip_grad_norm=clip)
    walked = []
    walk = _kernels._hooked
    monkeypatch.setattr(_kernels, "_hooked", lambda model: walked.append(model) or walk(model))
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        loss = together(batch(step)).square().mean()
        opt.backward(loss) if clip else loss.backward()
        opt.step()
    assert len(walked) == 1


class HeadInAThread(WritesMidForward):
    """Runs its head in a thread of its own (autograd numbers each thread's nodes from its own count)."""

    def forward(self, x):
        x = self.blocks[0](x)
        self.calls += 1
        with torch.no_grad():
            weight = self.blocks[2].rms.weight
            (weight.data if self.write == ".data" else weight)[4 + self.calls % 10] = 0.0
        x = self.blocks[2](self.blocks[1](x))
        return in_thread(self.head, self.act(self.bn(x.transpose(1, 2))).transpose(1, 2)), x.mean()


def test_read_at_the_backward_an_output_made_in_another_thread_is_refused_before_any_gradient(read_at_backward):
    # found by an adversarial pass: output nodes were told from nodes made before the forward by autograd's node
    # numbers, which count per thread; the head's logits made in a thread of their own were not hooked, and the
    # refusal came after the head's gradients
    together, _ = converted_and_alone(HeadInAThread)
    together.write = ".data"
    together(batch())
    out, _ = together(batch())
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        out.square().mean().backward()
    assert all(p.grad is None for p in together.parameters())


class EndsWithItsCheckedNorm(nn.Module):
    """Two norms: the first decides for both, and the model's output is the second's, the first checked norm's;
    ``write``: the second's weight zeroed through ``.data`` between them."""

    def __init__(self):
        super().__init__()
        self.first, self.lin, self.second = memtrim.nn.LayerNorm(16), nn.Linear(16, 16), memtrim.nn.LayerNorm(16)
        self.write, self.calls = False, 0

    def forward(self, x):
        h = self.lin(self.first(x))
        if self.write:
            self.calls += 1
            self.second.weight.data[self.calls % 16] = 0.0
        return self.second(h)


def test_read_at_the_backward_an_output_made_by_the_first_checked_norm_is_hooked(read_at_backward):
    # found by an adversarial pass: its node was left out (read at the forward's end, a wait on a GPU)
    torch.manual_seed(0)
    model, _ = memtrim.convert(EndsWithItsCheckedNorm(), example_inputs=(batch(),))
    assert model._forward_hooks
    model(batch())  # (the first forward meets each norm once: each decides alone)
    model.write = True
    out = model(batch())  # (not refused at its end)
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        out.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())


class LongBlocks(nn.Module):
    """Blocks whose output is 100 ops past their last norm, returned as hidden states after the head's output;
    ``write``: the second block's norm weight zeroed through ``.data`` after the first norm decided."""

    def __init__(self, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(16) for _ in range(depth))
        self.head = nn.Linear(16, 4)
        self.write, self.calls = False, 0

    def forward(self, x):
        hidden = []
        for i, block in enumerate(self.blocks):
            if i == 1 and self.write:
                self.calls += 1
                self.blocks[1].rms.weight.data[4 + self.calls % 10] = 0.0
            h = block.down(torch.nn.functional.gelu(block.ln(block.up(block.rms(x)))))
            for _ in range(100):
                h = h * 1.0
            x = x + h
            hidden.append(x)
        return self.head(x), tuple(hidden)


def test_read_at_the_backward_hidden_states_far_from_their_norms_are_hooked(read_at_backward):
    # found by an adversarial pass: a returned hidden state more nodes past its norm than the search looks at was not
    # hooked, and a backward through it was refused after the gradients it reached first (an optimizer stepped them);
    # each is found from the one before
    torch.manual_seed(0)
    model, _ = memtrim.convert(trained_looking(LongBlocks()), example_inputs=(batch(),))
    model(batch())  # (the first forward meets each norm once: each decides alone)
    model.write = True
    _, hidden = model(batch())
    with pytest.raises(memtrim.ConvertError, match="its backward is refused"):
        hidden[2].square().mean().backward()
    assert all(p.grad is None for p in model.parameters())


def test_while_a_cuda_graph_is_captured_the_norms_that_decide_run_as_torchs(monkeypatch):
    # gathering the kept features (nonzero) waits for the GPU, which fails a capture, and a decision recorded at the
    # capture would hold at every replay while the weights change: the RMSNorms, LayerNorms and the BatchNorm fused
    # with its LeakyReLU run as torch's modules there (NOTE [ keep decisions while a CUDA graph is captured ])
    plain = []
    together, _ = converted_and_alone(plain=plain)
    plain = plain[0]
    while_capturing(monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, together)]
    for step in range(2):
        for model, opt in zip((plain, together), opts):
            opt.zero_grad()
            with count_nonzero() as counter:
                model(batch(step)).square().mean().backward()
            assert counter.count == 0
            opt.step()
        for (name, a), b in zip(plain.state_dict().items(), together.state_dict().values()):
            assert torch.equal(a, b), (step, name)


def test_a_decision_reached_while_a_cuda_graph_is_captured_raises_a_clear_error(monkeypatch):
    # the last line of defence: CUDA's own error names no fix
    monkeypatch.setattr(_kernels, "capturing", lambda mask: True)
    with pytest.raises(memtrim.ConvertError, match="CUDA graph being captured.*module_filter"):
        _kernels._indices(torch.tensor([True, False, True]))

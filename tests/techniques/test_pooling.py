"""Compact max-pool indices (NOTE [ compact max-pool indices ]): torch's output and gradients bitwise, one byte kept per
output element where torch keeps eight, torch's own op wherever nothing is kept."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import memtrim
from memtrim.functional import max_pool2d

# (input shape, kernel, stride, padding, dilation, ceil_mode)
GEOMETRIES = [
    ((2, 3, 17, 17), 3, 2, 1, 1, False),  # the ResNet stem's pool
    ((2, 3, 16, 16), 2, 2, 0, 1, False),
    ((1, 2, 13, 11), (3, 2), (2, 1), (1, 0), (2, 3), True),  # non-square, dilated, ceil mode
    ((1, 2, 2, 2), 3, 1, 1, 1, False),  # a window wider than the input: two cells, one input position
    ((3, 9, 9), 3, 3, 0, 1, True),  # unbatched
    ((1, 1, 20, 20), 17, 1, 8, 1, False),  # 289 cells: int16 offsets
]


def _pair(x: torch.Tensor, geometry) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, gradient) of torch's pool and of memtrim's on the same input and upstream gradient."""
    _, kernel, stride, padding, dilation, ceil = geometry
    results = []
    for pool in (nn.functional.max_pool2d, max_pool2d):
        leaf = x.detach().clone().requires_grad_()
        out = pool(leaf * 1, kernel, stride, padding, dilation, ceil_mode=ceil)
        upstream = torch.arange(out.numel(), dtype=x.dtype, device=x.device).view(out.shape).sin()
        out.backward(upstream)
        results += [out, leaf.grad]
    return tuple(results)


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[0])) + f"_k{g[1]}")
def test_output_and_gradient_are_torchs_bitwise(geometry):
    torch.manual_seed(0)
    x = torch.randn(geometry[0])
    x.view(-1)[::5] = 0.5  # ties inside windows: torch's kernel picks the first, decoded back the same
    x.view(-1)[3] = float("-inf")
    plain_out, plain_grad, out, grad = _pair(x, geometry)
    assert torch.equal(out, plain_out)
    assert torch.equal(grad, plain_grad)


@pytest.mark.parametrize("arguments", [((3,), (2,), (1,)), (3, ()), ([3, 2], [2], 0)],
                         ids=["one-element tuples", "empty stride", "lists"])
def test_arguments_are_read_as_torch_reads_them(arguments):
    x = torch.randn(1, 2, 9, 9)
    for pool in (nn.functional.max_pool2d, max_pool2d):
        leaf = x.clone().requires_grad_()
        out = pool(leaf, *arguments)
        out.square().sum().backward()
        if pool is nn.functional.max_pool2d:
            expected = (out, leaf.grad)
    assert torch.equal(out, expected[0]) and torch.equal(leaf.grad, expected[1])


@pytest.mark.parametrize("arguments", [{"kernel_size": (2, 2, 2)}, {"kernel_size": 2, "stride": (1, 1, 1)},
                                       {"kernel_size": 2.5}, {"kernel_size": 2, "dilation": 1.0},
                                       {"kernel_size": True}, {"kernel_size": 2, "padding": (0, 0, 0)}],
                         ids=["3 kernel sizes", "3 strides", "float kernel", "float dilation", "bool", "3 paddings"])
def test_arguments_torch_refuses_are_refused_with_its_errors(arguments):
    # they ran as the first two elements, or as int(2.5), where a gradient was wanted (an adversarial pass)
    x = torch.randn(1, 2, 9, 9, requires_grad=True)
    with pytest.raises((TypeError, RuntimeError)) as torchs:
        nn.functional.max_pool2d(x, **arguments)
    wrong = next(name for name, value in arguments.items() if value != 2 or isinstance(value, bool))
    assert wrong in str(torchs.value)
    with pytest.raises(torchs.type, match=f"max_pool2d.*'?{wrong}'? must"):
        max_pool2d(x, **arguments)


def test_the_steps_peak_is_at_most_the_offsets_above_torchs_where_the_pools_backward_is_the_peak():
    # decoding the offsets in backward put an int32 copy and two int64 tensors beside torch's one index: a stride-1
    # pool at the top of a net peaked 1,187,912 B (18 %) above torch's step (an adversarial pass on 2026-12-03)
    def step_peak(pool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), pool,
                              nn.Conv2d(32, 4, 1), nn.Flatten(), nn.Linear(4 * 32 * 32, 1))
        x = torch.randn(8, 3, 32, 32)
        optimizer = torch.optim.SGD(model.parameters(), 0.01)
        for _ in range(2):
            with memtrim.track(model, optimizer) as tracker:
                optimizer.zero_grad()
                model(x).square().mean().backward()
                optimizer.step()
        return tracker.report().peak_bytes

    offsets = 8 * 32 * 32 * 32  # one byte per output element
    plain, compact = step_peak(nn.MaxPool2d(3, 1, 1)), step_peak(memtrim.nn.MaxPool2d(3, 1, 1))
    assert compact <= plain + offsets


def test_forward_mode_ad_runs_torchs_own_ops():
    # a custom autograd.Function has no jvp: under forward AD the modules are torch's own (as under torch.func)
    import torch.autograd.forward_ad as fwad

    x, tangent = torch.randn(1, 2, 9, 9), torch.randn(1, 2, 9, 9)
    for module, reference in ((memtrim.nn.MaxPool2d(3, 2, 1), nn.MaxPool2d(3, 2, 1)),
                              (memtrim.nn.LayerNorm(9), nn.LayerNorm(9))):
        results = []
        for m in (module, reference):
            with fwad.dual_level():
                results.append(fwad.unpack_dual(m(fwad.make_dual(x, tangent))).tangent)
        assert torch.equal(results[0], results[1])


def test_channels_last_and_float64_are_bitwise():
    x = torch.randn(2, 4, 15, 15, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    plain_out, plain_grad, out, grad = _pair(x, ((), 3, 2, 1, 1, False))
    assert torch.equal(out, plain_out) and torch.equal(grad, plain_grad)


def _saved_bytes(fn, x: torch.Tensor) -> list[tuple[str, int]]:
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fn(x)
    return sorted((str(t.dtype), t.nbytes) for t in saved)


def test_keeps_one_byte_per_output_element_where_torch_keeps_eight():
    x = torch.randn(2, 8, 32, 32, requires_grad=True)
    outputs = 2 * 8 * 16 * 16
    plain = _saved_bytes(lambda t: nn.functional.max_pool2d(t, 3, 2, 1), x)
    compact = _saved_bytes(lambda t: max_pool2d(t, 3, 2, 1), x)
    assert plain == sorted([("torch.float32", x.nbytes), ("torch.int64", 8 * outputs)])
    assert compact == sorted([("torch.float32", x.nbytes), ("torch.uint8", outputs)])


def test_double_backward_is_torchs():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 9, 9, dtype=torch.float64)
    results = []
    for pool in (nn.functional.max_pool2d, max_pool2d):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(pool(leaf * leaf, 3, 2, 1).square().sum(), leaf, create_graph=True)
        (gg,) = torch.autograd.grad(g.sin().sum(), leaf)
        results.append((g.detach(), gg))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_torchs_own_op_where_nothing_is_kept():
    x = torch.randn(1, 2, 8, 8)
    assert max_pool2d(x, 2).grad_fn is None
    with torch.no_grad():
        assert max_pool2d(x.requires_grad_(), 2).grad_fn is None
    grad = torch.func.grad(lambda t: max_pool2d(t, 3, 2, 1).square().sum())(x.detach())
    expected = torch.func.grad(lambda t: nn.functional.max_pool2d(t, 3, 2, 1).square().sum())(x.detach())
    assert torch.equal(grad, expected)


def test_in_place_change_of_the_input_raises_as_torch_does():
    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    y = x * 1
    out = max_pool2d(y, 2)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_module_form_is_torchs_pool_and_copies():
    torch.manual_seed(0)
    x = torch.randn(1, 2, 9, 9)
    pool = memtrim.nn.MaxPool2d(3, 2, 1)
    for clone in (pool, copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        leaf = x.clone().requires_grad_()
        out = clone(leaf)
        assert type(out.grad_fn).__name__ == "_CompactMaxPool2dBackward"
        out.backward(torch.ones_like(out))
        expected = x.clone().requires_grad_()
        nn.MaxPool2d(3, 2, 1)(expected).sum().backward()
        assert torch.equal(leaf.grad, expected.grad)
    # with return_indices the caller keeps the indices: torch's forward, its (output, indices) pair
    out, indices = memtrim.nn.MaxPool2d(3, 2, 1, return_indices=True)(x)
    assert torch.equal(indices, nn.functional.max_pool2d(x, 3, 2, 1, return_indices=True)[1])


def test_convert_swaps_only_torchs_own_max_pool():
    class OwnForward(nn.MaxPool2d):
        def forward(self, input):
            return nn.functional.max_pool2d(input, self.kernel_size)

    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.MaxPool2d(2), nn.Conv2d(4, 4, 3), OwnForward(2), nn.Flatten())
    model, report = memtrim.convert(model, example_inputs=torch.randn(2, 1, 20, 20))
    assert type(model[1]) is memtrim.nn.MaxPool2d
    # a pool with its own forward is recomputed in backward instead (torch's checkpoint of the call)
    assert type(model[3]) is OwnForward
    assert [(c.modules, c.rule) for c in report.changes] == [(("1",), "max_pool_offsets"),
                                                             (("3",), "checkpoint_pointwise")]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("geometry", GEOMETRIES[:3], ids=["stem", "k2", "dilated"])
def test_on_cuda_output_and_gradient_are_torchs_bitwise(geometry):
    torch.manual_seed(0)
    plain_out, plain_grad, out, grad = _pair(torch.randn(geometry[0], device="cuda"), geometry)
    assert torch.equal(out, plain_out) and torch.equal(grad, plain_grad)


def test_compiles_as_one_graph_of_torchs_pool():
    x = torch.randn(1, 2, 9, 9, requires_grad=True)
    compiled = torch.compile(memtrim.nn.MaxPool2d(3, 2, 1), backend="eager", fullgraph=True)  # a break raises
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.sum(), x)
    expected = nn.functional.max_pool2d(x, 3, 2, 1)
    assert torch.equal(out, expected) and torch.equal(grad, torch.autograd.grad(expected.sum(), x)[0])

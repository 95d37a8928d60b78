"""LayerNorm/RMSNorm keeping their output, against plain torch."""

import copy

import pytest
import torch

import memtrim

from ..helpers import activation_bytes, assert_half_within_10x_of_torchs_error


def grads(fn, x, grad_out, params):
    leaf = x.clone().requires_grad_()
    out = fn(leaf)
    return out.detach(), torch.autograd.grad(out, [leaf, *params], grad_out)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, (1e-10, 1e-12)), (torch.float32, (1e-4, 1e-5))])
@pytest.mark.parametrize("tiny_gamma", [False, True])
def test_layernorm_keeps_output_and_matches(dtype, tol, tiny_gamma):
    torch.manual_seed(0)
    plain = torch.nn.LayerNorm(32).to(dtype)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
        plain.bias.uniform_(-0.5, 0.5)
        if tiny_gamma:
            plain.weight[3] = 0.0
            plain.weight[7] = 1e-8
    ours = memtrim.nn.LayerNorm(32).to(dtype)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(4, 10, 32, dtype=dtype) * 2 + 1
    grad_out = torch.randn(4, 10, 32, dtype=dtype)
    out_ref, g_ref = grads(plain, x, grad_out, [plain.weight, plain.bias])
    out, g = grads(ours, x, grad_out, [ours.weight, ours.bias])
    assert torch.equal(out, out_ref)  # torch's own layer_norm kernel in forward
    for a, b in zip(g, g_ref):
        # recovering xhat = (out - beta) / gamma costs a few roundings of the output
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])


def test_rmsnorm_matches():
    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(32, eps=1e-6).double()
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    ours = memtrim.nn.RMSNorm(32, eps=1e-6).double()
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(4, 10, 32, dtype=torch.float64)
    grad_out = torch.randn(4, 10, 32, dtype=torch.float64)
    out_ref, g_ref = grads(plain, x, grad_out, [plain.weight])
    out, g = grads(ours, x, grad_out, [ours.weight])
    torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-14)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_memory_norm_then_linear():
    torch.manual_seed(0)
    d = 64
    x = torch.randn(8, 16, d, requires_grad=True).clone()  # the residual stream: kept by nobody else
    one = x.numel() * 4
    ln, ours_ln, fc = torch.nn.LayerNorm(d), memtrim.nn.LayerNorm(d), torch.nn.Linear(d, d)
    stats = 2 * 8 * 16 * 4  # LayerNorm's mean and rstd
    assert activation_bytes(lambda t: fc(ln(t)), x) == 2 * one + stats  # LayerNorm's input and the Linear's input
    assert activation_bytes(lambda t: fc(ours_ln(t)), x) == one + stats  # the norm's output, kept once for both


@pytest.mark.parametrize("affine", [True, False])
def test_rmsnorm_keeps_fewer_bytes_than_torchs(affine):
    # catches a norm that quietly does nothing: torch's RMSNorm (composite ops) keeps its input, x * rstd and (with
    # a weight) its output; memtrim's keeps only its output, which the next Linear keeps anyway, and rstd
    torch.manual_seed(0)
    x = torch.randn(8, 16, 64, requires_grad=True).clone()
    fc = torch.nn.Linear(64, 64)
    one, rstd = x.numel() * 4, 8 * 16 * 4
    torch_norm = torch.nn.RMSNorm(64, elementwise_affine=affine)
    memtrim_norm = memtrim.nn.RMSNorm(64, elementwise_affine=affine)
    theirs = activation_bytes(lambda t: fc(torch_norm(t)), x)
    ours = activation_bytes(lambda t: fc(memtrim_norm(t)), x)
    assert ours == one + rstd
    assert theirs >= 2 * one + rstd > ours


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # torch's RMSNorm, unfused path
@pytest.mark.parametrize("case", ["unbatched", "empty", "bfloat16 into a float32 norm"])
@pytest.mark.parametrize("cls", [memtrim.nn.LayerNorm, memtrim.nn.RMSNorm])
def test_inputs_torchs_norm_takes_are_taken(cls, case):
    """An unbatched RMSNorm input failed in backward ("invalid gradient at index 1 - got []"); a LayerNorm with a
    feature keeping its input failed on an empty batch; a float32 norm fed bfloat16 activations without autocast
    failed in backward (LayerNorm) or returned float32 (RMSNorm), where torch trains and returns bfloat16."""
    torch.manual_seed(0)
    plain = (torch.nn.LayerNorm if cls is memtrim.nn.LayerNorm else torch.nn.RMSNorm)(4)
    with torch.no_grad():
        plain.weight.copy_(torch.tensor([1.0, 0.1, -2.0, 1e-3]))
        if getattr(plain, "bias", None) is not None:
            plain.bias.copy_(torch.tensor([0.0, 2.0, 0.5, 1.0]))  # |beta| / |gamma| >= 8: features keep their input
    ours = cls(4)
    ours.load_state_dict(plain.state_dict())
    x = {"unbatched": torch.randn(4), "empty": torch.randn(0, 4),
         "bfloat16 into a float32 norm": torch.randn(3, 4).to(torch.bfloat16)}[case]
    results = []
    for norm in (plain, ours):
        leaf = x.clone().requires_grad_()
        out = norm(leaf)
        out.float().square().sum().backward()
        results.append((out, leaf.grad, norm.weight.grad))
    for a, b in zip(*results):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("eps", [None, 1e-6])
def test_rmsnorm_forward_is_torchs_in_every_dtype(dtype, eps):
    # found by an adversarial pass: in float16/bfloat16 memtrim.nn.RMSNorm (and convert's swap of torch's nn.RMSNorm
    # to it) computed x * rsqrt(mean(x^2) + eps) * w in the half type, where torch computes in float32 and rounds once,
    # and took the half type's epsilon where torch 2.13 takes float32's: 28-31 % of the outputs differed, and a
    # converted bfloat16 model's loss differed at step 0. The forward is torch's F.rms_norm now
    torch.manual_seed(0)
    plain = torch.nn.RMSNorm(256, eps=eps)
    with torch.no_grad():
        plain.weight.uniform_(0.5, 1.5)
    ours = memtrim.nn.RMSNorm(256, eps=eps)
    ours.load_state_dict(plain.state_dict())
    exact = torch.nn.RMSNorm(256, eps=memtrim.techniques.norms.keep_output.default_rms_eps(dtype) if eps is None
                             else eps).double()
    exact.load_state_dict(plain.state_dict())
    x, grad_out = torch.randn(64, 256) + 0.3, torch.randn(64, 256)
    results = [grads(m.to(d), x.to(d), grad_out.to(d), [m.weight])
               for m, d in ((plain, dtype), (ours, dtype), (exact, torch.float64))]
    assert torch.equal(results[1][0], results[0][0])
    for i in range(2):  # the input's and the weight's gradients, against float64
        theirs, mine = ((r[1][i].double() - results[2][1][i]).abs().max() for r in results[:2])
        # the rebuild from the rounded output costs about one rounding of xhat more: measured up to 2.2x torch's own
        # error here and 3.4x over 64 features in float16 (an adversarial pass); the norms' documented bound is 10x
        # (NOTE [ when a norm keeps its input ])
        assert mine <= 10 * theirs + 1e-12, (i, mine, theirs)


def test_converted_bfloat16_model_with_torchs_rmsnorm_has_torchs_forward():
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.RMSNorm(64, eps=1e-6),
                                torch.nn.Linear(64, 4)).to(torch.bfloat16)
    x = torch.randn(8, 16, dtype=torch.bfloat16)
    converted, report = memtrim.convert(copy.deepcopy(plain), example_inputs=x)
    assert [c.modules for c in report.changes] == [("1",)], str(report)
    assert torch.equal(converted(x), plain(x))


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_a_vmapped_backward_with_create_graph_is_refused(norm):
    # found by an adversarial pass: under vmap (autograd.grad(is_grads_batched=True, create_graph=True), jacobian with
    # vectorize=True) the gradient's graph is hidden from the refusal of a second derivative: its terms were lost
    # silently (a converted Llama's final norm weight gradient 0.92 where torch's is 14.65)
    torch.manual_seed(0)
    model = torch.nn.Sequential(getattr(memtrim.nn, norm)(8), torch.nn.Linear(8, 3))
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(memtrim.ConvertError, match="vmapped backward"):
        torch.autograd.grad(model(x), x, torch.randn(4, 5, 3), is_grads_batched=True, create_graph=True)
    # without create_graph (first order) it is torch's, to rounding (the norm is rebuilt from its output)
    plain = torch.nn.Sequential(getattr(torch.nn, norm)(8), model[1])
    directions = torch.randn(4, 5, 3)
    (mine,) = torch.autograd.grad(model(x), x, directions, is_grads_batched=True)
    (torchs,) = torch.autograd.grad(plain(x), x, directions, is_grads_batched=True)
    torch.testing.assert_close(mine, torchs)


@pytest.mark.parametrize(("dtype", "ratio", "rows", "seed"),
                         [(torch.bfloat16, -7.9, 1, 26), (torch.float16, -7.9, 4, 35)], ids=["bfloat16", "float16"])
def test_a_half_precision_layernorm_just_below_the_float32_bound_stays_within_10x_torchs_error(dtype, ratio, rows,
                                                                                             seed):
    # found by a helper's sweep on 2026-11-29: 8 features at bias/gamma -7.9 (kept from 8 |gamma| then) and random
    # gradients: dgamma reached 17x (bfloat16) and 15x (float16) torch's error against float64. Half precision keeps
    # from |bias| >= 2 |gamma| (KEEP_BOUND_HALF), as BatchNormAct. torch's error is floored at one unit roundoff
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 8, generator=gen, dtype=torch.float64) + 0.5).to(dtype).double()
    gamma = (0.5 + torch.rand(8, generator=gen, dtype=torch.float64)).to(dtype).double()
    beta = (gamma * ratio).to(dtype).double()
    grad = torch.randn(rows, 8, generator=gen, dtype=torch.float64).to(dtype).double()
    grads = {}
    for name, dt in (("float64", torch.float64), ("torch", dtype), ("memtrim", dtype)):
        norm = (memtrim.nn.LayerNorm(8) if name == "memtrim" else torch.nn.LayerNorm(8)).to(dt)
        with torch.no_grad():
            norm.weight.copy_(gamma)
            norm.bias.copy_(beta)
        leaf = x.to(dt).detach().clone().requires_grad_()
        norm(leaf).backward(grad.to(dt))
        grads[name] = (leaf.grad.double(), norm.weight.grad.double())
    assert_half_within_10x_of_torchs_error(grads, dtype)

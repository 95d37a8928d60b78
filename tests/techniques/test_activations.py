"""memtrim.functional / memtrim.nn activations: torch's values and gradients, and exactly what they keep."""

import math

import pytest
import torch
import torch.nn.functional as F

import memtrim
import memtrim.functional as MF

# name -> (memtrim function, torch out-of-place, torch in-place or None, what is kept, bitwise vs which torch)
CASES = {
    "relu": (MF.relu, torch.relu, torch.relu_, "output", "both"),
    "leaky_relu": (lambda x, inplace=False: MF.leaky_relu(x, 0.1, inplace), lambda x: F.leaky_relu(x, 0.1),
                   lambda x: F.leaky_relu_(x, 0.1), "output", "both"),
    "hardtanh": (lambda x, inplace=False: MF.hardtanh(x, -0.5, 0.7, inplace), lambda x: F.hardtanh(x, -0.5, 0.7),
                 lambda x: F.hardtanh_(x, -0.5, 0.7), "output", "both"),
    "relu6": (MF.relu6, F.relu6, lambda x: F.relu6(x, inplace=True), "output", "both"),
    "elu": (lambda x, inplace=False: MF.elu(x, 0.8, inplace), lambda x: F.elu(x, 0.8),
            lambda x: F.elu_(x, 0.8), "output", "inplace"),
    "selu": (MF.selu, F.selu, F.selu_, "output", "inplace"),
    "celu": (lambda x, inplace=False: MF.celu(x, 1.3, inplace), lambda x: F.celu(x, 1.3),
             lambda x: F.celu_(x, 1.3), "output", "inplace"),
    "sigmoid": (MF.sigmoid, torch.sigmoid, torch.sigmoid_, "output", "both"),
    "tanh": (MF.tanh, torch.tanh, torch.tanh_, "output", "both"),
    "hardsigmoid": (MF.hardsigmoid, F.hardsigmoid, None, "output", "both"),  # but one input: test_hardsigmoid_edge
    "softplus": (lambda x, inplace=False: MF.softplus(x, 2.0), lambda x: F.softplus(x, 2.0), None,
                 "output", "tolerance"),
    # a low threshold: the output no longer says which side of it the input was on (issue 10, item 3)
    "softplus_low": (lambda x, inplace=False: MF.softplus(x, 2.0, 5.0), lambda x: F.softplus(x, 2.0, 5.0), None,
                     "input", "both"),
    "silu": (MF.silu, F.silu, None, "input", "both"),
    "gelu": (lambda x, inplace=False: MF.gelu(x), F.gelu, None, "input", "both"),
    "gelu_tanh": (lambda x, inplace=False: MF.gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"), None,
                  "input", "both"),
    "mish": (MF.mish, F.mish, None, "input", "both"),
    "hardswish": (MF.hardswish, F.hardswish, None, "input", "both"),
}
MASKED = {
    "relu": lambda x, inplace=False: MF.relu(x, inplace, save="mask"),
    "leaky_relu": lambda x, inplace=False: MF.leaky_relu(x, 0.1, inplace, save="mask"),
    "hardtanh": lambda x, inplace=False: MF.hardtanh(x, -0.5, 0.7, inplace, save="mask"),
    "relu6": lambda x, inplace=False: MF.relu6(x, inplace, save="mask"),
    "hardsigmoid": lambda x, inplace=False: MF.hardsigmoid(x, inplace, save="mask"),
}
REFERENCE = {name: case[1] for name, case in CASES.items()}


def data(dtype=torch.float32, shape=(37, 29)):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 4  # spans every region, e.g. hardtanh's
    return x.to(dtype), torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def grad_of(fn, x, grad_out, clone=True):
    leaf = x.clone().requires_grad_()
    y = fn(leaf.clone() if clone else leaf)
    (g,) = torch.autograd.grad(y, leaf, grad_out)
    return y.detach(), g


@pytest.mark.parametrize("name", list(CASES) + [f"{n}[mask]" for n in MASKED])
def test_gradcheck_float64(name):
    fn = MASKED[name[:-6]] if name.endswith("[mask]") else CASES[name][0]
    x, _ = data(torch.float64, (6, 5))
    x = x + 0.01 * (x.abs() < 0.02)  # keep gradcheck's finite differences off the kinks
    assert torch.autograd.gradcheck(lambda t: fn(t.clone()), (x.requires_grad_(),))


@pytest.mark.parametrize("name", list(CASES))
def test_values_and_gradients_match_torch_float32(name):
    fn, reference, reference_, _, bitwise = CASES[name]
    x, grad_out = data()
    y, g = grad_of(fn, x, grad_out)
    y_ref, g_ref = grad_of(reference, x, grad_out)
    assert torch.equal(y, y_ref)  # the forward is torch's own kernel
    if bitwise in ("both", "inplace") and reference_ is not None:
        _, g_ref_ = grad_of(reference_, x, grad_out)
        assert torch.equal(g, g_ref_)  # the same backward kernel as torch's in-place variant
    if bitwise == "both":
        assert torch.equal(g, g_ref)
    else:
        # elu/selu/celu: torch's out-of-place backward uses alpha*exp(x), ours y + alpha (torch's own in-place
        # formula); softplus: 1 - exp(-beta*y) for exp(beta*x)/(1+exp(beta*x)). Each is a few float32 roundings
        # apart.
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_hardsigmoid_edge(dtype):
    # torch's backward multiplies by 1.0f / 6.0f in every dtype (float64 too), and so does memtrim's: bitwise on
    # values spanning every region...
    x, grad_out = data(dtype, (64, 100))
    assert torch.equal(grad_of(MF.hardsigmoid, x, grad_out)[1], grad_of(F.hardsigmoid, x, grad_out)[1])
    assert torch.equal(grad_of(MASKED["hardsigmoid"], x, grad_out)[1], grad_of(F.hardsigmoid, x, grad_out)[1])
    # ...but in float32 and float64 the largest float below 3 has an output of exactly 1 (x + 3 rounds to 6), so
    # the output cannot say the input was below 3: memtrim's gradient is 0 there, torch's grad/6 (the limit
    # convert's report states). Half and bfloat16 are computed in float32, where x + 3 is exact. The mask, made
    # from the input, is exact.
    below_three = torch.nextafter(torch.tensor(3.0, dtype=dtype), torch.tensor(0.0, dtype=dtype)).reshape(1)
    one = torch.ones(1, dtype=dtype)
    edge = dtype in (torch.float32, torch.float64)
    assert (F.hardsigmoid(below_three).item() == 1.0) is edge
    assert torch.equal(grad_of(MF.hardsigmoid, below_three, one)[1],
                       grad_of(F.hardsigmoid, below_three, one)[1]) is not edge
    assert torch.equal(grad_of(MASKED["hardsigmoid"], below_three, one)[1], grad_of(F.hardsigmoid, below_three, one)[1])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_hardsigmoid_edge_on_cuda(dtype):
    # read from torch's CUDA kernels and confirmed on an H200 (torch 2.11; results/cuda_tests_cuda.log): the
    # backward multiplies by 1.0f / 6.0f as on the CPU, but the forward multiplies by it too (the CPU divides by 6).
    # float32 then has the CPU's one edge input (the largest float below 3); in float64 every input within about
    # 1.8e-7 below 3 has an output of 1 or more, where memtrim's gradient is 0; bfloat16 has none
    x, grad_out = (t.cuda() for t in data(dtype, (64, 100)))
    assert torch.equal(grad_of(MF.hardsigmoid, x, grad_out)[1], grad_of(F.hardsigmoid, x, grad_out)[1])
    three = torch.tensor(3.0, dtype=dtype)
    below = (three - 1e-7 if dtype is torch.float64 else torch.nextafter(three, torch.zeros_like(three)))
    below, one = below.reshape(1).cuda(), torch.ones(1, dtype=dtype, device="cuda")
    assert torch.equal(grad_of(MF.hardsigmoid, below, one)[1],
                       grad_of(F.hardsigmoid, below, one)[1]) is (dtype is torch.bfloat16)


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_gradients_bitwise(name):
    x, grad_out = data()
    _, g = grad_of(MASKED[name], x, grad_out)
    _, g_ref = grad_of(CASES[name][0], x, grad_out)
    assert torch.equal(g, g_ref)


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_gradients_at_special_values_are_torchs(name):
    # torch's relu backward zeroes where the output is <= 0, so a NaN passes its gradient; the mask gave 0 there.
    # (hardtanh's CPU backward gives 0 at a NaN on its vectorized path and passes it on its scalar tail: tested on a
    # tensor long enough for the vectorized path, which is what real tensors take)
    values = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, -1.0, 1.0, 6.0, 3.0, -3.0, 7.0]
    x = torch.tensor(values * 8)
    grad_out = torch.linspace(1.0, 2.0, x.numel())
    _, g = grad_of(MASKED[name], x, grad_out)
    _, g_ref = grad_of(CASES[name][0], x, grad_out)
    assert torch.equal(g, g_ref)


@pytest.mark.parametrize("name", list(CASES))
def test_keeps_exactly_the_tensor_it_says(name):
    # catches a technique that quietly does nothing: an output-keeping activation must keep its output's storage
    # (the tensor the next layer keeps anyway), not its input's, and nothing else; input keepers their input alone
    fn, _, _, keeps, _ = CASES[name]
    x, _ = data(shape=(64, 100))
    for dtype in (torch.float32, torch.bfloat16):
        inp = x.to(dtype).requires_grad_().clone()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(saved.append, lambda _: None):
            y = fn(inp)
        expected = y if keeps == "output" else inp
        if name == "hardtanh" and dtype == torch.bfloat16:  # 0.7 is no bfloat16: the output cannot give torch's
            expected = inp                                  # gradient, so torch's op keeps its input (test below)
        if name in ("elu", "selu", "celu") and dtype == torch.bfloat16:  # NOTE [ ELU in half ]: torch's op
            expected = inp
        assert [t.untyped_storage().data_ptr() for t in saved] == [expected.untyped_storage().data_ptr()]
        assert sum(t.untyped_storage().nbytes() for t in saved) == expected.numel() * expected.element_size()
        del y


@pytest.mark.parametrize("name", list(CASES) + [f"{n}[mask]" for n in MASKED])
def test_bytes_kept_for_backward(name):
    masked = name.endswith("[mask]")
    fn = MASKED[name[:-6]] if masked else CASES[name][0]
    x, _ = data(shape=(64, 100))
    leaf = x.clone().requires_grad_()
    inp = leaf.clone()
    with memtrim.track() as tracker:
        y = fn(inp)
        kept = tracker.saved_for_backward_bytes()
    n = x.numel()
    expected = math.ceil(n / 8) if masked else n * 4
    assert kept == expected
    if not masked and CASES[name][3] == "input":
        assert y.untyped_storage().data_ptr() != inp.untyped_storage().data_ptr()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c[3] == "output" and n != "softplus"]
                         + [f"{n}[mask]" for n in MASKED])
def test_inplace_is_truly_in_place(name):
    masked = name.endswith("[mask]")
    fn = MASKED[name[:-6]] if masked else CASES[name][0]
    reference = REFERENCE[name[:-6] if masked else name]
    x, grad_out = data(shape=(64, 100))
    leaf = x.clone().requires_grad_()
    inp = leaf.clone()
    with memtrim.track() as tracker:
        y = fn(inp, inplace=True)
        kept = tracker.saved_for_backward_bytes()
    report = tracker.report()
    assert y.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    # in place: no new storage, except (mask) the 1-byte-per-element bool masks while they are made and packed
    # (two comparisons and their conjunction for a two-sided range like hardtanh's)
    transient = report.peak_bytes - report.timeline[0].total_bytes
    assert transient <= (3 * x.numel() + 2 * math.ceil(x.numel() / 8) if masked else 0)
    assert kept == (math.ceil(x.numel() / 8) if masked else x.numel() * 4)
    (g,) = torch.autograd.grad(y, leaf, grad_out)
    _, g_ref = grad_of(reference, x, grad_out)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["relu", "sigmoid", "elu", "silu", "relu[mask]"])
def test_check_inplace_passes_and_input_used_elsewhere_is_loud(name):
    masked = name.endswith("[mask]")
    fn = MASKED[name[:-6]] if masked else CASES[name][0]
    reference = REFERENCE[name[:-6] if masked else name]
    result = memtrim.check_inplace(lambda t: fn(t, inplace=True), reference, torch.randn(16, 8))
    result.assert_ok()  # includes: on sigmoid's/exp's saved output, autograd's error rather than a wrong gradient
    # and used elsewhere out of place: the input feeds two branches
    x, grad_out = data()
    leaf = x.clone().requires_grad_()
    h = leaf * 1.5
    y = fn(h) + h
    (g,) = torch.autograd.grad(y, leaf, grad_out)
    leaf2 = x.clone().requires_grad_()
    h2 = leaf2 * 1.5
    (g_ref,) = torch.autograd.grad(reference(h2) + h2, leaf2, grad_out)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["relu", "leaky_relu", "sigmoid", "tanh", "silu", "gelu", "relu[mask]"])
def test_bf16_autocast(name):
    masked = name.endswith("[mask]")
    fn = MASKED[name[:-6]] if masked else CASES[name][0]
    reference = REFERENCE[name[:-6] if masked else name]
    torch.manual_seed(0)
    linear = torch.nn.Linear(29, 29)
    x, _ = data()

    def run(act):
        linear.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = act(linear(x))
        out.float().square().sum().backward()
        return out, linear.weight.grad.clone()

    out, g = run(fn)
    out_ref, g_ref = run(reference)
    assert out.dtype == out_ref.dtype == torch.bfloat16
    assert torch.equal(out, out_ref)
    assert torch.equal(g, g_ref)


def test_modules_have_torchs_signatures_and_state():
    pairs = [
        (memtrim.nn.ReLU(inplace=True), torch.nn.ReLU(inplace=True)),
        (memtrim.nn.LeakyReLU(0.2), torch.nn.LeakyReLU(0.2)),
        (memtrim.nn.Hardtanh(-2, 2), torch.nn.Hardtanh(-2, 2)),
        (memtrim.nn.ReLU6(), torch.nn.ReLU6()),
        (memtrim.nn.ELU(0.5), torch.nn.ELU(0.5)),
        (memtrim.nn.SELU(), torch.nn.SELU()),
        (memtrim.nn.CELU(0.7), torch.nn.CELU(0.7)),
        (memtrim.nn.Sigmoid(), torch.nn.Sigmoid()),
        (memtrim.nn.Tanh(), torch.nn.Tanh()),
        (memtrim.nn.Hardsigmoid(), torch.nn.Hardsigmoid()),
        (memtrim.nn.Softplus(2.0, 10.0), torch.nn.Softplus(2.0, 10.0)),
        (memtrim.nn.SiLU(), torch.nn.SiLU()),
        (memtrim.nn.GELU("tanh"), torch.nn.GELU("tanh")),
        (memtrim.nn.Mish(), torch.nn.Mish()),
        (memtrim.nn.Hardswish(), torch.nn.Hardswish()),
    ]
    x, _ = data()
    for ours, theirs in pairs:
        assert isinstance(ours, type(theirs))
        assert repr(ours) == repr(theirs)
        assert torch.equal(ours(x.clone()), theirs(x.clone()))


def test_bad_input():
    with pytest.raises(memtrim.InvalidInputError, match="save must be 'output' or 'mask'"):
        MF.relu(torch.randn(3, requires_grad=True), save="bits")
    with pytest.raises(memtrim.InvalidInputError, match="negative_slope >= 0"):
        MF.leaky_relu(torch.randn(3, requires_grad=True), -0.1, save="mask")
    with pytest.raises(memtrim.InvalidInputError, match="min_val"):
        MF.hardtanh(torch.randn(3), 1.0, -1.0)
    with pytest.raises(memtrim.InvalidInputError, match="input must be a tensor"):
        MF.relu([1.0, -1.0])
    for fn in (MF.softplus, MF.hardtanh):  # softplus asked a float for its dtype (AttributeError)
        with pytest.raises(memtrim.InvalidInputError, match="input must be a tensor"):
            fn(3.0)
    with pytest.raises(memtrim.InvalidInputError, match="approximate"):
        MF.gelu(torch.randn(3), approximate="erf")


def test_pack_mask_roundtrip():
    for n in (1, 7, 8, 9, 1000):
        mask = torch.rand(n) > 0.5
        packed = MF.pack_mask(mask)
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
        assert torch.equal(MF.unpack_mask(packed, mask.shape), mask)


@pytest.mark.parametrize("name", ["leaky_relu", "relu6", "hardtanh", "elu", "selu", "celu", "hardsigmoid", "softplus"])
def test_before_a_linear_keeps_one_tensor_where_torch_keeps_two(name):
    fn, reference = CASES[name][0], CASES[name][1]
    torch.manual_seed(0)
    linear = torch.nn.Linear(100, 100)

    def kept(act):
        x = torch.randn(64, 100, requires_grad=True).clone()
        with memtrim.track() as tracker:
            y = linear(act(x))
            held = tracker.live_by_category()["activations"]
        del y
        return held

    one = 64 * 100 * 4
    assert kept(fn) == one  # the activation's output, shared with the Linear
    assert kept(reference) == 2 * one  # torch: the activation keeps its input, the Linear its output


@pytest.mark.parametrize("dtype, bound", [(torch.float16, 0.1), (torch.bfloat16, 0.7)])
@pytest.mark.parametrize("save", ["output", "mask"])
def test_hardtanh_with_a_bound_the_dtype_rounds_is_torchs(dtype, bound, save):
    """In float16 a bound of 0.1 rounds to 0.09998: the saturated output sat inside the bound as torch's backward
    compares it (in float32), and clipped elements got the full gradient ([1, 1, 1, 1] against [0, 1, 1, 0])."""
    inside = float(torch.tensor(bound, dtype=dtype))  # the rounded bound: an input torch does not clip
    x = torch.tensor([-5.0, -inside, -0.05, 0.05, inside, 5.0], dtype=dtype)
    grads = []
    for fn in (lambda t: torch.nn.functional.hardtanh(t, -bound, bound),
               lambda t: MF.hardtanh(t, -bound, bound, save=save)):
        leaf = x.clone().requires_grad_()
        fn(leaf).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[1], grads[0]), grads
    assert grads[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]


IN_PLACE_KEEPING_INPUT = {
    "silu": (MF.silu, F.silu), "mish": (MF.mish, F.mish), "hardswish": (MF.hardswish, F.hardswish),
    "leaky_relu_negative": (lambda x, inplace=False: MF.leaky_relu(x, -0.2, inplace),
                            lambda x: F.leaky_relu(x, -0.2)),
    "elu_negative_alpha": (lambda x, inplace=False: MF.elu(x, -1.0, inplace), lambda x: F.elu(x, -1.0)),
}


@pytest.mark.parametrize("name", IN_PLACE_KEEPING_INPUT)
def test_in_place_activations_that_keep_their_input_have_torchs_second_derivative(name):
    # the copy of the input kept for backward was made inside the autograd Function, without a graph: a gradient
    # penalty through it lost the second derivative (the first layer's weight gradient 4e-2 off, the Hessian None)
    fn, reference = IN_PLACE_KEEPING_INPUT[name]
    x, _ = data(torch.float64, (6, 5))
    torch.manual_seed(0)
    weight = torch.randn(5, 5, dtype=torch.float64, requires_grad=True)
    results = []
    for act in (lambda h: fn(h, inplace=True), reference):
        leaf = x.clone().requires_grad_()
        h = leaf @ weight
        (dx,) = torch.autograd.grad(act(h * 1.0).square().sum(), leaf, create_graph=True)
        penalty = dx.square().sum()
        results.append(torch.autograd.grad(penalty, (weight, leaf)))
    for mine, torchs in zip(*results):
        assert torch.equal(mine, torchs)


@pytest.mark.parametrize("name", ["silu", "mish", "hardswish", "elu_negative_alpha"])
def test_in_place_activations_that_keep_their_input_run_under_torch_func(name):
    # the fallback wrote the output over the input torch's op had just saved: autograd's "modified by an inplace
    # operation" under torch.func.grad, torch.compile and an fx-traced model
    fn, reference = IN_PLACE_KEEPING_INPUT[name]
    x, _ = data(torch.float64, (6, 5))
    weight = torch.randn(5, 5, dtype=torch.float64)

    def loss(w, act):
        return act((x @ w) * 1.0).square().sum()

    expected = torch.func.grad(loss)(weight, reference)
    assert torch.equal(torch.func.grad(loss)(weight, lambda h: fn(h, inplace=True)), expected)


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_gradients_keep_a_channels_last_layout_as_torchs(name):
    # the mask was unpacked contiguous, so the input gradient of a channels_last activation came out contiguous where
    # torch's is channels_last, and the convolution before it rounded its weight gradient differently
    x, g = data(torch.float32, (2, 4, 3, 5))
    x, g = x.contiguous(memory_format=torch.channels_last), g.contiguous(memory_format=torch.channels_last)
    _, mine = grad_of(MASKED[name], x, g)
    _, torchs = grad_of(REFERENCE[name], x, g)
    assert mine.stride() == torchs.stride() == g.stride()
    assert torch.equal(mine, torchs)


@pytest.mark.parametrize("name", list(MASKED))
@pytest.mark.parametrize("layouts", ["channels_last input, contiguous gradient", "contiguous input, channels_last "
                                                                                  "gradient"])
def test_masked_gradients_are_laid_out_as_torchs_where_input_and_gradient_layouts_differ(name, layouts):
    # found by an adversarial pass: a channels_last activation followed by flatten or the loss gets a gradient in
    # another layout than its input; torch's relu and leaky_relu backward follow the input there, the mask backward
    # followed the gradient, and the convolution before summed its weight gradient in another order
    x, g = data(torch.float32, (2, 4, 3, 5))
    if layouts.startswith("channels_last"):
        x = x.contiguous(memory_format=torch.channels_last)
    else:
        g = g.contiguous(memory_format=torch.channels_last)
    _, mine = grad_of(MASKED[name], x, g)
    _, torchs = grad_of(REFERENCE[name], x, g)
    assert mine.stride() == torchs.stride()
    assert torch.equal(mine, torchs)


@pytest.mark.parametrize("module", ["SiLU", "Mish", "Hardswish"])
def test_an_fx_traced_model_with_an_in_place_activation_that_keeps_its_input_trains_as_torchs(module):
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Linear(5, 5), getattr(memtrim.nn, module)(inplace=True), torch.nn.Linear(5, 2))
    theirs = torch.nn.Sequential(mine[0], getattr(torch.nn, module)(inplace=True), mine[2])
    x, _ = data(torch.float32, (6, 5))
    grads = []
    for model in (torch.fx.symbolic_trace(mine), theirs):
        grads.append(torch.autograd.grad(model(x).square().sum(), list(mine.parameters())))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------- gradient penalties in the loops users write
def _penalty_training(act, step_kind, channels_last, hook=False, steps=3):
    """Three AdamW steps of a two-conv net whose activations ``act()`` make, each step differentiating the input
    gradient (create_graph=True): 'gp' trains on the loss plus the penalty (WGAN-GP), 'r1' on the penalty alone
    (StyleGAN2's lazy R1 steps). ``hook``: a hook doubling the gradient of the first activation's input."""
    torch.manual_seed(0)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    conv1, conv2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 1)
    conv1.to(memory_format=layout), conv2.to(memory_format=layout)
    act1, act2 = act(), act()
    params = [*conv1.parameters(), *conv2.parameters()]
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = (torch.randn(2, 3, 6, 6, generator=g) * 2).contiguous(memory_format=layout).requires_grad_()
        opt.zero_grad()
        before = conv1(x)
        if hook:
            before.register_hook(lambda grad: grad * 2)
        h = act1(before)
        loss = (h * h).mean() + act2(conv2(h)).mean()
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        penalty = dx.square().sum()
        (penalty if step_kind == "r1" else loss + penalty).backward()
        opt.step()
    return [p.detach().clone() for p in params]


MASKED_MODULES = {"relu": ("ReLU", {}), "leaky_relu": ("LeakyReLU", {"negative_slope": 0.1}),
                  "hardtanh": ("Hardtanh", {}), "relu6": ("ReLU6", {})}


@pytest.mark.parametrize("name", list(MASKED_MODULES))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("step_kind", ["gp", "r1"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_masked_activations_train_a_gradient_penalty_as_torchs(name, inplace, step_kind, channels_last):
    # found by an adversarial pass: torch's relu backward is differentiable in its output, with derivative 0, so a
    # step on the penalty alone gives the biases before the activation a zero gradient; the mask has no graph, so
    # they got none, and AdamW skipped them (no decay, no momentum): weights 0.05-0.2 off after 4 steps. On
    # channels_last the zeros (and torch's order of adding them) also set the layout the convolution sums in
    cls, kwargs = MASKED_MODULES[name]
    mine = _penalty_training(lambda: getattr(memtrim.nn, cls)(inplace=inplace, save="mask", **kwargs), step_kind,
                             channels_last)
    torchs = _penalty_training(lambda: getattr(torch.nn, cls)(inplace=inplace, **kwargs), step_kind, channels_last)
    for a, b in zip(mine, torchs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", ["SiLU", "Mish", "Hardswish", "GELU", "ReLU", "Hardtanh"])
@pytest.mark.parametrize("save", ["output", "mask"])
def test_a_hook_on_the_activations_input_runs_once_under_a_gradient_penalty(cls, save):
    # found by an adversarial pass: the second derivative of an input-keeping activation was taken with
    # torch.autograd.grad with respect to its input itself, which runs the hooks on that input: a hook doubling the
    # gradient doubled this inner one too, and the weights came out 60-160 off
    if save == "mask" and cls not in ("ReLU", "Hardtanh"):
        pytest.skip("no mask form")
    kwargs = {"save": "mask"} if save == "mask" else {}
    mine = _penalty_training(lambda: getattr(memtrim.nn, cls)(**kwargs), "gp", False, hook=True)
    torchs = _penalty_training(lambda: getattr(torch.nn, cls)(), "gp", False, hook=True)
    for a, b in zip(mine, torchs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("name", list(MASKED))
def test_a_masked_activation_forward_without_backward_frees_everything(name, inplace):
    # the anchor tying a mask's backward to the output's graph must not make a cycle through the activation's node
    # (an output kept on ctx does): a forward whose backward never runs (a skipped batch) would keep the graph and
    # the input alive
    import gc
    import weakref

    refs = []
    for _ in range(2):
        h = torch.randn(8, 16, requires_grad=True) * 1.0
        y = MASKED[name](h, inplace=inplace)
        refs += [weakref.ref(h), weakref.ref(y.grad_fn)]
        del h, y
    gc.collect()
    assert all(r() is None for r in refs)


def _mlp_penalty_training(act, penalty, steps=3):
    """AdamW steps (weight decay on) of Linear-act-Linear trained on a penalty alone: ``penalty(f, x, v)``."""
    torch.manual_seed(0)
    lin1, lin2, a = torch.nn.Linear(4, 8), torch.nn.Linear(8, 3), act()
    params = [*lin1.parameters(), *lin2.parameters()]
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, v = torch.randn(5, 4, generator=g) * 3, torch.randn(5, 4, generator=g)
        opt.zero_grad()
        penalty(lambda t: lin2(a(lin1(t))), x, v).backward()
        opt.step()
    return [p.detach().clone() for p in params]


def _jvp_penalty(f, x, v):  # torch's double-vjp JVP: a third-order path through the activation
    return torch.autograd.functional.jvp(f, x, v, create_graph=True)[1].square().mean()


def _batched_vjp_penalty(f, x, v):  # per-direction VJPs under vmap (jacobian(vectorize=True) runs the same)
    leaf = x.requires_grad_()
    (vjps,) = torch.autograd.grad(f(leaf), leaf, torch.randn(4, 5, 3, generator=torch.Generator().manual_seed(2)),
                                  is_grads_batched=True, create_graph=True)
    return vjps.square().sum()


@pytest.mark.parametrize("name", list(MASKED_MODULES))
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("penalty", [_jvp_penalty, _batched_vjp_penalty], ids=["jvp", "batched"])
def test_masked_activations_give_torchs_zero_gradients_at_higher_orders_and_under_vmap(name, inplace, penalty):
    # found by adversarial passes on the fix above: the tie was not tied again at the next order (a loss on a
    # double-vjp JVP), and under vmap (is_grads_batched=True) a custom Function's graph is not recorded: the bias
    # before the activation got None where torch gives zeros again (0.007 and 0.02 off after 3 steps)
    cls, kwargs = MASKED_MODULES[name]
    mine = _mlp_penalty_training(lambda: getattr(memtrim.nn, cls)(inplace=inplace, save="mask", **kwargs), penalty)
    torchs = _mlp_penalty_training(lambda: getattr(torch.nn, cls)(inplace=inplace, **kwargs), penalty)
    for a, b in zip(mine, torchs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", [n for n in MASKED if n != "hardsigmoid"])  # (torch's has no second derivative)
@pytest.mark.parametrize("channels_last", [False, True])
def test_masked_activations_under_vmap_and_a_vectorized_hessian_are_torchs(name, channels_last):
    # found by an adversarial pass: under vmap the layout copy raised (channels_last), and the tie's in-place add
    # raised in torch.autograd.functional.hessian(vectorize=True)
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 3, 3, padding=1)
    x = torch.randn(2, 3, 4, 4)
    if channels_last:
        conv, x = conv.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    directions = torch.randn(3, 2, 3, 4, 4)
    results = []
    for act in (lambda h: MASKED[name](h, inplace=True), lambda h: REFERENCE[name](h.clone())):
        (jac,) = torch.autograd.grad(act(conv(x) * 1.0), conv.weight, directions, is_grads_batched=True)
        hess = torch.autograd.functional.hessian(
            lambda b, act=act: act(F.conv2d(x, conv.weight, b, padding=1)).square().sum(), conv.bias.detach(),
            vectorize=True)
        results.append((jac, hess))
    for a, b in zip(*results):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(MASKED_MODULES))
@pytest.mark.parametrize("inplace", [False, True])
def test_masked_activations_on_a_view_written_in_place_train_as_torchs(name, inplace):
    # found by an adversarial pass on the fix above: the mask's Function returned a second (empty) output, which
    # autograd refuses for a Function that writes a view in place (VGG's flatten, then ReLU(inplace=True))
    def run(lib, kwargs):
        torch.manual_seed(0)
        conv, act, fc = torch.nn.Conv2d(3, 4, 3), getattr(lib, cls)(inplace=inplace, **kwargs), torch.nn.Linear(16, 2)
        x = torch.randn(2, 3, 4, 4, requires_grad=True)
        h = act(torch.flatten(conv(x), 1))
        loss = fc(h).square().sum()
        (dx,) = torch.autograd.grad(loss, x, create_graph=True)
        return torch.autograd.grad(loss + dx.square().sum(), [*conv.parameters(), *fc.parameters()])

    cls, kwargs = MASKED_MODULES[name]
    for a, b in zip(run(memtrim.nn, {**kwargs, "save": "mask"}), run(torch.nn, kwargs)):
        assert torch.equal(a, b)


def test_a_penalty_through_masked_activations_on_the_meta_device_measures_as_on_the_cpu():
    # found by an adversarial pass on the fix above: layouts kept as meta tensors on the nodes (and meta probe tensors)
    # counted as activations in a meta-device model's measurement: 4,475,916 B at the peak where the CPU has 3,951,628
    def measure(device):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), memtrim.nn.LeakyReLU(0.1, save="mask"),
                                    torch.nn.Linear(64, 64), memtrim.nn.ReLU(save="mask"),
                                    torch.nn.Linear(64, 64)).to(device)
        x = torch.randn(32, 64, device=device, requires_grad=True)
        with memtrim.track(model) as tracker:
            loss = model(x).square().sum()
            (dx,) = torch.autograd.grad(loss, x, create_graph=True)
            dx.square().sum().backward()
        report = tracker.report()
        return report.peak_bytes, dict(report.peak_by_category)

    assert measure("meta") == measure("cpu")


@pytest.mark.parametrize("cls", ["ELU", "CELU", "SELU"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_elu_family_in_half_precision_is_torchs(cls, dtype):
    # found by an adversarial pass: the derivative rebuilt from the output (y + alpha) cancels as y nears -alpha; in
    # bfloat16 y rounds to -alpha from x of about -5.5, so the gradient was 0 there (SELU's 79,000x too large at -20)
    x = torch.tensor([-20.0, -8.0, -5.5, -2.0, -0.5, 0.0, 1.5], dtype=dtype)
    grads = []
    for act in (getattr(memtrim.nn, cls)(), getattr(torch.nn, cls)()):
        leaf = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(act(leaf), leaf, torch.ones_like(x))
        grads.append(g)
    assert torch.equal(grads[0], grads[1])


def test_softplus_in_float16_keeps_its_input_and_gives_torchs_gradient_bitwise():
    # from its float16 output, subnormal below x = -9.7, the gradient was up to 33 % off torch's (an adversarial
    # pass: x = -16.23 gave 5.96e-5 for torch's 8.905e-5); bfloat16 keeps its output, within rounding
    x = torch.arange(-2000, 0, dtype=torch.float16) / 100  # -20.00 ... -0.01
    grads = []
    for fn in (MF.softplus, F.softplus):
        xx = x.clone().requires_grad_(True)
        out = fn(xx)
        (out * 1000).sum().backward()  # a loss-scaled backward
        grads.append(xx.grad)
    assert torch.equal(*grads)
    with memtrim.track() as tracker:
        xx = x.clone().requires_grad_(True)
        out = MF.softplus(xx)
        held = tracker.live_by_category()["activations"]
    assert held == x.numel() * 2  # one float16 tensor kept: the input (torch's own backward)

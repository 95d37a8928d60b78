"""check_inplace catches a catalogue of wrong in-place implementations and passes correct ones."""

import pytest
import torch
import torch.nn.functional as F

import memtrim
import memtrim.functional as MF
from memtrim.cli import main


def silu_inplace_1(input):  # the seed's first version: returns sigmoid(x)**2
    return input * torch.sigmoid_(input)


def silu_inplace_2(input):  # the seed's second version: correct
    result = input.clone()
    torch.sigmoid_(result)
    input *= result
    return input


def relu_then_copy(input):  # right values, but the caller's tensor is overwritten and not returned
    return torch.relu_(input).clone()


_GLOBAL = torch.zeros(())


def relu_counting_calls(input):  # mutates a tensor it does not own
    _GLOBAL.add_(1)
    return torch.relu(input)


class WrongBackwardReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.clamp_(min=0)

    @staticmethod
    def backward(ctx, grad):
        return grad  # forgets the mask


class HiddenDouble(torch.autograd.Function):
    """Doubles its input in place through .data, behind autograd's version counter: right on its own, but it
    silently corrupts whatever an earlier op saved (sigmoid's output)."""

    @staticmethod
    def forward(ctx, x):
        x.data.mul_(2)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_seed_silu_inplace_1_fails_on_values():
    result = memtrim.check_inplace(silu_inplace_1, F.silu, torch.randn(64, 128))
    assert not result.ok
    assert any("values differ" in p for p in result.problems)
    assert any("writes into its input 0 in place (sigmoid_) but returns a different tensor" in p
               for p in result.problems)
    with pytest.raises(memtrim.InplaceCheckError, match="values differ"):
        result.assert_ok()


def test_seed_silu_inplace_2_passes_and_is_honest_about_memory():
    result = memtrim.check_inplace(silu_inplace_2, F.silu, torch.randn(64, 128))
    result.assert_ok()
    assert result.mutates_input
    # it keeps sigmoid's output and a copy of the input: twice what F.silu keeps (its input)
    assert result.reference_activation_bytes == 64 * 128 * 4
    assert result.activation_bytes == 2 * 64 * 128 * 4
    assert result.verdict.startswith("saves nothing")


def test_relu_inplace_saves_only_transient_peak():
    result = memtrim.check_inplace(torch.relu_, torch.relu, torch.randn(64, 128), inplace=True)
    result.assert_ok()
    assert result.activation_bytes == result.reference_activation_bytes == 64 * 128 * 4
    assert result.peak_bytes == 0 and result.reference_peak_bytes == 64 * 128 * 4
    assert result.verdict == "saves only 32,768 bytes of transient peak; it keeps the same activations"


def test_mask_relu_saves_activations():
    result = memtrim.check_inplace(lambda x: MF.relu(x, save="mask"), torch.relu, torch.randn(64, 128))
    result.assert_ok()
    assert result.activation_bytes == 64 * 128 // 8
    assert result.verdict.startswith(f"saves {64 * 128 * 4 - 64 * 128 // 8:,} bytes of activations")


@pytest.mark.parametrize("fn, reference, message", [
    (relu_then_copy, torch.relu, "caller's tensor is silently overwritten"),
    (relu_counting_calls, torch.relu, "neither created nor received"),
    (WrongBackwardReLU.apply, torch.relu, "gradient of input 0 differs"),
    (HiddenDouble.apply, lambda x: 2 * x, "silently wrong gradient"),
    (lambda x: x.sum(1), torch.relu, "changes the shape"),
])
def test_catalogue_of_wrong_implementations(fn, reference, message):
    result = memtrim.check_inplace(fn, reference, torch.randn(16, 8))
    assert not result.ok
    assert any(message in p for p in result.problems), result.problems


def test_inplace_claims():
    assert not memtrim.check_inplace(torch.relu, torch.relu, torch.randn(4, 4), inplace=True).ok
    assert not memtrim.check_inplace(torch.relu_, torch.relu, torch.randn(4, 4), inplace=False).ok


def test_modules_compare_parameter_gradients():
    torch.manual_seed(0)
    reference = torch.nn.Linear(8, 8)

    class Scaled(torch.nn.Module):  # the same parameters, a wrong function
        def __init__(self):
            super().__init__()
            self.weight = reference.weight
            self.bias = reference.bias

        def forward(self, x):
            return F.linear(x, self.weight * 1.001, self.bias)

    result = memtrim.check_inplace(Scaled(), reference, torch.randn(4, 8))
    assert any("values differ" in p for p in result.problems)
    assert any("gradient of parameter weight differs" in p for p in result.problems)


def test_bad_input():
    with pytest.raises(memtrim.InvalidInputError, match="floating-point"):
        memtrim.check_inplace(torch.relu_, torch.relu, torch.arange(4))
    with pytest.raises(memtrim.InvalidInputError, match="reference raised"):
        memtrim.check_inplace(torch.relu_, lambda x: x @ torch.ones(3, 3), torch.randn(4, 5))
    with pytest.raises(memtrim.InvalidInputError, match="at least one example"):
        memtrim.check_inplace(torch.relu_, torch.relu)
    with pytest.raises(memtrim.InvalidInputError, match="not a tensor"):
        memtrim.check_inplace(torch.relu_, torch.relu, [1.0])


def test_cli(tmp_path, monkeypatch, capsys):
    (tmp_path / "seed_silu.py").write_text(
        "import torch\n"
        "def silu_inplace_1(input):\n    return input * torch.sigmoid_(input)\n"
        "def silu_inplace_2(input):\n    r = input.clone()\n    torch.sigmoid_(r)\n    input *= r\n    return input\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["--reference", "torch.nn.functional:silu", "--shape", "16,8"]
    assert main(["check-inplace", "seed_silu:silu_inplace_1", *args]) == 1
    assert "values differ" in capsys.readouterr().out
    assert main(["check-inplace", "seed_silu:silu_inplace_2", *args]) == 0
    assert "ok over" in capsys.readouterr().out
    assert main(["check-inplace", "seed_silu:nothing", *args]) == 2
    assert "has no attribute" in capsys.readouterr().err

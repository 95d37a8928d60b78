"""What the one-pass BatchNorm + ReLU rebuild saves a converted ResNet's step (NOTE [ the one-pass rebuild ] in
norms/bn_relu.py): the rebuild in backward normalises with the batch statistics the forward computed, instead of
running the BatchNorm's training kernel again (a second pass over its input for the statistics). Three variants
train (forward, backward, AdamW step) in interleaved rounds, as in convert_zoo_time.py: plain; converted; converted
with the one-pass rebuild switched off (``bn_relu.ONE_PASS = False``, the rebuild before commit 4e9c438). Beside
the times: for each key the probe compared (forward kernel, dtype, shape, strides), whether the one-pass rebuild gave
the forward kernel's bits (where not, that layer keeps the two-pass rebuild), and the largest parameter-gradient
difference of each converted variant against the plain model, one step from the same weights (0: bitwise).

The model is torchvision's ResNet as memtrim.models.torchvision_resnet writes it out (the same modules and
state_dict; no torchvision needed), 10 classes, on ``--size`` square images.

Reproduce:  .venv/bin/python benchmarks/bn_rebuild_time.py [--model resnet18] [--batch 8] [--size 224]
                [--rounds 9] [--device cuda]       (on an otherwise idle machine)
Writes benchmarks/results/bn_rebuild_time_<model>_<device>.json.
"""

import argparse
import copy
import statistics
from unittest import mock

import torch

import memtrim
from _common import machine, pin_malloc, quartiles, write
from convert_zoo_time import interleaved_times, max_difference, train_gradients
from memtrim.models.torchvision_resnet import TorchvisionBasicBlock, TorchvisionBottleneck, TorchvisionResNet
from memtrim.techniques.norms import bn_relu

LAYERS = {"resnet18": (TorchvisionBasicBlock, [2, 2, 2, 2]), "resnet50": (TorchvisionBottleneck, [3, 4, 6, 3])}


def two_pass(name: str):
    """The rebuild as before the one-pass one, for the variant that has it."""
    return mock.patch.object(bn_relu, "ONE_PASS", name != "converted_two_pass")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(LAYERS), default="resnet18")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    pin_malloc()
    torch.manual_seed(0)
    plain = TorchvisionResNet(*LAYERS[args.model], num_classes=10).train().to(args.device)
    batch = {"x": torch.randn(args.batch, 3, args.size, args.size, device=args.device)}
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=batch)
    models = {"plain": plain, "converted": converted, "converted_two_pass": copy.deepcopy(converted)}
    bn_relu._ONE_PASS_EQUAL.clear()
    # one step's gradients, each converted variant against plain, from the same weights (the first backward makes
    # the probes, and the one-pass rebuild is used from it on)
    expected = train_gradients(plain, batch)
    differences = {}
    for name in ("converted", "converted_two_pass"):
        with two_pass(name):
            differences[name] = max_difference(train_gradients(models[name], batch), expected)
    kernels = {0: "torch's native", 1: "cuDNN", 2: "MIOpen"}  # (torch._batch_norm_impl_index's numbering)
    compared = [{"kernel": kernels.get(key[0], key[0]), "dtype": str(key[2]), "shape": list(key[3]),
                 "stride": list(key[4]), "equal": equal} for key, equal in bn_relu._ONE_PASS_EQUAL.items()]
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times, repeats = interleaved_times(models, opts, batch, args.rounds, args.device, two_pass)
    ratios = {k: sorted(t / p for t, p in zip(times[k], times["plain"])) for k in models if k != "plain"}
    one_against_two = sorted(a / b for a, b in zip(times["converted"], times["converted_two_pass"]))
    result = {
        "machine": machine(), "model": f"torchvision-pattern {args.model}, 10 classes", "batch": args.batch,
        "image_size": args.size, "rounds": args.rounds, "repeats_per_round": repeats,
        "threads": torch.get_num_threads(), "changes": len(report.changes),
        "step_ms_plain": 1e3 * statistics.median(times["plain"]),
        "step_time_ratio_median": {k: statistics.median(r) for k, r in ratios.items()},
        "step_time_ratio_quartiles": {k: quartiles(r) for k, r in ratios.items()},
        "one_pass_against_two_pass_median": statistics.median(one_against_two),
        "one_pass_against_two_pass_quartiles": quartiles(one_against_two),
        "max_gradient_difference_against_plain": differences,
        "one_pass_compared": compared,
    }
    print(write(f"bn_rebuild_time_{args.model}_{args.device.split(':')[0]}.json", result))
    print({k: result[k] for k in ("step_ms_plain", "step_time_ratio_median", "one_pass_against_two_pass_median",
                                  "max_gradient_difference_against_plain")})
    print(compared)


if __name__ == "__main__":
    main()

"""Activation bytes autograd keeps, torch vs memtrim.functional, measured by memtrim's tracker, in two places:
alone (the next op keeps nothing, e.g. an addition) and followed by a Linear (which keeps its input anyway).

Reproduce:  .venv/bin/python benchmarks/activations.py
Writes benchmarks/results/activations_cpu.json. Input: a (256, 1024) float32 tensor (1 MiB), non-leaf.
"""

import torch
import torch.nn.functional as F

import memtrim
import memtrim.functional as MF
from _common import machine, write

CASES = {
    "relu": (torch.relu, torch.relu_, MF.relu, True),
    "leaky_relu": (F.leaky_relu, F.leaky_relu_, MF.leaky_relu, True),
    "relu6": (F.relu6, lambda x: F.relu6(x, inplace=True), MF.relu6, True),
    "hardtanh": (F.hardtanh, F.hardtanh_, MF.hardtanh, True),
    "elu": (F.elu, F.elu_, MF.elu, False),
    "selu": (F.selu, F.selu_, MF.selu, False),
    "celu": (F.celu, F.celu_, MF.celu, False),
    "sigmoid": (torch.sigmoid, torch.sigmoid_, MF.sigmoid, False),
    "tanh": (torch.tanh, torch.tanh_, MF.tanh, False),
    "hardsigmoid": (F.hardsigmoid, lambda x: F.hardsigmoid(x, inplace=True), MF.hardsigmoid, True),
    "softplus": (F.softplus, None, MF.softplus, False),
    "silu": (F.silu, lambda x: F.silu(x, inplace=True), MF.silu, False),
    "gelu": (F.gelu, None, MF.gelu, False),
    "mish": (F.mish, lambda x: F.mish(x, inplace=True), MF.mish, False),
    "hardswish": (F.hardswish, lambda x: F.hardswish(x, inplace=True), MF.hardswish, False),
}


LINEAR = torch.nn.Linear(1024, 1024)


def kept(fn, then_linear=False):
    """Activation bytes kept for backward (the Linear's weight is a parameter, not counted)."""
    leaf = torch.randn(256, 1024, requires_grad=True)
    x = leaf.clone()
    with memtrim.track() as tracker:
        y = fn(x)
        if then_linear:
            y = LINEAR(y)
        held = tracker.live_by_category()["activations"]
    del y
    return held


def main():
    results = {}
    for name, (torch_fn, torch_inplace, ours, has_mask) in CASES.items():
        results[name] = {}
        for place, then_linear in (("alone", False), ("then Linear", True)):
            row = {"torch": kept(torch_fn, then_linear),
                   "torch in place": kept(torch_inplace, then_linear) if torch_inplace else None,
                   "memtrim": kept(ours, then_linear)}
            if torch_inplace is not None and name not in ("softplus", "gelu"):
                row["memtrim in place"] = kept(lambda x, ours=ours: ours(x, inplace=True), then_linear)
            if has_mask:
                row["memtrim mask"] = kept(lambda x, ours=ours: ours(x, save="mask"), then_linear)
            results[name][place] = row
            print(name, place, row)
    print("wrote", write("activations_cpu.json", {"machine": machine(), "input_bytes": 256 * 1024 * 4,
                                                  "results": results}))


if __name__ == "__main__":
    main()

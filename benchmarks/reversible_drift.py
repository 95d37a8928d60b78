"""Reconstruction error of reversible stacks vs depth, float mode and exact (fixed-point) mode.

Blocks: AdditiveCoupling(LayerNorm(32) + Linear(32, 32) + GELU + Linear(32, 32)), input (4, 64), as in the field
notes. The error is ReversibleSequential's own drift report: the largest relative error of a rebuilt block input
over 64 sampled elements per block.

Reproduce:  .venv/bin/python benchmarks/reversible_drift.py
Writes benchmarks/results/reversible_drift_cpu.json.
"""

import warnings

import torch
from torch import nn

import memtrim
from _common import machine, write


def drift(depth, dtype, exact):
    torch.manual_seed(0)
    blocks = [memtrim.AdditiveCoupling(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU(),
                                                     nn.Linear(32, 32))).to(dtype) for _ in range(depth)]
    stack = memtrim.ReversibleSequential(*blocks, exact=exact, check_drift=1.0)
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stack(x).float().sum().backward()
    return max(stack.drift_report().values())


def main():
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for exact in (False, True):
            key = f"{str(dtype).replace('torch.', '')}, {'exact' if exact else 'float'}"
            results[key] = {str(d): drift(d, dtype, exact) for d in (8, 64, 256)}
            print(key, results[key])
    print("wrote", write("reversible_drift_cpu.json", {"machine": machine(), "max_relative_error": results}))


if __name__ == "__main__":
    main()

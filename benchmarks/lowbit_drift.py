"""How far LowBitAdamW moves parameters against AdamW over long runs: the moments are rounded to nearest at every step,
and once sqrt(v)'s change in a step is under half its last place it is rounded away, so v stops following AdamW's and
the update grows with the step count. benchmarks/optim_state.py measures 8 steps of a small GPT; this measures where
the rounding accumulates.

Reproduce (seconds):  .venv/bin/python benchmarks/lowbit_drift.py
Writes benchmarks/results/lowbit_drift_cpu.json.

Three gradient streams on one 256-value parameter (one float8 block), lr 1e-3, no weight decay, each optimizer
stepping its own copy from zeros; the figure is the distance moved, LowBitAdamW's over AdamW's:
* ``steady``: the same gradient every step (0.1 ... 1.0): bits=16 at 8, 100, 500 and 1,000 steps;
* ``spike``: one gradient of 1 on element 0 at step 0, then 1/R on every other element (R = 1e3, 1e5): the other
  elements under bits=8, whose block scale the spike set, at 8 and 200 steps;
* ``noisy``: fresh standard-normal gradients every step (seeded), every bits, at 1,000 steps: the median of the
  elements' ratios, and the difference of the two parameters relative to AdamW's (``|p - q| / |q|``, 2-norms: an
  element's ratio is meaningless where AdamW's random walk ends near 0).
"""

import statistics

import torch

import memtrim
from _common import machine, write

N = 256


def moved(bits: int, gradient, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(LowBitAdamW's parameter, AdamW's) after ``steps`` steps of ``gradient(t)``."""
    p, q = torch.nn.Parameter(torch.zeros(N)), torch.nn.Parameter(torch.zeros(N))
    low = memtrim.LowBitAdamW([p], lr=1e-3, weight_decay=0.0, bits=bits)
    plain = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.0)
    for t in range(steps):
        g = gradient(t)
        p.grad, q.grad = g.clone(), g.clone()
        low.step()
        plain.step()
    return p.detach(), q.detach()


def main() -> None:
    torch.set_num_threads(1)
    results: dict = {"steady": [], "spike": [], "noisy": []}
    steady = torch.linspace(0.1, 1.0, N)
    for steps in (8, 100, 500, 1000):
        p, q = moved(16, lambda t: steady, steps)
        results["steady"].append({"bits": 16, "steps": steps, "ratio_max": (p / q).max().item(),
                                  "ratio_min": (p / q).min().item()})
    for ratio in (1e3, 1e5):
        def spike(t: int, r: float = ratio) -> torch.Tensor:
            g = torch.full((N,), 1 / r)
            g[0] = 1.0 if t == 0 else 0.0
            return g

        for steps in (8, 200):
            p, q = moved(8, spike, steps)
            others = (p[1:] / q[1:])
            results["spike"].append({"bits": 8, "R": ratio, "steps": steps, "ratio_max": others.max().item(),
                                     "ratio_median": others.median().item()})
    for bits in (16, 8, 4):
        generator = torch.Generator().manual_seed(0)
        stream = [torch.randn(N, generator=generator) for _ in range(1000)]
        p, q = moved(bits, stream.__getitem__, 1000)
        ratios = (p / q).abs()
        results["noisy"].append({"bits": bits, "steps": 1000, "ratio_median": statistics.median(ratios.tolist()),
                                 "relative_difference": ((p - q).norm() / q.norm()).item()})
    for kind, rows in results.items():
        for row in rows:
            print(kind, row)
    print("wrote", write("lowbit_drift_cpu.json", {"machine": machine(), "memtrim_source": memtrim.__file__,
                                                    "results": results}))


if __name__ == "__main__":
    main()

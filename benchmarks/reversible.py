"""Reversible stacks: bytes held at the start of backward, step peak and step time vs the plain stack, side by
side with memcnn and revlib (when installed), plus a memory-vs-depth plot.

Setup from the field notes: 16 additive couplings, f and g = Linear(512, 512) + ReLU + Linear(512, 512) on width
1024, batch 256, float32, CPU. The same couplings written as a user's own block (its own forward and inverse) are
the row "user blocks run whole": the stack cannot replay f and g one by one, so it watches the block's forward
for random draws at the dispatcher, one Python call per op. Also timed: the plain step plus one more forward, the
floor of any stack that rebuilds every block in backward.

Reproduce:  .venv/bin/python benchmarks/reversible.py [--rounds 15]
  (the comparison libraries: pip install revlib==1.7.2 && pip install --no-deps memcnn==1.5.2 -- memcnn's own
   dependencies would pull a CUDA build of torch)
Writes benchmarks/results/reversible_cpu.json and benchmarks/results/reversible_memory_vs_depth.png.
"""

import argparse
import copy
import os
import statistics
import time
import warnings

import torch
from torch import nn

import memtrim
from _common import RESULTS, machine, pin_malloc, quartiles, write
from memtrim.measure import plot_curves


def fg(width=512):
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


class WholeBlock(nn.Module):
    """A user's own reversible block (RevViT style: its own forward and inverse), which the stack runs whole and
    inverts by ``inverse``, its forward watched for random draws op by op."""

    def __init__(self, coupling):
        super().__init__()
        self.f, self.g = coupling.f, coupling.g

    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        y1 = x1 + self.f(x2)
        return torch.cat([y1, x2 + self.g(y1)], dim=-1)

    def inverse(self, y):
        y1, y2 = y.chunk(2, dim=-1)
        x2 = y2 - self.g(y1)
        return torch.cat([y1 - self.f(x2), x2], dim=-1)


def builders(depth, width=512):
    torch.manual_seed(0)
    blocks = [memtrim.AdditiveCoupling(fg(width), fg(width)) for _ in range(depth)]
    out = {
        "plain": lambda: nn.Sequential(*copy.deepcopy(blocks)),
        "memtrim": lambda: memtrim.ReversibleSequential(*copy.deepcopy(blocks)),
        "memtrim, user blocks run whole": lambda: memtrim.ReversibleSequential(
            *[WholeBlock(b) for b in copy.deepcopy(blocks)]),
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import memcnn

        def make_memcnn():
            copies = copy.deepcopy(blocks)
            return nn.Sequential(*[memcnn.InvertibleModuleWrapper(memcnn.AdditiveCoupling(b.f, b.g),
                                                                  keep_input=False, keep_input_inverse=False)
                                   for b in copies])

        out["memcnn 1.5.2"] = make_memcnn
    except ImportError:
        print("memcnn not installed: skipped")
    try:
        import revlib

        def make_revlib():
            copies = copy.deepcopy(blocks)
            return revlib.ReversibleSequential(*[m for b in copies for m in (b.f, b.g)], split_dim=1)

        out["revlib 1.7.2"] = make_revlib
    except ImportError:
        print("revlib not installed: skipped")
    return out


def held_and_peak(model, x):
    leaf = x.clone().requires_grad_()
    with memtrim.track(model) as tracker:
        out = model(leaf.clone())
        loss = out.float().sum()
        held = tracker.live_by_category()["activations"]
        del out
        loss.backward()
    report = tracker.report()
    return held, report.peak_bytes - report.timeline[0].total_bytes


def step(model, x):
    out = model(x.clone().requires_grad_())
    out.sum().backward()


def step_and_forward(model, x):
    """The recomputation floor: a plain step plus one more forward with grad (what rebuilding every block costs
    at least, when nothing inside the stack is kept)."""
    step(model, x)
    model(x.clone().requires_grad_())



def main():
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--depth", type=int, default=16)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    x = torch.randn(256, 1024)
    models = {name: make() for name, make in builders(args.depth).items()}
    results = {}
    for name, model in models.items():
        held, peak = held_and_peak(model, x)
        results[name] = {"held_at_backward_start": held, "peak_above_start": peak}
    floor = "plain step + one more forward"
    runs = {name: (step, model) for name, model in models.items()}
    runs[floor] = (step_and_forward, models["plain"])
    times = {name: [] for name in runs}
    for run, model in runs.values():
        run(model, x)
    for _ in range(args.rounds):  # interleaved
        for name, (run, model) in runs.items():
            start = time.perf_counter()
            run(model, x)
            times[name].append(time.perf_counter() - start)
    results[floor] = {}
    for name in runs:
        ratios = sorted(t / p for t, p in zip(times[name], times["plain"]))
        results[name].update(step_ms=1e3 * statistics.median(times[name]), time_ratio_median=statistics.median(ratios),
                             time_ratio_quartiles=quartiles(ratios), time_ratio_range=[ratios[0], ratios[-1]])
        r = results[name]
        memory = (f"held {r['held_at_backward_start'] / 2**20:.1f} MiB, peak {r['peak_above_start'] / 2**20:.1f} MiB, "
                  if "held_at_backward_start" in r else "")
        print(f"{name}: {memory}time {r['time_ratio_median']:.3f}x (quartiles {r['time_ratio_quartiles'][0]:.3f}-"
              f"{r['time_ratio_quartiles'][1]:.3f}, range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    depths = [1, 2, 4, 8, 16, 32]
    curve = {}
    for name in ("plain", "memtrim"):
        curve[name] = []
        for depth in depths:
            model = builders(depth, width=128)[name]()
            curve[name].append(held_and_peak(model, torch.randn(64, 256))[0])
    write("reversible_cpu.json", {"machine": machine(), "depth": args.depth, "rounds": args.rounds,
                                  "results": results, "memory_vs_depth": {"depths": depths, **curve}})
    try:
        plot_curves(os.path.join(RESULTS, "reversible_memory_vs_depth.png"), depths, curve,
                    xlabel="coupling blocks (f, g = Linear(128)+ReLU+Linear(128), width 256, batch 64)",
                    ylabel="activation bytes held at backward start (MiB)",
                    title="memtrim tracker: plain vs reversible stack", divide_by=2**20)
    except ImportError:
        print("matplotlib not installed: no plot")
    print("wrote", os.path.join(RESULTS, "reversible_cpu.json"))


if __name__ == "__main__":
    main()

"""memtrim.convert's fixed cost per converted call site: the Python of its hooks (mark the producer's output, open and
close the consumer's scope, pack and unpack what it keeps, call the rebuild), measured where the tensors are so small
that the kernels cost next to nothing. This is what makes convert's step time worse at small model sizes than at the
widths people train (benchmarks/convert_zoo_time.py); it does not grow with the tensors.

Reproduce:  .venv/bin/python benchmarks/convert_overhead.py [--rounds 41]   (on an otherwise idle machine)
Writes benchmarks/results/convert_overhead_cpu.json (``--calls-only``: convert_overhead_calls_cpu.json).

Three stacks of 20 blocks, one thread: ``LayerNorm -> Linear`` (the norm's output rebuilt for the Linear, rule
``layer_norm_consumer``) and ``Linear -> GELU -> Linear`` (the GELU's output rebuilt for the second Linear), batch 4,
width 16; ``Conv2d -> BatchNorm2d -> ReLU`` (the ReLU's output rebuilt from the BatchNorm's input for the next
block's convolution, rule ``batchnorm_activation``) on 2x4x6x6. Each round times 20 calls of forward, and of
forward + backward, for the plain and the converted stack in turn (NOTE [ interleaved timing rounds ] in _common.py);
the figure is the difference of the two stacks' fastest rounds
divided by the converted call sites, in microseconds. The rebuild in backward (a LayerNorm, GELU or BatchNorm + ReLU
on a tiny tensor) is part of it. Beside the times, a count that needs no clock: the Python calls (functions, builtins
and methods, as cProfile counts them) per converted call site, converted minus plain (``--calls-only`` gives only
those, in seconds, on any machine load).
"""

import argparse
import copy
import cProfile
import pstats
import time

import torch
from torch import nn

import memtrim
from _common import machine, pin_malloc, write

BLOCKS, BATCH, WIDTH = 20, 4, 16


class NormLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class ConvBnReLU(nn.Module):
    """A ResNet's unit: the BatchNorm + ReLU fused (rule ``batchnorm_activation``), its output rebuilt from the
    BatchNorm's input for the next block's convolution. Inputs are 2x4x6x6 (``per_site`` reshapes ``x``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.act = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.bn(self.conv(x)))


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def per_site(block: type[nn.Module], rounds: int) -> dict:
    torch.manual_seed(0)
    plain = nn.Sequential(*[block() for _ in range(BLOCKS)])
    x = torch.randn(*((2, 4, 6, 6) if block is ConvBnReLU else (BATCH, WIDTH)), requires_grad=True)
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=x)
    # one change per block (the last ReLU's output goes to no consumer: nothing to rebuild), or not per site
    sites = len(report.changes)
    assert sites in (BLOCKS, BLOCKS - 1), report

    def forward(m: nn.Module) -> None:
        m(x)

    def step(m: nn.Module) -> None:
        m(x).sum().backward()

    result: dict = {"block": block.__name__, "rule": report.changes[0].rule, "sites": sites,
                    "python_calls_per_site": python_calls(plain, converted, x, sites)}
    for name, fn in (("forward", forward), ("forward_backward", step)) if rounds else ():
        best = {"plain": float("inf"), "converted": float("inf")}
        for m in (plain, converted):
            for _ in range(20):
                fn(m)
        for _ in range(rounds):
            for key, m in (("plain", plain), ("converted", converted)):
                start = time.perf_counter()
                for _ in range(20):
                    fn(m)
                best[key] = min(best[key], (time.perf_counter() - start) / 20)
        result[name] = {"plain_us": 1e6 * best["plain"], "converted_us": 1e6 * best["converted"],
                        "per_site_us": 1e6 * (best["converted"] - best["plain"]) / sites}
    return result


def python_calls(plain: nn.Module, converted: nn.Module, x: torch.Tensor, sites: int) -> dict:
    """Python calls (functions, builtins and methods, as cProfile counts them) per converted call site, converted
    minus plain, in forward and in forward + backward: a count that does not move with the machine's load."""
    counts = {}
    for name, backward in (("forward", False), ("forward_backward", True)):
        per_step = {}
        for key, m in (("plain", plain), ("converted", converted)):
            for _ in range(5):
                (m(x).sum().backward() if backward else m(x))
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                (m(x).sum().backward() if backward else m(x))
            profile.disable()
            per_step[key] = pstats.Stats(profile).total_calls / 20
        counts[name] = (per_step["converted"] - per_step["plain"]) / sites
    return counts


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls-only", action="store_true",
                        help="count the Python calls per site, no clock (writes convert_overhead_calls_cpu.json)")
    args = parser.parse_args()
    if args.calls_only:
        args.rounds = 0
    torch.set_num_threads(1)
    results = [per_site(block, args.rounds) for block in (NormLinear, GeluMLP, ConvBnReLU)]
    for r in results:
        calls = r["python_calls_per_site"]
        times = (f"forward +{r['forward']['per_site_us']:.0f} us, forward + backward "
                 f"+{r['forward_backward']['per_site_us']:.0f} us per converted call site; " if args.rounds else "")
        print(f"{r['block']} ({r['rule']}): {times}+{calls['forward']:.1f} / +{calls['forward_backward']:.1f} "
              "Python calls")
    name = "convert_overhead_calls_cpu.json" if args.calls_only else "convert_overhead_cpu.json"
    print("wrote", write(name, {"machine": machine(), "memtrim_source": memtrim.__file__, "rounds": args.rounds,
                                "blocks": BLOCKS, "batch": BATCH, "width": WIDTH, "results": results}))


if __name__ == "__main__":
    main()

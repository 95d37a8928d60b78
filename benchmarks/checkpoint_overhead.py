"""checkpoint_modules' fixed cost per checkpointed call against torch's own ``checkpoint``, where the kernels cost next
to nothing: four blocks ``Linear(64) -> Dropout(0.1) -> GELU``, batch 8, one thread, SGD. memtrim's per-call work
beyond torch's (the buffer snapshot, training flags, the parameters' versions, the explicit-generator watch, the
argument flattening) is Python; at the widths people train it vanishes beside the kernels.

Reproduce:  .venv/bin/python benchmarks/checkpoint_overhead.py [--rounds 21] [--rev REV]   (times: an idle machine)
Writes benchmarks/results/checkpoint_overhead_cpu.json.

Two figures per variant: the Python calls per training step (functions, builtins and methods, as cProfile counts
them: no clock, any machine load) and the step time of the variant over torch's checkpoint, per interleaved round
(NOTE [ interleaved timing rounds ] in _common.py), median and quartiles. ``--rev REV`` adds memtrim as it was at an
earlier commit (its ``src`` extracted to a temporary folder and imported in a child process: calls only).
"""

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.utils.checkpoint as tuc
from torch import nn

import memtrim
from _common import head_commit, machine, pin_malloc, quartiles, src_at, write

BLOCKS, BATCH, WIDTH = 4, 8, 64


class _TorchCheckpointed(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tuc.checkpoint(self.block, x, use_reentrant=False)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1), nn.GELU()) for _ in range(BLOCKS)]
    if kind == "torch checkpoint":
        return nn.Sequential(*[_TorchCheckpointed(b) for b in blocks])
    model = nn.Sequential(*blocks)
    if kind == "memtrim checkpoint_modules":
        memtrim.checkpoint_modules(model, lambda name, module: name.isdigit())
    return model


def _stepper(model: nn.Module):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):  # warm: lazy inits, caches
        step()
    return step


def calls_per_step(kind: str, steps: int = 10) -> int:
    step = _stepper(_model(kind))
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return pstats.Stats(profile).total_calls // steps  # type: ignore[attr-defined]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=50, help="steps per variant per round")
    parser.add_argument("--rev", help="also count the calls of memtrim at this earlier commit")
    parser.add_argument("--calls-of", help=argparse.SUPPRESS)  # the child process of --rev: print one count
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.calls_of:
        print(json.dumps(calls_per_step(args.calls_of)))
        return
    pin_malloc()
    kinds = ["plain (no checkpoint)", "torch checkpoint", "memtrim checkpoint_modules"]
    calls = {kind: calls_per_step(kind) for kind in kinds}
    if args.rev:
        with tempfile.TemporaryDirectory() as folder:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([src_at(args.rev, folder),
                                                               os.path.dirname(os.path.abspath(__file__))]))
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--calls-of", kinds[2]], env=env,
                                 capture_output=True, text=True, check=True).stdout
            calls[f"memtrim checkpoint_modules at {args.rev}"] = json.loads(out.strip().splitlines()[-1])
    steppers = {kind: _stepper(_model(kind)) for kind in kinds}
    ratios: dict[str, list[float]] = {kind: [] for kind in kinds if kind != "torch checkpoint"}
    for _ in range(args.rounds):
        seconds = {}
        for kind in kinds:
            start = time.perf_counter()
            for _ in range(args.steps):
                steppers[kind]()
            seconds[kind] = time.perf_counter() - start
        for kind in ratios:
            ratios[kind].append(seconds[kind] / seconds["torch checkpoint"])
    result = {
        "machine": machine(), "commit": head_commit(), "blocks": BLOCKS, "batch": BATCH, "width": WIDTH,
        "python_calls_per_step": calls,
        "step_time_over_torch_checkpoint": {kind: {"median": statistics.median(r), "quartiles": quartiles(r)}
                                            for kind, r in ratios.items()},
        "rounds": args.rounds, "steps_per_round": args.steps,
    }
    print(json.dumps(result, indent=1))
    print("wrote", write("checkpoint_overhead_cpu.json", result))


if __name__ == "__main__":
    main()

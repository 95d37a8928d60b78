"""What watching the global generators costs (NOTE [ another thread's draws ] in memtrim/techniques/_generators.py):
where another Python thread is alive (an idle one: tqdm's monitor, a data loader's), checkpoint_modules and
ReversibleSequential read the global generators' state at every torch call of a checkpointed forward and its
recomputation. Step time (forward, backward, SGD step) with an idle second thread against none, same model, same
batches, in interleaved rounds; the ratio per round, median and quartiles; the same for the plain model (what an
idle thread costs without memtrim); and the cost of one read.

Reproduce:  .venv/bin/python benchmarks/thread_watch.py [--rounds 15]     (on an idle machine: it times)
Writes benchmarks/results/thread_watch_cpu.json.
"""

import argparse
import statistics
import threading
import time
import timeit

import torch
from torch import nn

import memtrim
from _common import machine, pin_malloc, quartiles, write
from memtrim.techniques._generators import _global_generators


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "ReversibleSequential (4 additive couplings, width 32)":
        return memtrim.ReversibleSequential(*[memtrim.AdditiveCoupling(
            nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.3), nn.Tanh())) for _ in range(4)])
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.3), nn.GELU()) for _ in range(4)])
    if kind.startswith("checkpoint_modules"):
        memtrim.checkpoint_modules(model, lambda name, module: name.isdigit())
    return model


def _step_seconds(model: nn.Module, steps: int, thread: bool, width: int) -> float:
    """Median seconds per step over ``steps`` steps, with an idle second thread alive or not."""
    stop = threading.Event()
    other = threading.Thread(target=stop.wait) if thread else None
    if other is not None:
        other.start()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, width, generator=torch.Generator().manual_seed(1))
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        if other is not None:
            other.join()
    return statistics.median(times)


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    read = min(timeit.repeat(_global_generators, number=20_000, repeat=5)) / 20_000
    result = {"machine": machine(), "rounds": args.rounds, "steps_per_round": args.steps,
              "one_read_seconds": read, "models": {}}
    print(f"one read of the global generators: {read * 1e6:.2f} us")
    for kind, width in (("plain (4 x Linear(64)-Dropout-GELU, no memtrim: the thread's own cost)", 64),
                        ("checkpoint_modules (4 x Linear(64)-Dropout-GELU)", 64),
                        ("ReversibleSequential (4 additive couplings, width 32)", 64)):
        model = _model(kind)
        _step_seconds(model, 5, False, width)  # warm-up
        ratios, alone, beside = [], [], []
        for _ in range(args.rounds):
            a = _step_seconds(model, args.steps, False, width)
            b = _step_seconds(model, args.steps, True, width)
            alone.append(a)
            beside.append(b)
            ratios.append(b / a)
        result["models"][kind] = {"step_seconds_alone": statistics.median(alone),
                                  "step_seconds_beside_an_idle_thread": statistics.median(beside),
                                  "ratio_median": statistics.median(ratios), "ratio_quartiles": quartiles(ratios)}
        print(f"{kind}: {statistics.median(alone) * 1e3:.2f} ms alone, ratio beside an idle thread "
              f"{statistics.median(ratios):.2f} (quartiles {', '.join(f'{q:.2f}' for q in quartiles(ratios))})")
    print(write("thread_watch_cpu.json", result))


if __name__ == "__main__":
    main()

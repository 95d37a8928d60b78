"""Step time with and without memtrim.track(), as ratios measured side by side.

Reproduce:  .venv/bin/python benchmarks/tracker_overhead.py [--rounds 15] [--steps 10] [--device cpu]
Writes benchmarks/results/tracker_overhead_<device>.json.
"""

import argparse
import statistics
import time

import torch

import memtrim
from _common import machine, pin_malloc, train_step, workloads, write


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = {}
    for name, (model, x, y, loss_fn, optimizer) in workloads(args.device).items():
        for _ in range(3):
            train_step(model, x, y, loss_fn, optimizer)  # warm up, create optimizer state
        plain, tracked = [], []
        for _ in range(args.rounds):  # interleaved: both see the same machine noise
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step(model, x, y, loss_fn, optimizer)
            sync()
            plain.append((time.perf_counter() - start) / args.steps)
            start = time.perf_counter()
            with memtrim.track(model, optimizer):
                for _ in range(args.steps):
                    train_step(model, x, y, loss_fn, optimizer)
            sync()
            tracked.append((time.perf_counter() - start) / args.steps)
        ratios = sorted(t / p for t, p in zip(tracked, plain))
        results[name] = {
            "plain_step_ms_median": 1e3 * statistics.median(plain),
            "tracked_step_ms_median": 1e3 * statistics.median(tracked),
            "ratio_median": statistics.median(ratios),
            "ratio_min": ratios[0],
            "ratio_max": ratios[-1],
        }
        print(f"{name}: plain {results[name]['plain_step_ms_median']:.2f} ms, tracked "
              f"{results[name]['tracked_step_ms_median']:.2f} ms, ratio {results[name]['ratio_median']:.2f}x "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
    path = write(f"tracker_overhead_{args.device.split(':')[0]}.json",
                 {"machine": machine(), "rounds": args.rounds, "steps_per_round": args.steps, "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()

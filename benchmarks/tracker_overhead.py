"""Step time with and without memtrim.track(), as ratios measured side by side.

Reproduce:  .venv/bin/python benchmarks/tracker_overhead.py [--rounds 15] [--steps 10] [--device cpu]
Writes benchmarks/results/tracker_overhead_<device>.json.

Two kinds of workload:
* training steps (the seed MLP, the small GPT): ``--steps`` steps per timed round;
* phase switches (issue 10, item 14): a stack of N Linear layers, and a loop of 300 iterations that calls one
  layer and then runs an op outside any module (an inference loop under ``torch.no_grad()``: each iteration
  switches the phase from "forward" to "other" and back). The tracker once rescanned every parameter at each
  switch (16x plain at 10 layers, 1596x at 1000); its cost must not grow with N. One loop per timed round.
Each timed tracked round includes entering and leaving the tracker.
"""

import argparse
import statistics
import time

import torch

import memtrim
from _common import machine, pin_malloc, quartiles, train_step, workloads, write

PHASE_SWITCH_ITERATIONS = 300
PHASE_SWITCH_LAYERS = (10, 100, 1000)
PHASE_SWITCH_WIDTH, PHASE_SWITCH_BATCH = 128, 512


def phase_switch_workload(n_layers: int, device: str):
    """(layers, run): ``run()`` is one loop of PHASE_SWITCH_ITERATIONS layer calls, each followed by an op outside
    any module."""
    torch.manual_seed(0)
    layers = torch.nn.Sequential(
        *[torch.nn.Linear(PHASE_SWITCH_WIDTH, PHASE_SWITCH_WIDTH) for _ in range(n_layers)]
    ).to(device)
    x = torch.randn(PHASE_SWITCH_BATCH, PHASE_SWITCH_WIDTH, device=device)

    def run() -> None:
        h = x
        with torch.no_grad():
            for i in range(PHASE_SWITCH_ITERATIONS):
                h = layers[i % n_layers](h)  # a module call: phase "forward"
                h = torch.tanh(h)  # outside any module: phase "other"

    return layers, run


def all_workloads(device: str, steps: int) -> dict:
    """name -> (model, optimizer, run once, units per run, unit name)."""
    found = {}
    for name, (model, x, y, loss_fn, optimizer) in workloads(device).items():
        def run(model=model, x=x, y=y, loss_fn=loss_fn, optimizer=optimizer) -> None:
            for _ in range(steps):
                train_step(model, x, y, loss_fn, optimizer)

        found[name] = (model, optimizer, run, steps, "step")
    for n_layers in PHASE_SWITCH_LAYERS:
        layers, run = phase_switch_workload(n_layers, device)
        name = (f"phase switches ({n_layers} Linear({PHASE_SWITCH_WIDTH}) layers, batch {PHASE_SWITCH_BATCH}, "
                f"{PHASE_SWITCH_ITERATIONS} iterations of a layer call + tanh outside any module, no_grad)")
        found[name] = (layers, None, run, 1, "loop")
    return found


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default=None, help="run only the workloads whose name contains this text")
    args = parser.parse_args()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    results = {}
    for name, (model, optimizer, run, units, unit) in all_workloads(args.device, args.steps).items():
        if args.only and args.only not in name:
            continue
        for _ in range(2):
            run()  # warm up, create optimizer state
        with memtrim.track(model, optimizer):
            run()  # the tracker's own first-use costs (imports, caches) are not a round's
        plain, tracked = [], []
        for _ in range(args.rounds):  # interleaved: both see the same machine noise
            sync()
            start = time.perf_counter()
            run()
            sync()
            plain.append((time.perf_counter() - start) / units)
            start = time.perf_counter()
            with memtrim.track(model, optimizer):
                run()
            sync()
            tracked.append((time.perf_counter() - start) / units)
        ratios = sorted(t / p for t, p in zip(tracked, plain))
        results[name] = {
            f"plain_{unit}_ms_median": 1e3 * statistics.median(plain),
            f"tracked_{unit}_ms_median": 1e3 * statistics.median(tracked),
            "ratio_median": statistics.median(ratios),
            "ratio_quartiles": quartiles(ratios),
            "ratio_min": ratios[0],
            "ratio_max": ratios[-1],
        }
        q1, q3 = results[name]["ratio_quartiles"]
        print(f"{name}: plain {1e3 * statistics.median(plain):.2f} ms, tracked {1e3 * statistics.median(tracked):.2f} "
              f"ms per {unit}, ratio {results[name]['ratio_median']:.2f}x (quartiles {q1:.2f}-{q3:.2f})", flush=True)
    if args.only:
        return  # a partial run is not a result
    path = write(f"tracker_overhead_{args.device.split(':')[0]}.json",
                 {"machine": machine(), "rounds": args.rounds, "steps_per_round": args.steps, "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()

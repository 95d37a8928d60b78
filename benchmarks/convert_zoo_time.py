"""Step time of memtrim.convert on the real model libraries of benchmarks/convert_zoo.py: each model and its converted
copy train (forward, backward, AdamW step) in interleaved rounds; the median of the per-round ratios, with quartiles.
Beside the times, a count that needs no clock: the ops one step runs and the bytes their outputs write, plain and
converted (the recompute work convert adds).

Reproduce:  zoovenv/bin/python benchmarks/convert_zoo_time.py [--rounds 15] [--only NAME ...]
            (the venv that convert_zoo.py's docstring sets up; run on an otherwise idle machine)
Writes benchmarks/results/convert_zoo_time_cpu.json.
"""

import argparse
import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memtrim
from _common import machine, pin_malloc, quartiles, write
from convert_zoo import MODELS, build, first_tensor, import_torchvision, version
from memtrim.measure.hooks import tensors_in


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    first_tensor(model(**batch)).float().square().mean().backward()
    opt.step()


class _OpBytes(TorchDispatchMode):
    """Counts the ops a step runs and the bytes their outputs write: the recompute work convert adds, without a
    clock (deterministic, unlike the times)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        self.bytes += sum(t.nbytes for t in tensors_in(out))
        return out


def work(model, opt, batch) -> tuple[int, int]:
    """(ops, bytes their outputs write) of one step."""
    counter = _OpBytes()
    with counter:
        step(model, opt, batch)
    return counter.ops, counter.bytes


def run(key: str, rounds: int) -> dict:
    label, built, skipped = build(key)
    if built is None:
        return skipped or {}
    plain, batch, library = built
    plain.train()
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=batch)
    models = {"plain": plain, "converted": converted}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k in models:
        step(models[k], opts[k], batch)
    ops = {k: work(models[k], opts[k], batch) for k in models}
    start = time.perf_counter()
    step(plain, opts["plain"], batch)
    repeats = max(2, int(0.2 / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for k in models:
            start = time.perf_counter()
            for _ in range(repeats):
                step(models[k], opts[k], batch)
            times[k].append((time.perf_counter() - start) / repeats)
    ratios = sorted(c / p for c, p in zip(times["converted"], times["plain"]))
    return {"model": label, "library": library, "changes": len(report.changes),
            "step_ms_plain": 1e3 * statistics.median(times["plain"]),
            "step_time_ratio_median": statistics.median(ratios), "step_time_ratio_quartiles": quartiles(ratios),
            "step_time_ratio_range": [ratios[0], ratios[-1]], "repeats_per_round": repeats,
            "ops_per_step": {k: v[0] for k, v in ops.items()},
            "bytes_written_per_step": {k: v[1] for k, v in ops.items()},
            "bytes_written_ratio": ops["converted"][1] / ops["plain"][1]}


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    args = parser.parse_args()
    _, tv_note = import_torchvision()
    results = {}
    for key in args.only or MODELS:
        results[key] = r = run(key, args.rounds)
        if "step_time_ratio_median" in r:
            q = r["step_time_ratio_quartiles"]
            print(f"{r['model']}: {r['step_ms_plain']:.1f} ms, converted {r['step_time_ratio_median']:.3f}x "
                  f"({q[0]:.3f}-{q[1]:.3f}); ops write {r['bytes_written_ratio']:.3f}x the bytes")
        else:
            print(f"{r['model']}: {r['skipped']}")
    environment = {"torch": torch.__version__, "transformers": version("transformers"), "timm": version("timm"),
                   "torchvision": version("torchvision"), "torchvision_import": tv_note}
    print("wrote", write("convert_zoo_time_cpu.json", {"machine": machine(), "environment": environment,
                                                       "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()

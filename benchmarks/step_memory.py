"""Memory of one training step (steady state: the optimizer state exists), by category, for the workloads.

Reproduce:  .venv/bin/python benchmarks/step_memory.py [--device cpu]
Writes benchmarks/results/step_memory_<device>.json (on CUDA also the allocator's peak for comparison).
"""

import argparse

import torch

import memtrim
from _common import machine, train_step, workloads, write
from memtrim.models import SeedMLP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    results = {}
    for name, (model, x, y, loss_fn, optimizer) in workloads(args.device).items():
        train_step(model, x, y, loss_fn, optimizer)
        report = memtrim.measure_step(model, x, y, loss_fn, optimizer)
        held = next(report.timeline[i - 1].by_category["activations"]
                    for i, e in enumerate(report.timeline) if e.phase == "backward")
        results[name] = {**report.to_dict(timeline=False), "activations_at_backward_start": held}
        print(name)
        print(report)
    # the seed story: in-place ReLU on one tensor, and inside the MLP
    x = torch.randn(10000, 10000, device=args.device)
    relu = {name: memtrim.op_memory(fn, x) for name, fn in (("torch.relu", torch.relu), ("torch.relu_", torch.relu_))}
    relu = {name: {"allocated_bytes": m.allocated_bytes, "peak_bytes": m.peak_bytes} for name, m in relu.items()}
    del x
    seed = {}
    for inplace in (False, True):
        torch.manual_seed(0)
        model = SeedMLP(inplace=inplace).to(args.device)
        batch = torch.randn(64, 784, device=args.device)
        with memtrim.track(model) as tracker:
            out = model(batch)
            kept = tracker.live_by_category()["activations"]
        del out
        seed[f"nn.ReLU(inplace={inplace})"] = {
            "activations_kept_after_forward": kept,
            "forward_peak_new_bytes": tracker.report().peak_bytes - tracker.report().timeline[0].total_bytes,
        }
        print(f"seed MLP inplace={inplace}: {seed[f'nn.ReLU(inplace={inplace})']}")
    print(f"relu on 10000x10000: {relu}")
    path = write(f"step_memory_{args.device.split(':')[0]}.json",
                 {"machine": machine(), "results": results, "relu_10000x10000": relu, "seed_mlp_forward": seed})
    print("wrote", path)


if __name__ == "__main__":
    main()

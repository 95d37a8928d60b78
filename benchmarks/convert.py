"""memtrim.convert on the reference workloads: activation bytes kept at the start of backward, peak bytes of a
training step, and step time, before and after, measured side by side in one run; and torch.compile (default,
and with torch._functorch.config.activation_memory_budget=0.5) on the same models for comparison.

Compiled graphs keep their tensors inside one compiled autograd node, which the tracker's hooks do not see
into, so their activation bytes are read off the autograd graph (memtrim.autograd_graph_bytes; on eager
models it equals the tracker's figure, see tests/measure/test_tracker_independent.py).

Reproduce:  .venv/bin/python benchmarks/convert.py [--rounds 15] [--no-compile]
Writes benchmarks/results/convert_cpu.json.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F

import memtrim
from _common import machine, pin_malloc, quartiles, write
from memtrim.models import ConvBNActCNN, ResNetCNN, SeedMLP, SmallGPT


def lm_loss(out, t):
    return F.cross_entropy(out.flatten(0, 1), t.flatten())


def leaky_cnn():
    return ConvBNActCNN(in_channels=3, width=32, depth=6)


WORKLOADS = {
    "seed MLP (batch 64)": (SeedMLP, lambda: (torch.randn(64, 784), torch.randint(0, 10, (64,))), F.nll_loss),
    "ResNet-style CNN, BN+ReLU (batch 32)": (
        ResNetCNN, lambda: (torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))), F.cross_entropy),
    "6-layer conv+BN+LeakyReLU CNN (batch 16, 32x32)": (
        leaky_cnn, lambda: (torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))), F.cross_entropy),
    "small GPT (4 layers, d=256, batch 8, seq 128)": (
        lambda: SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128, vocab_size=256),
        lambda: (lambda t: (t, t))(torch.randint(0, 256, (8, 128))), lm_loss),
}



def step(model, opt, x, y, loss_fn):
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()


def memory(model, opt, x, y, loss_fn):
    step(model, opt, x, y, loss_fn)
    opt.zero_grad(set_to_none=True)  # (the standard loop has no gradient in its forward: zero_grad() starts a step)
    report = memtrim.measure_step(model, x, y, loss_fn, opt)
    held = next(report.timeline[i - 1].by_category["activations"]
                for i, e in enumerate(report.timeline) if e.phase == "backward")
    return {"activations_at_backward_start": held, "peak_bytes": report.peak_bytes,
            "peak_phase": report.peak_phase}


def compiled(model, budget):
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    if hasattr(functorch_config, "activation_memory_budget"):
        functorch_config.activation_memory_budget = 1.0 if budget is None else budget
    copy_ = copy.deepcopy(model)
    return torch.compile(copy_)


def graph_bytes(model, x, y, loss_fn):
    loss = loss_fn(model(x), y)
    return memtrim.autograd_graph_bytes(loss, exclude=[*model.parameters(), *model.buffers(), x, y])


def main():
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    args = parser.parse_args()
    results = {}
    for name, (make, data, loss_fn) in WORKLOADS.items():
        torch.manual_seed(0)
        plain = make()
        converted = copy.deepcopy(plain)
        x, y = data()
        converted, report = memtrim.convert(converted, example_inputs=(x,))
        opts = {"plain": torch.optim.AdamW(plain.parameters()), "converted": torch.optim.AdamW(converted.parameters())}
        models = {"plain": plain, "converted": converted}
        compiled_bytes = {}
        if not args.no_compile:
            for label, budget in (("compile", None), ("compile, budget 0.5", 0.5)):
                models[label] = compiled(plain, budget)
                opts[label] = torch.optim.AdamW(models[label].parameters())
                step(models[label], opts[label], x, y, loss_fn)  # compiles (tens of seconds)
                loss = loss_fn(models[label](x), y)
                compiled_bytes[label] = memtrim.autograd_graph_bytes(
                    loss, exclude=[*models[label].parameters(), *models[label].buffers(), x, y])
                del loss
        # timing first: after a measurement glibc's malloc trims its heap and the next steps page-fault
        # (seen as a 1.5x slowdown of whichever model runs second; gone with MALLOC_TRIM_THRESHOLD_ pinned)
        times: dict[str, list[float]] = {k: [] for k in models}
        start = time.perf_counter()
        step(plain, opts["plain"], x, y, loss_fn)
        repeats = max(3, int(0.1 / (time.perf_counter() - start)))  # about 0.1 s per sample
        for _ in range(args.rounds):  # interleaved
            for k in models:
                start = time.perf_counter()
                for _ in range(repeats):
                    step(models[k], opts[k], x, y, loss_fn)
                times[k].append((time.perf_counter() - start) / repeats)
        row = {k: memory(models[k], opts[k], x, y, loss_fn) for k in ("plain", "converted")}
        row["plain"]["activations_from_graph"] = graph_bytes(plain, x, y, loss_fn)
        for label, held in compiled_bytes.items():
            r = sorted(c / p for c, p in zip(times[label], times["plain"]))
            row[label] = {"activations_from_graph": held, "step_time_ratio_median": statistics.median(r),
                          "step_time_ratio_quartiles": quartiles(r), "step_time_ratio_range": [r[0], r[-1]]}
            print(f"  {label}: activations {held:,} B, time {statistics.median(r):.3f}x")
        ratios = sorted(c / p for c, p in zip(times["converted"], times["plain"]))
        row["step_ms_plain"] = 1e3 * statistics.median(times["plain"])
        row["step_time_ratio_median"] = statistics.median(ratios)
        row["step_time_ratio_quartiles"] = quartiles(ratios)
        row["step_time_ratio_range"] = [ratios[0], ratios[-1]]
        before, after = row["plain"]["activations_at_backward_start"], row["converted"]["activations_at_backward_start"]
        row["activation_reduction"] = 1 - after / before if before else 0.0
        row["changes"] = [f"{' + '.join(c.modules)}: {c.before} -> {c.after}" for c in report.changes]
        row["skipped"] = [f"{' + '.join(s.modules)}: {s.reason}" for s in report.skipped]
        results[name] = row
        print(f"{name}: activations {before:,} -> {after:,} B ({row['activation_reduction']:.0%} fewer), peak "
              f"{row['plain']['peak_bytes']:,} -> {row['converted']['peak_bytes']:,} B, time "
              f"{row['step_time_ratio_median']:.3f}x (quartiles {row['step_time_ratio_quartiles'][0]:.3f}-"
              f"{row['step_time_ratio_quartiles'][1]:.3f}, range {ratios[0]:.2f}-{ratios[-1]:.2f})")
    print("wrote", write("convert_cpu.json", {"machine": machine(), "rounds": args.rounds, "results": results}))


if __name__ == "__main__":
    main()

"""Optimizer step fused into backward: step time vs standard training, side by side with PyTorch's tutorial
recipe (one optimizer per parameter, stepped from a post-accumulate-grad hook) and torchtune's
optimizer-in-backward (when the `bench` extra is installed), plus peak memory by category for the small GPT.

Reproduce:  .venv/bin/python benchmarks/optimizer_in_backward.py [--rounds 15] [--steps 20]
Writes benchmarks/results/optimizer_in_backward_cpu.json.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import memtrim
from _common import head_commit, machine, pin_malloc, quartiles, third_step_report, write
from memtrim.models import SeedMLP, SmallGPT


def seed_case():
    """The seed notebook's own timing case: Linear 50-50-50-1, batch 5, Adam."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(),
                                torch.nn.Linear(50, 1))
    return model, torch.randn(5, 50), torch.randn(5, 1), F.mse_loss, lambda p: torch.optim.Adam(p, lr=1e-3)


def mlp_case():
    torch.manual_seed(0)
    return (SeedMLP(), torch.randn(64, 784), torch.randint(0, 10, (64,)), F.nll_loss,
            lambda p: torch.optim.Adam(p, lr=1e-3))


def gpt_case():
    torch.manual_seed(0)
    model = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128, vocab_size=256)
    idx = torch.randint(0, 256, (8, 128))

    def loss_fn(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    return model, idx, idx, loss_fn, lambda p: torch.optim.AdamW(p, lr=1e-3)


class Standard:
    name = "standard"

    def __init__(self, model, make_opt):
        self.opt = make_opt(model.parameters())

    def step(self, model, x, y, loss_fn):
        self.opt.zero_grad()
        loss_fn(model(x), y).backward()
        self.opt.step()


class Memtrim(Standard):
    name = "memtrim.OptimizerInBackward"

    def __init__(self, model, make_opt):
        self.opt = memtrim.OptimizerInBackward(make_opt(model.parameters()), model=model)


class Tutorial:
    """PyTorch's tutorial recipe: one optimizer per parameter, stepped in its post-accumulate-grad hook."""

    name = "tutorial (one optimizer per parameter)"

    def __init__(self, model, make_opt):
        self.opts = {p: make_opt([p]) for p in model.parameters()}

        def hook(p):
            self.opts[p].step()
            self.opts[p].zero_grad()

        self.handles = [p.register_post_accumulate_grad_hook(hook) for p in model.parameters()]

    def step(self, model, x, y, loss_fn):
        loss_fn(model(x), y).backward()


class Torchtune:
    name = "torchtune optimizer-in-backward"

    def __init__(self, model, make_opt):
        from torchtune import training

        self.opt_dict = {p: make_opt([p]) for p in model.parameters()}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=self.opt_dict)

    def step(self, model, x, y, loss_fn):
        loss_fn(model(x), y).backward()


def methods():
    found = [Standard, Memtrim, Tutorial]
    try:
        import torchtune  # noqa: F401

        found.append(Torchtune)
    except ImportError:
        print("torchtune is not installed (pip install -e '.[bench]'): its column is skipped")
    return found


def timing(case, rounds, steps):
    _, x, y, loss_fn, make_opt = case()
    runners = []
    for method in methods():
        model = case()[0]  # each method trains its own copy, built from the same seed
        runners.append((method.name, model, method(model, make_opt)))
    times = {name: [] for name, _, _ in runners}
    for _, model, runner in runners:
        for _ in range(3):
            runner.step(model, x, y, loss_fn)
    for _ in range(rounds):  # interleaved, so every method sees the same machine noise
        for name, model, runner in runners:
            start = time.perf_counter()
            for _ in range(steps):
                runner.step(model, x, y, loss_fn)
            times[name].append((time.perf_counter() - start) / steps)
    base = times["standard"]
    out = {}
    for name, values in times.items():
        ratios = sorted(v / b for v, b in zip(values, base))
        out[name] = {"step_ms_median": 1e3 * statistics.median(values), "ratio_median": statistics.median(ratios),
                     "ratio_quartiles": quartiles(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1]}
    return out


MEMORY_CASES = {
    # activation-heavy: the step peaks early in backward, where few gradients exist yet
    "small GPT (4 layers, d=256, seq 128, batch 8, vocab 256), AdamW": dict(batch=8, seq=128, vocab=256),
    # parameter-heavy (fine-tuning-like: small batch, large vocabulary): the step peaks in the optimizer step
    "small GPT (4 layers, d=256, seq 32, batch 1, vocab 8192), AdamW": dict(batch=1, seq=32, vocab=8192),
}


def gpt_memory(bucket_bytes):
    out = {}
    for label, cfg in MEMORY_CASES.items():
        out[label] = {}
        for wrap in (False, True):
            torch.manual_seed(0)
            model = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=cfg["seq"], vocab_size=cfg["vocab"])
            x = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if wrap:
                opt = memtrim.OptimizerInBackward(opt, model=model, bucket_bytes=bucket_bytes)

            def step(model=model, opt=opt, x=x):
                opt.zero_grad()
                F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
                opt.step()

            report = third_step_report(step, model, opt)
            name = "memtrim.OptimizerInBackward" if wrap else "standard"
            out[label][name] = {
                "peak_bytes": report.peak_bytes, "peak_phase": report.peak_phase, "peak_module": report.peak_module,
                "peak_by_category": report.peak_by_category,
                "largest_bucket_bytes": opt.largest_bucket_bytes if wrap else None,
            }
            print(label, name, report.peak_bytes, report.peak_phase, report.peak_by_category)
    return out


def main():
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--bucket-bytes", type=int, default=1 << 20, help="bucket size for the memory runs")
    args = parser.parse_args()
    results = {}
    for label, case, steps in (
        ("seed timing case (Linear 50-50-50-1, batch 5, Adam)", seed_case, args.steps * 5),
        ("seed MLP (784-256-128-64-10, batch 64, Adam)", mlp_case, args.steps),
        ("small GPT (4 layers, d=256, seq 128, batch 8, AdamW)", gpt_case, max(2, args.steps // 10)),
    ):
        results[label] = timing(case, args.rounds, steps)
        for name, r in results[label].items():
            low, high = r["ratio_quartiles"]
            print(f"{label} | {name}: {r['step_ms_median']:.3f} ms, {r['ratio_median']:.3f}x "
                  f"(quartiles {low:.2f}-{high:.2f}, range {r['ratio_min']:.2f}-{r['ratio_max']:.2f})")
    memory = gpt_memory(args.bucket_bytes)
    path = write("optimizer_in_backward_cpu.json", {
        "machine": machine(), "commit": head_commit(), "rounds": args.rounds, "timing": results,
        "memory_bucket_bytes": args.bucket_bytes, "memory": memory,
    })
    print("wrote", path)


if __name__ == "__main__":
    main()

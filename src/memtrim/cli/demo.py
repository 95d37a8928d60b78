"""``memtrim demo``: the seed story (ReLU vs in-place ReLU) told with measured numbers, written to report/."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

import memtrim
from memtrim.data import Dataset, load_fashion_mnist, synthetic_fashion_mnist
from memtrim.models import SeedMLP

_RUNS = (("nn.ReLU()", False), ("nn.ReLU(inplace=True)", True))


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="run the built-in workload and write a report",
                       description="Measure the seed experiment (784-256-128-64-10 MLP, Fashion-MNIST, Adam) "
                       "with ReLU and in-place ReLU and write report.md, results.json and timeline plots.")
    p.add_argument("--out", default="report", help="output directory (default: report)")
    p.add_argument("--data", default=None, help="Fashion-MNIST directory (IDX .gz or Kaggle CSV) or .csv file; "
                   "default: the built-in synthetic dataset")
    p.add_argument("--epochs", type=int, default=3, help="training epochs per run (default: 3)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a few seconds: small data, one epoch, small tensors")


def run(args: argparse.Namespace) -> int:
    if args.epochs < 1 or args.batch_size < 1:
        raise memtrim.InvalidInputError("memtrim demo: --epochs and --batch-size must be >= 1.")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:
        raise memtrim.InvalidInputError(
            f"memtrim demo: cannot use device {args.device!r} ({e}). Try --device cpu."
        ) from e
    os.makedirs(args.out, exist_ok=True)
    train, test = _data(args)
    epochs = 1 if args.quick else args.epochs
    side = 2000 if args.quick else 10000
    print(f"memtrim demo: {train.source}, {len(train)} training images, {epochs} epoch(s), device {device}")

    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "memtrim": memtrim.__version__, "device": str(device)},
        "settings": {"epochs": epochs, "batch_size": args.batch_size, "seed": args.seed, "data": train.source,
                     "quick": args.quick},
    }
    results["relu_op"] = _relu_op(side, device)
    runs = {}
    for label, inplace in _RUNS:
        runs[label] = _train(label, inplace, train, test, epochs, args, device)
    results["runs"] = runs
    results["equivalence"] = _equivalence(runs, train, args, device)
    results["optimizer_in_backward"] = _optimizer_in_backward(args, device)
    results["check_inplace"] = _check_seed_silu(device)
    results["convert"] = _convert_workloads(args, device)
    results["reversible"] = _reversible(args, device, train)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(_markdown(results))
    print(f"memtrim demo: wrote {args.out}/report.md, results.json and timeline plots")
    return 0


def _data(args: argparse.Namespace) -> tuple[Dataset, Dataset | None]:
    if args.data is None:
        n_train, n_test = (2048, 512) if args.quick else (60_000, 10_000)
        return synthetic_fashion_mnist(n_train, seed=0), synthetic_fashion_mnist(n_test, seed=1)
    train = load_fashion_mnist(args.data, "train")
    test = None
    if os.path.isdir(args.data):
        try:
            test = load_fashion_mnist(args.data, "test")
        except memtrim.DataError:
            test = None
    if args.quick:
        train = train.subset(2048)
        test = test.subset(512) if test is not None else None
    return train, test


def _relu_op(side: int, device: torch.device) -> dict[str, Any]:
    x = torch.randn(side, side, device=device)
    out = {"shape": [side, side], "input_bytes": x.numel() * x.element_size()}
    for name, fn in (("torch.relu", torch.relu), ("torch.relu_", torch.relu_)):
        m = memtrim.op_memory(fn, x)
        out[name] = {"allocated_bytes": m.allocated_bytes, "peak_bytes": m.peak_bytes,
                     "allocator_allocated_bytes": m.allocator_allocated_bytes,
                     "allocator_peak_bytes": m.allocator_peak_bytes}
        del m
    return out


def _train(label: str, inplace: bool, train: Dataset, test: Dataset | None, epochs: int,
           args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from tqdm import tqdm

    torch.manual_seed(args.seed)
    model = SeedMLP(inplace=inplace).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, accuracies, seconds = [], [], []
    tracker = memtrim.track(model, optimizer)  # the first two steps (the first creates Adam's state)
    with contextlib.ExitStack() as tracking:
        for epoch in range(epochs):
            total, count = 0.0, 0
            start = time.perf_counter()
            # batches are made before the tracker sees them, so the dataset is not counted as training memory
            batches = list(train.batches(args.batch_size, seed=args.seed + epoch, device=device))
            for step, (x, y) in enumerate(tqdm(batches, desc=f"{label} epoch {epoch + 1}", leave=False)):
                if epoch == 0 and step == 0:
                    tracking.enter_context(tracker)
                loss = F.nll_loss(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.item() * len(y)
                count += len(y)
                del loss
                if epoch == 0 and step == 1:
                    tracking.close()
            seconds.append(time.perf_counter() - start)
            losses.append(total / count)
            accuracies.append(_accuracy(model, test, device) if test is not None else None)
            print(f"  {label:<24} epoch {epoch + 1}: loss {losses[-1]:.4f}"
                  + (f", test accuracy {accuracies[-1]:.3f}" if accuracies[-1] is not None else ""))
    report = tracker.report()
    slug = "relu_inplace" if inplace else "relu"
    report.plot(os.path.join(args.out, f"timeline_{slug}.png"), title=f"seed MLP, {label}: two Adam steps")
    held = _activations_at_backward_start(report)
    return {
        "inplace": inplace,
        "loss_per_epoch": losses,
        "test_accuracy_per_epoch": accuracies,
        "seconds_per_epoch": seconds,
        "memory": report.to_dict(timeline=False),
        "activations_at_backward_start": held,
        "forward_new_bytes": _forward_new_bytes(report),
        "timeline_png": f"timeline_{slug}.png",
        "final_parameters": {n: p.detach().cpu() for n, p in model.named_parameters()},
    }


def _activations_at_backward_start(report: memtrim.MemoryReport) -> int:
    for i, event in enumerate(report.timeline):
        if event.phase == "backward":
            return report.timeline[i - 1].by_category["activations"]
    return 0


def _forward_new_bytes(report: memtrim.MemoryReport) -> int:
    """Peak of storages born in the first forward (activations + temporaries), the forward's transient."""
    best = 0
    for event in report.timeline:
        if event.phase == "backward":
            break
        best = max(best, event.by_category["activations"] + event.by_category["temporaries"])
    return best


@torch.no_grad()
def _accuracy(model: torch.nn.Module, data: Dataset, device: torch.device) -> float:
    model.eval()
    correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in data.batches(1024, shuffle=False, device=device))
    model.train()
    return correct / len(data)


def _equivalence(runs: dict[str, Any], train: Dataset, args: argparse.Namespace, device: torch.device) -> dict:
    a, b = (runs[label] for label, _ in _RUNS)
    params_equal = all(torch.equal(a["final_parameters"][n], b["final_parameters"][n]) for n in a["final_parameters"])
    for run in runs.values():
        del run["final_parameters"]
    batches = list(train.subset(20 * args.batch_size).batches(args.batch_size, seed=args.seed, device=device))

    def to_inplace(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        for module in model.modules():
            if isinstance(module, torch.nn.ReLU):
                module.inplace = True
        return model, optimizer

    report = memtrim.verify(lambda: SeedMLP().to(device), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                            batches, F.nll_loss, to_inplace, seed=args.seed)
    return {"losses_equal": a["loss_per_epoch"] == b["loss_per_epoch"],
            "final_parameters_bitwise_equal": params_equal,
            "verify": str(report), "verify_ok": report.ok, "verify_bitwise": report.bitwise,
            "verify_steps": report.steps}


def _seed_net() -> torch.nn.Module:
    """The seed notebook's timing network: Linear 50-50-50-1."""
    return torch.nn.Sequential(torch.nn.Linear(50, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(),
                               torch.nn.Linear(50, 1))


def _optimizer_in_backward(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The seed's "optimizer step inside backward" check: equality, timing, and the memory it really saves."""
    steps = 200 if args.quick else 2000
    gen = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randn(5, 50, generator=gen).to(device), torch.randn(5, 1, generator=gen).to(device))
               for _ in range(50)]

    def fused(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        return model, memtrim.OptimizerInBackward(optimizer, model=model)

    def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(model.parameters(), lr=1e-3)

    # gradients are freed inside backward by design: verify sees the OptimizerInBackward and compares the
    # parameters and optimizer state after every step instead (its report says so)
    report = memtrim.verify(lambda: _seed_net().to(device), adam, batches, F.mse_loss, fused, seed=args.seed)

    def per_parameter(model: torch.nn.Module) -> Any:
        """The seed's recipe: one Adam per parameter, stepped from a post-accumulate-grad hook."""
        optimizers = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}
        def step_one(param: torch.Tensor) -> None:
            optimizers[param].step()
            optimizers[param].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step_one)
        return None

    runners = {}
    for name in ("standard Adam", "memtrim.OptimizerInBackward", "one Adam per parameter (seed recipe)"):
        torch.manual_seed(args.seed)
        model = _seed_net().to(device)
        if name == "standard Adam":
            opt: Any = adam(model)
        elif name == "memtrim.OptimizerInBackward":
            opt = memtrim.OptimizerInBackward(adam(model), model=model)
        else:
            opt = per_parameter(model)
        runners[name] = (model, opt)
    seconds = {name: 0.0 for name in runners}
    for _ in range(5):  # interleaved rounds: all three see the same machine noise
        for name, (model, opt) in runners.items():
            start = time.perf_counter()
            for i in range(steps // 5):
                x, y = batches[i % len(batches)]
                if opt is not None:
                    opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                if opt is not None:
                    opt.step()
            seconds[name] += time.perf_counter() - start
    base = seconds["standard Adam"]
    timing = {name: {"seconds": s, "ratio": s / base} for name, s in seconds.items()}

    memory = {}
    for wrap in (False, True):
        torch.manual_seed(args.seed)
        model = SeedMLP().to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        if wrap:
            opt = memtrim.OptimizerInBackward(opt, model=model, bucket_bytes=0)
        x = torch.randn(64, 784, device=device)
        y = torch.randint(0, 10, (64,), device=device)
        for _ in range(2):
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
        with memtrim.track(model, opt) as tracker:
            opt.zero_grad()
            F.nll_loss(model(x), y).backward()
            opt.step()
        r = tracker.report()
        memory["in backward" if wrap else "standard"] = {
            "peak_bytes": r.peak_bytes, "peak_phase": r.peak_phase, "peak_gradients": r.peak_by_category["gradients"],
            "largest_bucket_bytes": opt.largest_bucket_bytes if wrap else None,
        }
    print(f"  optimizer in backward: {report}; time relative to standard Adam: "
          + ", ".join(f"{n} {t['ratio']:.2f}x" for n, t in timing.items()))
    return {"verify": str(report), "verify_bitwise": report.bitwise, "verify_steps": report.steps, "steps_timed": steps,
            "timing": timing, "memory": memory}


def silu_inplace_1(input: torch.Tensor) -> torch.Tensor:
    """The seed article's first in-place SiLU."""
    return input * torch.sigmoid_(input)


def silu_inplace_2(input: torch.Tensor) -> torch.Tensor:
    """The seed article's second in-place SiLU, quoted exactly: right values, but backward raises (sigmoid_ keeps
    its output for backward and ``*=`` overwrites it)."""
    result = input.clone()
    torch.sigmoid_(input)
    input *= result
    return input


def silu_inplace_2_corrected(input: torch.Tensor) -> torch.Tensor:
    """The seed's second SiLU corrected: ``sigmoid_`` on the copy, whose output nothing overwrites."""
    result = input.clone()
    torch.sigmoid_(result)
    input *= result
    return input


def _check_seed_silu(device: torch.device) -> dict[str, Any]:
    """Check twice, by machine: the seed's two in-place SiLUs (and the second corrected), and ReLU kept as a 1-bit
    mask."""
    example = torch.randn(64, 128, device=device)
    out = {}
    for name, fn, reference in (
        ("silu_inplace_1", silu_inplace_1, F.silu),
        ("silu_inplace_2", silu_inplace_2, F.silu),
        ("silu_inplace_2, corrected", silu_inplace_2_corrected, F.silu),
        ("torch.relu_", torch.relu_, torch.relu),
        ("memtrim.functional.relu(save='mask')", lambda x: memtrim.functional.relu(x, save="mask"), torch.relu),
    ):
        result = memtrim.check_inplace(fn, reference, example)
        out[name] = {"ok": result.ok, "problems": result.problems[:3], "verdict": result.verdict,
                     "activation_bytes": result.activation_bytes,
                     "reference_activation_bytes": result.reference_activation_bytes,
                     "peak_bytes": result.peak_bytes, "reference_peak_bytes": result.reference_peak_bytes}
        print(f"  check_inplace {name}: {'ok' if result.ok else 'FAILS'}; {result.verdict}")
    return out


def _convert_workloads(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """memtrim.convert on the MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN and the small GPT."""
    from memtrim.models import ConvBNActCNN, ResNetCNN, SmallGPT

    def leaky_cnn() -> torch.nn.Module:
        return ConvBNActCNN(in_channels=1, width=16, depth=4, num_classes=None)

    d = 64 if args.quick else 256
    workloads = {
        "seed MLP": (SeedMLP, torch.randn(64, 784)),
        "ResNet-style CNN (BN+ReLU)": (ResNetCNN, torch.randn(16, 1, 28, 28)),
        "conv+BN+LeakyReLU CNN": (leaky_cnn, torch.randn(16, 1, 28, 28)),
        f"small GPT (4 layers, d={d})": (lambda: SmallGPT(n_layer=4, d_model=d, n_head=4, seq_len=64),
                                         torch.randint(0, 256, (8, 64))),
    }
    out = {}
    for name, (make, x) in workloads.items():
        torch.manual_seed(args.seed)
        model, report = memtrim.convert(make().to(device), example_inputs=(x.to(device),))
        out[name] = {"before": report.activation_bytes_before, "after": report.activation_bytes_after,
                     "changes": [f"{' + '.join(c.modules)}: {c.before} -> {c.after} ({c.bytes_saved:,} B)"
                                 for c in report.changes],
                     "skipped": sorted({s.reason for s in report.skipped})}
        share = 1 - report.activation_bytes_after / report.activation_bytes_before
        print(f"  convert {name}: activations {report.activation_bytes_before:,} -> "
              f"{report.activation_bytes_after:,} B ({share:.0%} fewer)")
    return out


class _CouplingMLP(torch.nn.Module):
    """The seed MLP's shape with its hidden layers as `depth` additive couplings on width 256."""

    def __init__(self, depth: int, reversible: bool, exact: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks = [memtrim.AdditiveCoupling(torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.ReLU()))
                  for _ in range(depth)]
        self.inp = torch.nn.Linear(784, 256)
        self.hidden = (memtrim.ReversibleSequential(*blocks, exact=exact, check_drift=1e-3) if reversible
                       else torch.nn.Sequential(*blocks))
        self.out = torch.nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.out(self.hidden(torch.relu(self.inp(x.reshape(x.shape[0], -1))))), dim=1)


def _reversible(args: argparse.Namespace, device: torch.device, train: Dataset) -> dict[str, Any]:
    """The seed MLP's hidden layers as a reversible stack: equal training, memory vs depth, drift."""
    batches = list(train.subset(10 * args.batch_size).batches(args.batch_size, seed=args.seed, device=device))

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        # SGD, not Adam: Adam's first update is lr * sign(g), so rounding-level gradient differences on entries
        # whose gradient is ~0 flip whole updates; SGD's update is linear in the gradient and shows the real error
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    depth = 8
    report = memtrim.verify(lambda: _CouplingMLP(depth, False).to(device), sgd, batches, F.nll_loss,
                            lambda m, o: (_swap_to_reversible(m), o), seed=args.seed, rtol=1e-4, atol=1e-6)
    x, _ = batches[0]
    curve: dict[str, list[int]] = {"plain": [], "reversible": []}
    depths = [1, 2, 4, 8, 16, 32] if not args.quick else [1, 4, 16]
    for d in depths:
        for name in curve:
            model = _CouplingMLP(d, name == "reversible").to(device)
            with memtrim.track(model) as tracker:
                out = model(x)
                curve[name].append(tracker.live_by_category()["activations"])
            del out
    drift = {}
    for d in (8, 64):
        for exact in (False, True):
            model = _CouplingMLP(d, True, exact=exact).to(device)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the drift report below says what the warnings would
                F.nll_loss(model(x), batches[0][1]).backward()
            values = model.hidden.drift_report().values()
            drift[f"{'exact' if exact else 'float32'}, depth {d}"] = max(values)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name, values in curve.items():
            ax.plot(depths, values, marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("coupling blocks in the hidden stack")
        ax.set_ylabel("activation bytes kept after forward")
        ax.set_title("seed MLP with coupling hidden layers (memtrim tracker)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "reversible_memory_vs_depth.png"), dpi=110)
        plt.close(fig)
    except ImportError:
        pass
    print(f"  reversible: {report}; activations at depth {depths[-1]}: plain {curve['plain'][-1]:,} B, "
          f"reversible {curve['reversible'][-1]:,} B")
    return {"verify": str(report), "verify_ok": report.ok, "depths": depths, "curve": curve, "drift": drift,
            "depth": depth}


def _swap_to_reversible(model: torch.nn.Module) -> torch.nn.Module:
    model.hidden = memtrim.ReversibleSequential(*model.hidden)  # the same blocks, the same parameters
    return model


def _markdown(results: dict[str, Any]) -> str:
    fb = memtrim.format_bytes
    m, s, relu = results["machine"], results["settings"], results["relu_op"]
    lines = [
        "# memtrim demo report", "",
        f"Machine: {m['platform']} ({m['processor']}), torch {m['torch']}, memtrim {m['memtrim']}, "
        f"device {m['device']}. Data: {s['data']}; {s['epochs']} epoch(s), batch {s['batch_size']}, seed {s['seed']}.",
        "Every byte below was measured by memtrim's tracker (`memtrim.track`, `memtrim.op_memory`).", "",
        f"## 1. ReLU vs in-place ReLU on one {relu['shape'][0]}x{relu['shape'][1]} float32 tensor "
        f"({fb(relu['input_bytes'])})", "",
        "| op | allocated | peak during the call |", "|---|---:|---:|",
    ]
    for name in ("torch.relu", "torch.relu_"):
        r = relu[name]
        lines.append(f"| `{name}` | {r['allocated_bytes']:,} B | {r['peak_bytes']:,} B |")
    lines += ["", "The out-of-place op allocates a second tensor of the same size; the in-place op allocates "
              "nothing. That is all in-place saves *on a lone op*. Inside a model, see below.", "",
              "## 2. The seed MLP (784-256-128-64-10, Adam) with `nn.ReLU()` and `nn.ReLU(inplace=True)`", "",
              "Memory of the first two training steps (the first creates Adam's state), by category at the peak:", "",
              "| run | peak | phase of peak | module | op | parameters | gradients | optimizer state | activations "
              "| temporaries | inputs | activations kept at backward start | forward's transient peak |",
              "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, run in results["runs"].items():
        mem = run["memory"]
        c = mem["peak_by_category"]
        lines.append(
            f"| `{label}` | {mem['peak_bytes']:,} B | {mem['peak_phase']} | {mem['peak_module'] or '-'} "
            f"| {mem['peak_op'] or '-'} | {c['parameters']:,} | {c['gradients']:,} | {c['optimizer_state']:,} "
            f"| {c['activations']:,} | {c['temporaries']:,} | {c['inputs']:,} "
            f"| {run['activations_at_backward_start']:,} B | {run['forward_new_bytes']:,} B |"
        )
    a, b = (results["runs"][label] for label, _ in _RUNS)
    diff_act = a["activations_at_backward_start"] - b["activations_at_backward_start"]
    diff_fwd = a["forward_new_bytes"] - b["forward_new_bytes"]
    diff_peak = a["memory"]["peak_bytes"] - b["memory"]["peak_bytes"]
    lines += ["", f"In-place ReLU changes the activations autograd keeps by **{diff_act:,} bytes**, the forward's "
              f"transient peak by {diff_fwd:,} bytes and the step's peak by {diff_peak:,} bytes. ReLU keeps its "
              "output for backward, and the next Linear keeps that same tensor, so doing the ReLU in place "
              "removes only a short-lived buffer during the forward.", "",
              "Timelines: " + ", ".join(f"![{label}]({run['timeline_png']})" for label, run in results["runs"].items()),
              "", "Training (same seed, same batches):", "",
              "| run | loss per epoch | test accuracy per epoch | seconds per epoch |", "|---|---|---|---|"]
    for label, run in results["runs"].items():
        acc = ", ".join("-" if v is None else f"{v:.3f}" for v in run["test_accuracy_per_epoch"])
        lines.append(f"| `{label}` | {', '.join(f'{v:.4f}' for v in run['loss_per_epoch'])} | {acc} | "
                     f"{', '.join(f'{v:.2f}' for v in run['seconds_per_epoch'])} |")
    eq = results["equivalence"]
    lines += ["", "## 3. Do the two runs stay equal?", "",
              f"- Loss per epoch identical: **{eq['losses_equal']}**; final parameters bitwise equal: "
              f"**{eq['final_parameters_bitwise_equal']}**.",
              f"- `memtrim.verify` (loss, every gradient and parameter after each of {eq['verify_steps']} steps): "
              f"**{eq['verify']}**.", ""]
    oib = results["optimizer_in_backward"]
    mem = oib["memory"]
    lines += ["## 4. The optimizer step inside backward", "",
              "The seed steps each parameter's own Adam from a post-accumulate-grad hook, checks the parameters "
              "stay equal to standard Adam, and finds it 1.95x slower. `memtrim.OptimizerInBackward` wraps one "
              "ordinary Adam and steps it bucket by bucket inside backward.", "",
              f"- Equality with standard Adam on the seed's Linear 50-50-50-1 network, batch 5 (`memtrim.verify`, "
              f"parameters and optimizer state after each of {oib['verify_steps']} steps): **{oib['verify']}**.", "",
              f"| method ({oib['steps_timed']} training steps, interleaved rounds) | seconds | vs standard Adam |",
              "|---|---:|---:|"]
    for name, t in oib["timing"].items():
        lines.append(f"| {name} | {t['seconds']:.2f} | {t['ratio']:.2f}x |")
    saved = mem["standard"]["peak_bytes"] - mem["in backward"]["peak_bytes"]
    lines += ["", f"Memory on the seed MLP (batch 64, Adam, one parameter per bucket): the standard step peaks at "
              f"{mem['standard']['peak_bytes']:,} B in the {mem['standard']['peak_phase']} phase with "
              f"{mem['standard']['peak_gradients']:,} B of gradients alive; stepping in backward peaks at "
              f"{mem['in backward']['peak_bytes']:,} B ({mem['in backward']['peak_phase']}) with "
              f"{mem['in backward']['peak_gradients']:,} B of gradients alive: **{saved:,} B saved**. At most one "
              "bucket's gradients are alive (here the largest, fc1.weight, "
              f"{mem['in backward']['largest_bucket_bytes']:,} B), so the saving grows with the number of "
              "parameters.", ""]
    lines += ["## 5. Check twice: in-place code against an out-of-place reference", "",
              "`memtrim.check_inplace(fn, reference, example)` on a 64x128 float32 input (values, gradients, what is "
              "written in place, the output of an earlier op that keeps it for backward, and memory):", "",
              "| function | reference | result | kept for backward | peak of new storages | verdict |",
              "|---|---|---|---:|---:|---|"]
    for name, r in results["check_inplace"].items():
        ref = "torch.relu" if "relu" in name else "F.silu"
        status = "ok" if r["ok"] else "**fails**: " + r["problems"][0].split(": ", 1)[1].split(" (torch: ")[0]
        lines.append(f"| `{name}` | `{ref}` | {status} | {r['activation_bytes']:,} B "
                     f"(reference {r['reference_activation_bytes']:,}) | {r['peak_bytes']:,} B "
                     f"(reference {r['reference_peak_bytes']:,}) | {r['verdict']} |")
    seed_2 = results["check_inplace"]["silu_inplace_2"]
    corrected = results["check_inplace"]["silu_inplace_2, corrected"]
    lines += ["", "The seed's first SiLU returns sigmoid(x)^2 and overwrites its caller's tensor; gradcheck alone "
              "passes it.", "",
              "The seed's second SiLU, quoted exactly (`result = input.clone(); torch.sigmoid_(input); "
              "input *= result; return input`), computes the right values, but training with it fails: "
              + ("the checker reports: " + seed_2["problems"][0].split(": ", 1)[1] if not seed_2["ok"] else
                 "the checker found no problem (unexpected on this torch version).")
              + " Applying `sigmoid_` to the copy instead (`silu_inplace_2, corrected`) "
              + ("passes" if corrected["ok"] else "does not pass")
              + f", but keeps {corrected['activation_bytes']:,} B for backward where `F.silu` keeps "
              f"{corrected['reference_activation_bytes']:,} B: in place saves nothing here.", "",
              "In-place ReLU saves only a transient buffer; keeping a 1-bit mask instead of the output is what saves "
              "activation memory when nothing else keeps the output.", ""]
    lines += ["## 6. `memtrim.convert`: keep less, where provably the same function", "",
              "Activation bytes autograd keeps after a forward, measured by the tracker on the example batch:", "",
              "| model | before | after | fewer | changes | why the rest was left alone |",
              "|---|---:|---:|---:|---|---|"]
    for name, r in results["convert"].items():
        share = 1 - r["after"] / r["before"] if r["before"] else 0.0
        changes = "<br>".join(r["changes"]) or "none"
        lines.append(f"| {name} | {r['before']:,} B | {r['after']:,} B | {share:.0%} | {changes} | "
                     f"{'<br>'.join(r['skipped']) or '-'} |")
    lines += ["", "Training after `convert` is checked against the original with `memtrim.verify` in the test suite "
              "(bitwise where only activation+Linear pairs change; within 1e-9 in float64 where a norm is inverted).",
              ""]
    rev = results["reversible"]
    lines += ["## 7. Reversible hidden layers", "",
              "The seed MLP's shape with its hidden layers as additive couplings (f, g = Linear(128)+ReLU on width "
              "256), plain and as a `memtrim.ReversibleSequential`:", "",
              f"- Training equality over 10 SGD steps at depth {rev['depth']} (`memtrim.verify`, float32; the inputs "
              f"are rebuilt by subtraction, so within rtol 1e-4): **{rev['verify']}**.",
              "", "| coupling blocks | " + " | ".join(str(d) for d in rev["depths"]) + " |",
              "|---|" + "---:|" * len(rev["depths"])]
    for name, values in rev["curve"].items():
        lines.append(f"| activations kept, {name} | " + " | ".join(f"{v:,} B" for v in values) + " |")
    drift = rev["drift"]
    lines += ["", "![memory vs depth](reversible_memory_vs_depth.png)", "",
              "Drift report (`check_drift`): the largest relative error of a rebuilt block input, per stack:", "",
              "| stack | largest relative reconstruction error |", "|---|---:|"]
    lines += [f"| {name} | {value:.2e} |" for name, value in drift.items()]
    lines += ["", "Without normalisation inside f and g the residual stream grows block after block; rebuilding an "
              "input by subtraction then loses its low bits, and at depth 64 in float32 the rebuilt inputs are "
              "useless. `check_drift` finds such blocks and keeps their inputs from the next step on; exact mode "
              "carries the stream in fixed point and rebuilds every input bit for bit.", ""]
    return "\n".join(lines)

"""``memtrim demo``: the seed story (ReLU vs in-place ReLU) told with measured numbers, written to report/.

Orchestration only: each section runs library calls and returns a typed record (``_demo_results``); report.md is
rendered from those records (``_demo_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F

import memtrim
from memtrim.data import Dataset, load_fashion_mnist, synthetic_fashion_mnist
from memtrim.measure import plot_curves, pyplot
from memtrim.models import ConvBNActCNN, CouplingMLP, ResNetCNN, SeedMLP, SmallGPT
from memtrim.models.seed_silu import silu_inplace_1, silu_inplace_2, silu_inplace_2_corrected

from ._demo_report import REVERSIBLE_PLOT, markdown
from ._demo_results import (
    Converted,
    DemoResults,
    Equivalence,
    InBackward,
    InplaceResult,
    Machine,
    OpBytes,
    Planned,
    ReluOp,
    Reversible,
    Settings,
    StepMemory,
    Timing,
    TrainingRun,
    to_json,
)

__all__ = ["add_parser", "run", "silu_inplace_1", "silu_inplace_2", "silu_inplace_2_corrected"]

_RUNS = (("nn.ReLU()", False), ("nn.ReLU(inplace=True)", True))


def add_parser(sub: Any) -> None:
    """Add the ``demo`` subcommand and its options to ``sub`` (argparse's subparsers)."""
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
    """Run the demo with the parsed ``args`` and write report.md, results.json and the plots to ``args.out``."""
    device = _check_arguments(args)
    pyplot("memtrim demo")  # its report's plots: said before training (it failed after the first run's training)
    train, test = _data(args)  # a wrong --data before --out is made (an empty report folder was left behind)
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as e:  # a file of that name, a folder that cannot be made: the usage error, not a traceback
        raise memtrim.InvalidInputError(
            f"memtrim demo: cannot write the report to --out {args.out!r} ({e.strerror or e}). Give a folder that "
            "exists or can be created."
        ) from e
    epochs = 1 if args.quick else args.epochs
    print(f"memtrim demo: {train.source}, {len(train)} training images, {epochs} epoch(s), device {device}")
    machine = Machine(platform=platform.platform(), processor=platform.processor() or platform.machine(),
                      torch=torch.__version__, memtrim=memtrim.__version__, device=str(device))
    settings = Settings(epochs=epochs, batch_size=args.batch_size, seed=args.seed, data=train.source, quick=args.quick)
    relu_op = _relu_op(2000 if args.quick else 10000, device)
    trained = {label: _train(label, inplace, train, test, epochs, args, device) for label, inplace in _RUNS}
    results = DemoResults(
        machine=machine, settings=settings, relu_op=relu_op,
        runs={label: run for label, (run, _) in trained.items()},
        equivalence=_equivalence(trained, train, args, device),
        optimizer_in_backward=_optimizer_in_backward(args, device),
        check_inplace=_check_seed_silu(device),
        convert=_convert_workloads(args, device),
        reversible=_reversible(args, device, train),
        plan=_plan(args, device),
    )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(to_json(results), f, indent=1)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(markdown(results))
    print(f"memtrim demo: wrote {args.out}/report.md, results.json and timeline plots")
    return 0


def _steps(n: int, optimizer: str) -> str:
    return f"{'one' if n == 1 else 'two' if n == 2 else n} {optimizer} step{'' if n == 1 else 's'}"


def _check_arguments(args: argparse.Namespace) -> torch.device:
    if args.epochs < 1 or args.batch_size < 1:
        raise memtrim.InvalidInputError("memtrim demo: --epochs and --batch-size must be >= 1.")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
        if device.type == "meta":  # no values: training cannot read a loss (it failed with a traceback at .item())
            raise RuntimeError("the demo trains and reads values; meta tensors have none")
    except (RuntimeError, AssertionError) as e:
        raise memtrim.InvalidInputError(
            f"memtrim demo: cannot use device {args.device!r} ({e}). Try --device cpu."
        ) from e
    return device


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


def _relu_op(side: int, device: torch.device) -> ReluOp:
    x = torch.randn(side, side, device=device)
    ops = {}
    for name, fn in (("torch.relu", torch.relu), ("torch.relu_", torch.relu_)):
        m = memtrim.op_memory(fn, x)
        ops[name] = OpBytes(allocated_bytes=m.allocated_bytes, peak_bytes=m.peak_bytes,
                            allocator_allocated_bytes=m.allocator_allocated_bytes,
                            allocator_peak_bytes=m.allocator_peak_bytes)
        del m
    return ReluOp(shape=[side, side], input_bytes=x.numel() * x.element_size(), ops=ops)


def _progress(batches: list, desc: str) -> Iterable:
    """A progress bar where tqdm is installed (the ``demo`` extra), else the batches as they are."""
    try:
        from tqdm import tqdm
    except ImportError:
        return batches
    return tqdm(batches, desc=desc, leave=False)


def _train(label: str, inplace: bool, train: Dataset, test: Dataset | None, epochs: int,
           args: argparse.Namespace, device: torch.device) -> tuple[TrainingRun, dict[str, torch.Tensor]]:
    """Train the seed MLP; the tracker sees the first two steps (the first creates Adam's state). Returns the run
    and its final parameters."""
    torch.manual_seed(args.seed)
    model = SeedMLP(inplace=inplace).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, accuracies, seconds = [], [], []
    tracker = memtrim.track(model, optimizer)
    tracked = 0
    with contextlib.ExitStack() as tracking:
        for epoch in range(epochs):
            total, count = 0.0, 0
            start = time.perf_counter()
            # batches are made before the tracker sees them, so the dataset is not counted as training memory
            batches = list(train.batches(args.batch_size, seed=args.seed + epoch, device=device))
            for step, (x, y) in enumerate(_progress(batches, f"{label} epoch {epoch + 1}")):
                if epoch == 0 and step == 0:
                    tracking.enter_context(tracker)
                if epoch == 0 and step < 2:
                    tracked += 1
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
    png = f"timeline_{'relu_inplace' if inplace else 'relu'}.png"
    report.plot(os.path.join(args.out, png), title=f"seed MLP, {label}: {_steps(tracked, 'Adam')}")
    run = TrainingRun(label=label, inplace=inplace, loss_per_epoch=losses, test_accuracy_per_epoch=accuracies,
                      seconds_per_epoch=seconds, memory=report.to_dict(timeline=False),
                      activations_at_backward_start=report.activations_at_backward_start,
                      forward_new_bytes=report.forward_transient_peak, timeline_png=png, tracked_steps=tracked)
    return run, {n: p.detach().cpu() for n, p in model.named_parameters()}


@torch.no_grad()
def _accuracy(model: torch.nn.Module, data: Dataset, device: torch.device) -> float:
    model.eval()
    correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in data.batches(1024, shuffle=False, device=device))
    model.train()
    return correct / len(data)


def _equivalence(trained: dict[str, tuple[TrainingRun, dict[str, torch.Tensor]]], train: Dataset,
                 args: argparse.Namespace, device: torch.device) -> Equivalence:
    (a, params_a), (b, params_b) = trained.values()
    batches = list(train.subset(20 * args.batch_size).batches(args.batch_size, seed=args.seed, device=device))

    def to_inplace(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        for module in model.modules():
            if isinstance(module, torch.nn.ReLU):
                module.inplace = True
        return model, optimizer

    report = memtrim.verify(lambda: SeedMLP().to(device), lambda m: torch.optim.Adam(m.parameters(), lr=1e-3),
                            batches, F.nll_loss, to_inplace, seed=args.seed)
    return Equivalence(losses_equal=a.loss_per_epoch == b.loss_per_epoch,
                       final_parameters_bitwise_equal=all(torch.equal(params_a[n], params_b[n]) for n in params_a),
                       verify=str(report), verify_ok=report.ok, verify_bitwise=report.bitwise,
                       verify_steps=report.steps)


def _seed_net() -> torch.nn.Module:
    """The seed notebook's timing network: Linear 50-50-50-1."""
    return torch.nn.Sequential(torch.nn.Linear(50, 50), torch.nn.ReLU(), torch.nn.Linear(50, 50), torch.nn.ReLU(),
                               torch.nn.Linear(50, 1))


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-3)


def _optimizer_in_backward(args: argparse.Namespace, device: torch.device) -> InBackward:
    """The seed's "optimizer step inside backward" check: equality, timing, and the memory it really saves."""
    steps = 200 if args.quick else 2000
    gen = torch.Generator().manual_seed(args.seed)
    batches = [(torch.randn(5, 50, generator=gen).to(device), torch.randn(5, 1, generator=gen).to(device))
               for _ in range(50)]

    def fused(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
        return model, memtrim.OptimizerInBackward(optimizer, model=model)

    # gradients are freed inside backward by design: verify sees the OptimizerInBackward and compares the
    # parameters and optimizer state after every step instead (its report says so)
    report = memtrim.verify(lambda: _seed_net().to(device), _adam, batches, F.mse_loss, fused, seed=args.seed)
    timing = _in_backward_timing(batches, steps, args.seed, device)
    memory = {name: _in_backward_memory(wrap, args.seed, device)
              for name, wrap in (("standard", False), ("in backward", True))}
    print(f"  optimizer in backward: {report}; time relative to standard Adam: "
          + ", ".join(f"{n} {t.ratio:.2f}x" for n, t in timing.items()))
    return InBackward(verify=str(report), verify_bitwise=report.bitwise, verify_steps=report.steps,
                      steps_timed=steps, timing=timing, memory=memory)


def _per_parameter_adam(model: torch.nn.Module) -> None:
    """The seed's recipe: one Adam per parameter, stepped from a post-accumulate-grad hook."""
    optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {p: torch.optim.Adam([p], lr=1e-3)
                                                             for p in model.parameters()}

    def step_one(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_one)


def _in_backward_timing(batches: list, steps: int, seed: int, device: torch.device) -> dict[str, Timing]:
    """Seconds of ``steps`` training steps of the seed's network per method, in interleaved rounds (all three
    see the same machine noise)."""
    runners: dict[str, tuple[torch.nn.Module, Any]] = {}
    for name in ("standard Adam", "memtrim.OptimizerInBackward", "one Adam per parameter (seed recipe)"):
        torch.manual_seed(seed)
        model = _seed_net().to(device)
        if name == "standard Adam":
            runners[name] = (model, _adam(model))
        elif name == "memtrim.OptimizerInBackward":
            runners[name] = (model, memtrim.OptimizerInBackward(_adam(model), model=model))
        else:
            _per_parameter_adam(model)
            runners[name] = (model, None)
    seconds = {name: 0.0 for name in runners}
    for _ in range(5):
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
    return {name: Timing(seconds=s, ratio=s / base) for name, s in seconds.items()}


def _in_backward_memory(wrap: bool, seed: int, device: torch.device) -> StepMemory:
    """The third Adam step of the seed MLP (batch 64), tracked; ``wrap``: stepped inside backward, one parameter
    per bucket."""
    torch.manual_seed(seed)
    model = SeedMLP().to(device)
    opt: Any = torch.optim.Adam(model.parameters(), lr=1e-3)
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
    return StepMemory(peak_bytes=r.peak_bytes, peak_phase=r.peak_phase, peak_gradients=r.peak_by_category["gradients"],
                      largest_bucket_bytes=opt.largest_bucket_bytes if wrap else None)


def _check_seed_silu(device: torch.device) -> dict[str, InplaceResult]:
    """Check twice, by machine: the seed's two in-place SiLUs (and the second corrected), and ReLU kept as a 1-bit
    mask."""
    example = torch.randn(64, 128, device=device)
    out = {}
    for name, fn, reference, reference_name in (
        ("silu_inplace_1", silu_inplace_1, F.silu, "F.silu"),
        ("silu_inplace_2", silu_inplace_2, F.silu, "F.silu"),
        ("silu_inplace_2, corrected", silu_inplace_2_corrected, F.silu, "F.silu"),
        ("torch.relu_", torch.relu_, torch.relu, "torch.relu"),
        ("memtrim.functional.relu(save='mask')", lambda x: memtrim.functional.relu(x, save="mask"), torch.relu,
         "torch.relu"),
    ):
        result = memtrim.check_inplace(fn, reference, example)
        out[name] = InplaceResult(reference=reference_name, ok=result.ok, problems=result.problems[:3],
                                  verdict=result.verdict, activation_bytes=result.activation_bytes,
                                  reference_activation_bytes=result.reference_activation_bytes,
                                  peak_bytes=result.peak_bytes, reference_peak_bytes=result.reference_peak_bytes)
        print(f"  check_inplace {name}: {'ok' if result.ok else 'FAILS'}; {result.verdict}")
    return out


def _convert_workloads(args: argparse.Namespace, device: torch.device) -> dict[str, Converted]:
    """memtrim.convert on the MLP, a ResNet-style CNN, a conv+BN+LeakyReLU CNN and the small GPT."""
    def leaky_cnn() -> torch.nn.Module:
        return ConvBNActCNN(in_channels=1, width=16, depth=4, num_classes=None)

    d = 64 if args.quick else 256
    workloads: dict[str, tuple[Callable[[], torch.nn.Module], torch.Tensor]] = {
        "seed MLP": (SeedMLP, torch.randn(64, 784)),
        "ResNet-style CNN (BN+ReLU)": (ResNetCNN, torch.randn(16, 1, 28, 28)),
        "conv+BN+LeakyReLU CNN": (leaky_cnn, torch.randn(16, 1, 28, 28)),
        f"small GPT (4 layers, d={d})": (lambda: SmallGPT(n_layer=4, d_model=d, n_head=4, seq_len=64),
                                         torch.randint(0, 256, (8, 64))),
    }
    out = {}
    for name, (make, x) in workloads.items():
        torch.manual_seed(args.seed)
        _, report = memtrim.convert(make().to(device), example_inputs=(x.to(device),))
        before, after = report.activation_bytes_before, report.activation_bytes_after
        assert before is not None and after is not None  # measured: example inputs were given
        out[name] = Converted(before=before, after=after,
                              changes=[f"{' + '.join(c.modules)}: {c.before} -> {c.after} ({c.bytes_saved:,} B)"
                                       for c in report.changes],
                              skipped=sorted({s.reason for s in report.skipped}))
        print(f"  convert {name}: activations {before:,} -> {after:,} B ({1 - after / before:.0%} fewer)")
    return out


def _reversible(args: argparse.Namespace, device: torch.device, train: Dataset) -> Reversible:
    """The seed MLP's hidden layers as a reversible stack: equal training, memory vs depth, drift."""
    batches = list(train.subset(10 * args.batch_size).batches(args.batch_size, seed=args.seed, device=device))

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        # SGD, not Adam: Adam's first update is lr * sign(g), so rounding-level gradient differences on entries
        # whose gradient is ~0 flip whole updates; SGD's update is linear in the gradient and shows the real error
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    depth = 8
    report = memtrim.verify(lambda: CouplingMLP(depth).to(device), sgd, batches, F.nll_loss,
                            lambda m, o: (_swap_to_reversible(m), o), seed=args.seed, rtol=1e-4, atol=1e-6)
    x, y = batches[0]
    depths = [1, 2, 4, 8, 16, 32] if not args.quick else [1, 4, 16]
    curve = {name: [_activations_kept(CouplingMLP(d, reversible=name == "reversible").to(device), x) for d in depths]
             for name in ("plain", "reversible")}
    drift = {f"{'exact' if exact else 'float32'}, depth {d}": _largest_drift(d, exact, x, y, device)
             for d in (8, 64) for exact in (False, True)}
    plot_curves(os.path.join(args.out, REVERSIBLE_PLOT), depths, curve,  # (matplotlib: checked before training)
                xlabel="coupling blocks in the hidden stack", ylabel="activation bytes kept after forward",
                title="seed MLP with coupling hidden layers (memtrim tracker)", figsize=(6, 3.5))
    print(f"  reversible: {report}; activations at depth {depths[-1]}: plain {curve['plain'][-1]:,} B, "
          f"reversible {curve['reversible'][-1]:,} B")
    return Reversible(verify=str(report), verify_ok=report.ok, depths=depths, curve=curve, drift=drift, depth=depth,
                      steps=len(batches))


def _activations_kept(model: torch.nn.Module, x: torch.Tensor) -> int:
    with memtrim.track(model) as tracker:
        out = model(x)
        kept = tracker.live_by_category()["activations"]
    del out
    return kept


def _largest_drift(depth: int, exact: bool, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> float:
    model = CouplingMLP(depth, reversible=True, exact=exact).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the drift report says what the warnings would
        F.nll_loss(model(x), y).backward()
    stack = model.hidden
    assert isinstance(stack, memtrim.ReversibleSequential)
    return max(stack.drift_report().values())


def _swap_to_reversible(model: torch.nn.Module) -> torch.nn.Module:
    blocks = model.get_submodule("hidden")
    model.hidden = memtrim.ReversibleSequential(*blocks.children())  # the same blocks and parameters
    return model


def _plan(args: argparse.Namespace, device: torch.device) -> Planned:
    """memtrim.plan on the small GPT for 80 % of its plain peak; the chosen plan then measured for real."""
    d = 64 if args.quick else 256
    workload = f"small GPT (4 layers, d={d}, seq 64, batch 8)"
    torch.manual_seed(args.seed)
    model = SmallGPT(n_layer=4, d_model=d, n_head=4, seq_len=64).to(device)
    tokens = torch.randint(0, 256, (8, 64), device=device)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    def adamw(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    everything = memtrim.plan(model, tokens, loss_fn, adamw, targets=tokens, budget=1 << 50)
    plain = next(p for p in everything.all if not p.techniques)
    budget = int(0.8 * plain.peak_bytes)
    plans = memtrim.plan(model, tokens, loss_fn, adamw, targets=tokens, budget=budget)
    best = plans.best
    measured = memtrim.planner.trace_step(model, tokens, tokens, loss_fn, adamw,
                                          [memtrim.planner.TECHNIQUES[n] for n in best.techniques], fake=False,
                                          blocks=best.blocks)
    print(f"  plan {workload} for {budget:,} B: {best.name}, predicted {best.peak_bytes:,} B, measured "
          f"{measured.report.peak_bytes:,} B")
    return Planned(workload=workload, budget=budget, chosen=best.name, predicted=best.peak_bytes,
                   measured=measured.report.peak_bytes,
                   plans=[{"name": p.name, "peak": p.peak_bytes, "phase": p.peak_phase, "time_ratio": p.time_ratio,
                           "numerics": p.numerics, "fits": p.fits} for p in plans.all])

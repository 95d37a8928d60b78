"""Shared by the benchmark scripts (never imported by the library)."""

import json
import os
import platform
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

import memtrim
from memtrim.models import SeedMLP, SmallGPT

RESULTS = os.path.join(os.path.dirname(__file__), "results")
_MALLOC = {"MALLOC_TRIM_THRESHOLD_": "4000000000", "MALLOC_MMAP_THRESHOLD_": "4000000000"}


def pin_malloc() -> None:
    """Re-run this script with glibc's heap trimming and mmap threshold pinned.

    Two models stepping in turn in one process make glibc return freed memory to the OS and fault it back in:
    whichever runs second was measured up to 1.5x slower with no code difference. With both thresholds pinned
    the same two models time equal, so step-time ratios measure the code, not the allocator.
    """
    import sys

    if all(os.environ.get(k) == v for k, v in _MALLOC.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **_MALLOC})


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d"),
    }


# NOTE [ interleaved timing rounds ]
# The timing scripts take step times with time.perf_counter in interleaved rounds (each round times every variant
# once, in turn) and report the median of the per-round ratios to the baseline, with quartiles; they do not use
# torch.utils.benchmark.Timer. A Timer times one statement at a time (blocked_autorange repeats it until its own
# time budget is spent, and by default on one thread), so two variants timed by two Timers run one after the other;
# on a shared, noisy 2-core machine the load changes in between and skews their ratio. Interleaving puts every
# variant through the same moments of load, so each round's ratio is fair even while absolute times drift.
def quartiles(values: list[float]) -> list[float]:
    """First and third quartiles: the spread quoted beside a median of step-time ratios."""
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def write(name: str, data: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def workloads(device: str = "cpu") -> dict:
    """name -> (model, inputs, targets, loss_fn, optimizer), each built from seed 0."""
    torch.manual_seed(0)
    mlp = SeedMLP().to(device)
    x = torch.randn(64, 784, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    torch.manual_seed(0)
    gpt = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128, vocab_size=256).to(device)
    idx = torch.randint(0, 256, (8, 128), device=device)

    def lm_loss(out, t):
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    return {
        "seed MLP (784-256-128-64-10, batch 64, Adam)": (mlp, x, y, F.nll_loss, torch.optim.Adam(mlp.parameters())),
        "small GPT (4 layers, d=256, seq 128, batch 8, AdamW)": (
            gpt, idx, idx, lm_loss, torch.optim.AdamW(gpt.parameters())
        ),
    }


def train_step(model, x, y, loss_fn, optimizer) -> None:
    loss = loss_fn(model(x), y)
    loss.backward()
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def third_step_report(step, model, optimizer) -> memtrim.MemoryReport:
    """Run ``step()`` twice (the optimizer's state exists afterwards), then once under ``memtrim.track``: its report."""
    step()
    step()
    with memtrim.track(model, optimizer) as tracker:
        step()
    return tracker.report()


def src_at(rev: str, folder: str) -> str:
    """The ``src`` folder of an earlier commit, extracted into ``folder``: its path (for PYTHONPATH)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    archive = subprocess.run(["git", "-C", repo, "archive", rev, "src"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
    return os.path.join(folder, "src")


def head_commit() -> str:
    """This tree's commit, short."""
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()

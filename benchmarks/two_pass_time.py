"""What replaying a backward's draws in its second pass costs (NOTE [ a backward run twice ] in
memtrim/techniques/_generators.py): ``OptimizerInBackward(clip_grad_norm=)`` runs its two passes under a
torch-function mode that replays explicitly passed generators (memtrim's own work inside backward runs outside it).
Step time (zero_grad, forward, ``opt.backward``, step) of 100 Linear(16) layers with AdamW, batch 8, with this tree's
memtrim and with an earlier commit's (``--before REV``, default bfc466a: the passes under ``torch.random.fork_rng``),
alone and beside an idle second thread (tqdm's monitor is one). A parameter-heavy, compute-light model: the
per-parameter cost shows most. Each measurement is a fresh process, one thread, the two trees in turn for
``--rounds`` rounds; the figure is each tree's fastest round (median step of ``--steps``) and the ratio of the two,
and the ratio per round (median, quartiles). On these 2-core machines one tree's rounds differ by up to 2x (37-88 ms
seen): read the ratio per round's quartiles before the figure.

Reproduce (about 2 minutes; on an otherwise idle machine):
    .venv/bin/python benchmarks/two_pass_time.py [--before bfc466a] [--rounds 8]
Writes benchmarks/results/two_pass_time_cpu.json.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from _common import head_commit, machine, quartiles, src_at, write

CHILD = r"""
import json, statistics, sys, threading, time
import torch
from torch import nn
import memtrim

torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(100)])
opt = memtrim.OptimizerInBackward(torch.optim.AdamW(model.parameters(), lr=1e-4), model=model, clip_grad_norm=1.0)
x = torch.randn(8, 16)
if sys.argv[1] == "thread":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
times = []
for step in range(10 + int(sys.argv[2])):
    start = time.perf_counter()
    opt.zero_grad()
    opt.backward(model(x).square().mean())
    opt.step()
    if step >= 10:
        times.append(time.perf_counter() - start)
print(json.dumps({"seconds": statistics.median(times)}))
"""

CASES = {"alone": "alone", "beside an idle thread": "thread"}


def step_once(src: str, case: str, steps: int) -> float:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, case, str(steps)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="bfc466a", help="the earlier commit whose src is timed beside this tree's")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    results = []
    with tempfile.TemporaryDirectory() as folder:
        trees = {"this tree": src, args.before: src_at(args.before, folder)}
        for name, case in CASES.items():
            runs: dict[str, list[float]] = {tree: [] for tree in trees}
            for _ in range(args.rounds):
                for tree, path in trees.items():
                    runs[tree].append(step_once(path, case, args.steps))
            best = {tree: min(found) for tree, found in runs.items()}
            ratios = [a / b for a, b in zip(runs["this tree"], runs[args.before], strict=True)]
            row = {"case": name, "step_seconds": best, "ratio_to_before": best["this tree"] / best[args.before],
                   "ratio_per_round": {"median": statistics.median(ratios), "quartiles": quartiles(ratios)},
                   "rounds": runs}
            low, high = quartiles(ratios)
            print(f"{name}: fastest rounds {best['this tree'] * 1e3:.2f} ms per step against "
                  f"{best[args.before] * 1e3:.2f} ms at {args.before}: {row['ratio_to_before']:.3f}x; per round "
                  f"{statistics.median(ratios):.3f}x (quartiles {low:.3f}-{high:.3f}); "
                  f"this tree's rounds {min(runs['this tree']) * 1e3:.1f}-{max(runs['this tree']) * 1e3:.1f} ms",
                  flush=True)
            results.append(row)
    print("wrote", write("two_pass_time_cpu.json", {
        "machine": machine(), "commit": head_commit(), "before": args.before, "rounds": args.rounds,
        "steps": args.steps,
        "workload": "100 x Linear(16, 16), batch 8, AdamW (CPU default: a loop per parameter), "
                    "OptimizerInBackward(clip_grad_norm=1.0), bucket_bytes default; one thread; each tree in a "
                    "fresh process per round; fastest round's median step",
        "results": results}))


if __name__ == "__main__":
    main()

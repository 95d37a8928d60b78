"""How long ``memtrim.convert`` itself takes, by model depth: an HF Llama (LlamaForCausalLM from a config: d=64,
mlp 128, 4 heads, vocab 256; batch 1 x 16 tokens) of 4, 16 and 64 layers, converted by this tree's memtrim and by
an earlier commit's (``--before REV``, default deb5f94: every change measured by a tracked forward of the whole
model after it, which made convert's time grow with the square of the depth; NOTE [ changes measured together ] in
memtrim/techniques/convert/api.py). Each conversion runs in a fresh process, one thread, the two trees in turn for
``--rounds`` rounds; the figure is each tree's fastest round and the ratio of the two, with the number of tracked
forwards convert ran (``memtrim.Tracker`` entered: the trace, the measurements) and whether the two reports are the
same text.

Reproduce (about 10 minutes; transformers from the ``models`` extra; on an otherwise idle machine):
    .venv/bin/python benchmarks/convert_time.py [--before deb5f94] [--rounds 3]
Writes benchmarks/results/convert_time_cpu.json.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

from _common import head_commit, machine, src_at, write

DEPTHS = (4, 16, 64)

CHILD = r"""
import json, sys, time
import torch
import memtrim
import memtrim.measure
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(1)
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=int(sys.argv[1]), intermediate_size=128,
                                     num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
ids = torch.randint(0, 256, (1, 16))
tracks = []
original = memtrim.measure.Tracker.__enter__
def counted(self):
    tracks.append(1)
    return original(self)
memtrim.measure.Tracker.__enter__ = counted
start = time.perf_counter()
_, report = memtrim.convert(model, example_inputs={"input_ids": ids})
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tracked_forwards": len(tracks), "changes": len(report.changes),
                  "report": str(report)}))
"""


def convert_once(src: str, depth: int) -> dict:
    env = {**os.environ, "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(depth)], env=env, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="deb5f94", help="the earlier commit whose src is timed beside this tree's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--depths", type=int, nargs="+", default=list(DEPTHS))
    args = parser.parse_args()
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "src")
    with tempfile.TemporaryDirectory() as folder:
        trees = {"this tree": src, args.before: src_at(args.before, folder)}
        results = []
        for depth in args.depths:
            runs: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, tree in trees.items():
                    runs[name].append(convert_once(tree, depth))
            best = {name: min(r["seconds"] for r in found) for name, found in runs.items()}
            now, then = runs["this tree"][0], runs[args.before][0]
            row = {"layers": depth, "changes": now["changes"],
                   "seconds": best, "ratio_to_before": best["this tree"] / best[args.before],
                   "tracked_forwards": {name: found[0]["tracked_forwards"] for name, found in runs.items()},
                   "same_report": now["report"] == then["report"]}
            forwards = row["tracked_forwards"]
            print(f"{depth} layers, {row['changes']} changes: {best['this tree']:.2f} s ({forwards['this tree']} "
                  f"tracked forwards) against {best[args.before]:.2f} s ({forwards[args.before]}) at "
                  f"{args.before}: {row['ratio_to_before']:.3f}x; same report: {row['same_report']}", flush=True)
            results.append(row)
    print("wrote", write("convert_time_cpu.json", {
        "machine": machine(), "commit": head_commit(), "before": args.before, "rounds": args.rounds,
        "depths": args.depths,
        "workload": "HF LlamaForCausalLM from a config: d=64, mlp 128, 4 heads, vocab 256, batch 1 x 16 tokens; "
                    "one thread; each conversion in a fresh process",
        "results": results}))


if __name__ == "__main__":
    main()

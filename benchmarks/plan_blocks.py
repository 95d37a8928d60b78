"""Which blocks memtrim.plan checkpoints on timm models that hold their blocks as attributes (regnet, dla) or nest
containers (convnext): for each candidate class (``memtrim.planner.block_candidates``) the predicted peak of a
steady-state AdamW step with ``checkpoint`` and with ``selective`` (fake tensors), the class the plan chooses, and the
chosen plan's peak measured by memtrim's tracker on real CPU tensors. Random weights from timm's configs, offline.

Reproduce:  zoovenv/bin/python benchmarks/plan_blocks.py
            (zoovenv: the venv of benchmarks/convert_zoo.py, with timm and its torchvision import shim)
Writes benchmarks/results/plan_blocks_cpu.json. Memory only: no timings.
"""

import argparse

import torch
import torch.nn.functional as F

import memtrim
from _common import machine, write
from convert_zoo import import_torchvision
from memtrim.planner import TECHNIQUES, block_candidates, trace_step

MODELS = ("regnetx_002", "dla34", "convnext_atto")


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def one(timm, name: str, batch: int, size: int) -> dict:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))
    candidates = block_candidates(model)
    plans = memtrim.plan(model, x, F.cross_entropy, _adamw, targets=y, budget=1 << 50,
                         techniques=["checkpoint", "selective"], workers=1)
    row = {"model": name, "batch": batch, "size": size, "candidates": [c.__name__ for c in candidates],
           "plain": next(p.peak_bytes for p in plans.all if not p.techniques)}
    for technique in ("checkpoint", "selective"):
        chosen = next(p for p in plans.all if p.techniques == (technique,))
        predicted = {c.__name__: trace_step(model, x, y, F.cross_entropy, _adamw, [TECHNIQUES[technique]],
                                            block=c).report.peak_bytes for c in candidates}
        measured = trace_step(model, x, y, F.cross_entropy, _adamw, [TECHNIQUES[technique]], fake=False,
                              block=chosen.block).report.peak_bytes
        row[technique] = {"chosen": chosen.block.__name__, "predicted": chosen.peak_bytes, "measured": measured,
                          "by_candidate": predicted}
    print(row)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    import_torchvision()
    import timm

    rows = [one(timm, name, args.batch, args.size) for name in MODELS]
    print(write("plan_blocks_cpu.json", {"machine": machine(), "timm": timm.__version__, "rows": rows}))


if __name__ == "__main__":
    main()

"""convert's per-step cost where a step waits on the host (a GPU step at a small batch), counted in instructions,
not seconds: a count under valgrind's callgrind does not move with the machine's load, so it can tell a change of a
few percent apart where timings on these machines cannot (their runs differ by up to 0.05 in a step-time ratio).

The workload is torchvision's resnet18 pattern at width 4, batch 2, 32x32 (memtrim.models.torchvision_resnet): its
kernels cost next to nothing, so the step is what the host does, as on a GPU that waits on the CPU. convert makes 10
changes there (9 BatchNorm + ReLU, one max pool). Each variant (plain, converted) runs under callgrind twice, with 0
and with STEPS training steps after 3 warm-up steps; the difference over STEPS is one step's instructions, and the
per-library split says where the converted step's extra instructions go (libpython: Python, memtrim's and torch's;
libtorch_cpu: the ops).

Reproduce (about 15 minutes; needs valgrind):  .venv/bin/python benchmarks/convert_instructions.py
Writes benchmarks/results/convert_instructions_cpu.json.
"""

import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

STEPS = 20


def workload(variant: str, steps: int) -> None:
    """The child: build, convert if asked, warm up, then ``steps`` steps."""
    import memtrim
    from memtrim.models.torchvision_resnet import TorchvisionBasicBlock, TorchvisionResNet

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TorchvisionResNet(TorchvisionBasicBlock, [2, 2, 2, 2], num_classes=10, planes=(4, 4, 4, 4), stem=4)
    x = torch.randn(2, 3, 32, 32)
    if variant == "converted":
        model, _ = memtrim.convert(model, example_inputs=x)
    for _ in range(3 + steps):
        model(x).sum().backward()


def count(variant: str, steps: int, folder: str) -> collections.Counter:
    """Instructions per library (object file) of one child run under callgrind."""
    out = os.path.join(folder, f"{variant}{steps}.out")
    # one thread in every pool: a waiting thread spins, and its instructions would count as the step's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, __file__,
                    "--child", variant, str(steps)], check=True, capture_output=True, env=env)
    text = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", out], check=True,
                          capture_output=True, text=True).stdout
    by_object: collections.Counter = collections.Counter()
    for line in text.splitlines():
        found = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", line)
        if not found or "PROGRAM TOTALS" in line or ":" not in found.group(2):
            continue
        where = re.search(r"\[([^\]]+)\]\s*$", found.group(2))
        library = os.path.basename(where.group(1) if where else found.group(2).split(":")[0])
        by_object[library] += int(found.group(1).replace(",", ""))
    return by_object


def main() -> None:
    from _common import machine, write

    per_step = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in ("plain", "converted"):
            before, after = count(variant, 0, folder), count(variant, STEPS, folder)
            per_step[variant] = {k: (after[k] - before[k]) / STEPS for k in after}
    plain, converted = per_step["plain"], per_step["converted"]
    extra = {k: converted.get(k, 0) - plain.get(k, 0) for k in set(plain) | set(converted)}
    top = {k: v for k, v in sorted(extra.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 10_000}
    result = {
        "machine": machine(),
        "workload": "torchvision resnet18 pattern, planes 4, stem 4, batch 2, 32x32, one thread",
        "steps_counted": STEPS,
        "instructions_per_step": {"plain": sum(plain.values()), "converted": sum(converted.values())},
        "ratio": sum(converted.values()) / sum(plain.values()),
        "extra_by_library": top,  # every library whose count moved by 10,000 or more, largest first
    }
    print(write("convert_instructions_cpu.json", result))
    print(f"plain {result['instructions_per_step']['plain'] / 1e6:.2f}M, converted "
          f"{result['instructions_per_step']['converted'] / 1e6:.2f}M instructions per step ({result['ratio']:.3f}x)")
    for library, n in list(top.items())[:10]:
        print(f"  {n / 1e6:+.2f}M  {library}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        workload(sys.argv[2], int(sys.argv[3]))
    else:
        main()

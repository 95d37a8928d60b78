"""convert's per-step cost where a step waits on the host (a GPU step at a small batch), counted in instructions,
not seconds: a count under valgrind's callgrind does not move with the machine's load, so it can tell a change of a
few percent apart where timings on these machines cannot (their runs differ by up to 0.05 in a step-time ratio).

The workload is torchvision's resnet18 pattern at width 4, batch 2, 32x32 (memtrim.models.torchvision_resnet): its
kernels cost next to nothing, so the step is what the host does, as on a GPU that waits on the CPU. convert makes 10
changes there (9 BatchNorm + ReLU, one max pool). Each variant (plain, converted) runs under callgrind twice, with 0
and with STEPS training steps after 3 warm-up steps; the difference over STEPS is one step's instructions, and the
per-library split says where the converted step's extra instructions go (libpython: Python, memtrim's and torch's;
libtorch_cpu: the ops).

``--model llama`` counts a small HF Llama instead (LlamaForCausalLM from a config: d=64, 4 layers, mlp 128, 4 heads,
vocab 256, batch 1 x 16 tokens; transformers from the ``models`` extra), where convert's rebuilt RMSNorms decide which
features keep their input (NOTE [ keep decisions made together ]) and its Linears run as consumer scopes. Importing
transformers under callgrind takes longer than 15 minutes, so there the child runs uninstrumented until its warm-up is
done and the parent switches instrumentation on (``callgrind_control -i on``) before the counted steps.
``--src DIR`` counts another memtrim tree (a checkout of an earlier commit's ``src``).

Reproduce (about 15 minutes; needs valgrind):  .venv/bin/python benchmarks/convert_instructions.py [--model llama]
Writes benchmarks/results/convert_instructions_cpu.json (``--model llama``: convert_instructions_llama_cpu.json).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

STEPS = 20


WORKLOADS = {
    "resnet18_pattern": "torchvision resnet18 pattern, planes 4, stem 4, batch 2, 32x32, one thread",
    "llama": "HF LlamaForCausalLM, d=64, 4 layers, mlp 128, 4 heads, vocab 256, batch 1 x 16 tokens, one thread; "
             "instrumentation switched on after 3 warm-up steps",
}


def workload(name: str, variant: str, steps: int, folder: str) -> None:
    """The child: build, convert if asked, warm up, then ``steps`` steps (llama: after the parent switched
    instrumentation on, told by a file in ``folder``)."""
    import memtrim

    torch.set_num_threads(1)
    torch.manual_seed(0)
    if name == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=4, intermediate_size=128,
                                             num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
        ids = torch.randint(0, 256, (1, 16))
        if variant == "converted":
            memtrim.convert(llama, example_inputs={"input_ids": ids})
        for _ in range(3):
            llama(input_ids=ids).logits.sum().backward()
        open(os.path.join(folder, "ready"), "w").close()
        while not os.path.exists(os.path.join(folder, "go")):
            time.sleep(0.05)
        for _ in range(steps):
            llama(input_ids=ids).logits.sum().backward()
        return
    from memtrim.models.torchvision_resnet import TorchvisionBasicBlock, TorchvisionResNet

    model = TorchvisionResNet(TorchvisionBasicBlock, [2, 2, 2, 2], num_classes=10, planes=(4, 4, 4, 4), stem=4)
    x = torch.randn(2, 3, 32, 32)
    if variant == "converted":
        model, _ = memtrim.convert(model, example_inputs=x)
    for _ in range(3 + steps):
        model(x).sum().backward()


def count(name: str, variant: str, steps: int, folder: str, src: str | None) -> collections.Counter:
    """Instructions per library (object file) of one child run under callgrind."""
    out = os.path.join(folder, f"{variant}{steps}.out")
    # one thread in every pool: a waiting thread spins, and its instructions would count as the step's
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1"}
    if src:
        env["PYTHONPATH"] = src
    late = name != "resnet18_pattern"  # (instrumentation from the warm-up's end)
    for flag in ("ready", "go"):
        if os.path.exists(os.path.join(folder, flag)):
            os.remove(os.path.join(folder, flag))
    child = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              *(["--instr-atstart=no"] if late else []), sys.executable, __file__,
                              "--child", name, variant, str(steps), folder],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    if late:
        while not os.path.exists(os.path.join(folder, "ready")):
            if child.poll() is not None:
                raise RuntimeError(f"the child stopped: {child.stderr.read().decode()[-2000:]}")  # type: ignore
            time.sleep(0.5)
        subprocess.run(["callgrind_control", "-i", "on", str(child.pid)], check=True, capture_output=True)
        open(os.path.join(folder, "go"), "w").close()
    if child.wait() != 0:
        raise RuntimeError(f"the child failed: {child.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
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


def main(name: str, src: str | None) -> None:
    from _common import machine, write

    per_step = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in ("plain", "converted"):
            before, after = count(name, variant, 0, folder, src), count(name, variant, STEPS, folder, src)
            per_step[variant] = {k: (after[k] - before[k]) / STEPS for k in after}
    plain, converted = per_step["plain"], per_step["converted"]
    extra = {k: converted.get(k, 0) - plain.get(k, 0) for k in set(plain) | set(converted)}
    top = {k: v for k, v in sorted(extra.items(), key=lambda kv: -abs(kv[1])) if abs(v) >= 10_000}
    result = {
        "machine": machine(),
        "workload": WORKLOADS[name],
        "memtrim_src": src or "the installed memtrim",
        "steps_counted": STEPS,
        "instructions_per_step": {"plain": sum(plain.values()), "converted": sum(converted.values())},
        "ratio": sum(converted.values()) / sum(plain.values()),
        "extra_by_library": top,  # every library whose count moved by 10,000 or more, largest first
    }
    file = "convert_instructions_cpu.json" if name == "resnet18_pattern" else f"convert_instructions_{name}_cpu.json"
    print(write(file, result))
    print(f"plain {result['instructions_per_step']['plain'] / 1e6:.2f}M, converted "
          f"{result['instructions_per_step']['converted'] / 1e6:.2f}M instructions per step ({result['ratio']:.3f}x)")
    for library, n in list(top.items())[:10]:
        print(f"  {n / 1e6:+.2f}M  {library}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        workload(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        parser = argparse.ArgumentParser()
        parser.add_argument("--model", choices=sorted(WORKLOADS), default="resnet18_pattern")
        parser.add_argument("--src", default=None, help="a memtrim src directory to count instead of the installed one")
        args = parser.parse_args()
        main(args.model, args.src)

"""memtrim.convert on CUDA, on the models of ``convert_zoo_time.py --wide`` (batch x4): one seeded training-mode
step's parameter gradients against the unconverted model's, with torch's deterministic algorithms on (so that plain
against plain is 0 where torch can make it so); where the report says a change is not bitwise, the same in float64,
and each float32 run against float64 (float32's own error: on CUDA convolutions run in TF32 by default). Then, with
PROFILE=NAME, NAME's step (batch x16) plain and converted: its time and torch.profiler's tables.

Reproduce (on a GPU, from benchmarks/):  PROFILE=tv_resnet18 python3 convert_cuda_check.py [NAME ...]
Prints its results; results/convert_cuda_check_cuda.txt is that output from an H200 (torch 2.11, 2026-11-28).
"""
import copy
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS's deterministic mode

import torch

import memtrim
from convert_zoo_time import WIDE, build, step, train_gradients

torch.use_deterministic_algorithms(True, warn_only=True)
DEV = "cuda"
MULT = int(os.environ.get("MULT", "4"))


def rel(a, b):
    num = sum((a[k].double() - b[k].double()).pow(2).sum() for k in b).sqrt().item()
    den = sum(b[k].double().pow(2).sum() for k in b).sqrt().item()
    worst = max(((a[k].double() - b[k].double()).abs().max() / b[k].double().abs().max().clamp_min(1e-30)).item()
                for k in b)
    return f"{num / den:.2e} (worst param {worst:.2e})"


def cast(batch, dtype):
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


keys = sys.argv[1:] or list(WIDE)
for key in keys:
    label, (plain, batch, lib), _ = build(key, WIDE)
    plain.train().to(DEV)
    batch = {k: v.repeat(MULT, *[1] * (v.dim() - 1)).to(DEV) for k, v in batch.items()}
    conv = copy.deepcopy(plain)
    _, report = memtrim.convert(conv, example_inputs=batch)
    p = train_gradients(plain, batch)
    p2 = train_gradients(plain, batch)
    c = train_gradients(conv, batch)
    floor = max((p[k] - p2[k]).abs().max().item() for k in p)
    diff = max((p[k] - c[k]).abs().max().item() for k in p)
    line = (f"{key}: claims bitwise={report.bitwise}; float32 max|conv-plain|={diff:.3e} rel {rel(c, p)}; "
            f"plain-plain {floor:.3e}")
    if not report.bitwise:
        p64m = copy.deepcopy(plain).double()
        c64m = copy.deepcopy(p64m)
        memtrim.convert(c64m, example_inputs=cast(batch, torch.float64))
        p64 = train_gradients(p64m, cast(batch, torch.float64))
        c64 = train_gradients(c64m, cast(batch, torch.float64))
        line += (f"; float64 conv vs plain {rel(c64, p64)}; float32 plain vs float64 {rel(p, p64)}; "
                 f"float32 conv vs float64 {rel(c, p64)}")
        del p64m, c64m, p64, c64
    print(line, flush=True)
    del plain, conv, p, p2, c
    torch.cuda.empty_cache()

if os.environ.get("PROFILE"):
    torch.use_deterministic_algorithms(False)
    from torch.profiler import ProfilerActivity, profile
    label, (plain, batch, lib), _ = build(os.environ["PROFILE"], WIDE)
    plain.train().to(DEV)
    batch = {k: v.repeat(16, *[1] * (v.dim() - 1)).to(DEV) for k, v in batch.items()}
    conv = copy.deepcopy(plain)
    memtrim.convert(conv, example_inputs=batch)
    for name, m in (("plain", plain), ("converted", conv)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        for _ in range(3):
            step(m, opt, batch)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            step(m, opt, batch)
        torch.cuda.synchronize()
        print(name, f"{(time.perf_counter() - t) * 100:.2f} ms/step (10 steps)")
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step(m, opt, batch)
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(name, "by self CUDA time (3 steps)")
        print(ka.table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=50))
        print(name, "by self CPU time (3 steps)")
        print(ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50))

"""The tracker against the CUDA caching allocator on one training step of the seed MLP (batch 256) and the small
GPT: the tracker's peak, the allocator's peak, the allocator's requested bytes (before its rounding) at its peak and
after every op, and the tracker's timeline beside the per-op levels.

Reproduce (on a GPU, from the repository root):  PYTHONPATH=src python3 benchmarks/cuda_tracker_check.py
Writes benchmarks/results/cuda_tracker_check_cuda.json. The committed one is from an H200, torch 2.11, 2026-11-28,
written by this script's first version (the same workloads set up in place). tests/measure/test_api.py asserts the
exact part: the tracker's peak is the highest requested level at an op's end.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository, for tests/
from tests.helpers import AllocatorAtOpEnds, cuda_workload, train_step  # noqa: E402

import memtrim  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


res = {}
for wl in ("mlp", "gpt"):
    model, optimizer, x, y, loss_fn = cuda_workload(wl)
    train_step(model, optimizer, x, y, loss_fn)
    torch.cuda.synchronize()
    start_alloc = torch.cuda.memory_allocated()
    start_req = torch.cuda.memory_stats().get("requested_bytes.all.current")
    rec = AllocatorAtOpEnds()
    with memtrim.track(model, optimizer) as tracker:
        with rec:
            train_step(model, optimizer, x, y, loss_fn)
    st = torch.cuda.memory_stats()
    r = tracker.report()
    res[wl] = {
        "defaults": {k: str(v) for k, v in optimizer.defaults.items()},
        "tracked_delta": r.peak_bytes - r.timeline[0].total_bytes,
        "allocator_delta": r.allocator_peak_allocated_bytes - r.allocator_start_allocated_bytes,
        "start_alloc_mine": start_alloc, "start_alloc_tracker": r.allocator_start_allocated_bytes,
        "requested_peak_delta": (st.get("requested_bytes.all.peak") or 0) - (start_req or 0),
        "report": str(r),
        "timeline": [(e.kind, e.op, e.phase, e.delta_bytes, e.category, sum(e.totals)) for e in r.timeline],
        "ops": [(n, a - start_alloc, (q or 0) - (start_req or 0)) for n, a, q in rec.log],
    }
    print(wl, {k: v for k, v in res[wl].items() if k not in ("report", "timeline", "ops")})
    print(r)
with open(os.path.join(OUT, "cuda_tracker_check_cuda.json"), "w") as f:
    json.dump(res, f)

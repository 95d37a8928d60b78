"""The tracker against the CUDA caching allocator on one training step of the seed MLP (batch 256) and the small
GPT: the tracker's peak, the allocator's peak, the allocator's requested bytes (before its rounding) at its peak and
after every op, and the tracker's timeline beside the per-op levels.

Reproduce (on a GPU, from the repository root):  PYTHONPATH=src python3 benchmarks/cuda_tracker_check.py
Writes benchmarks/results/cuda_tracker_check_cuda.json (the committed one: an H200, torch 2.11, 2026-11-28, written
by this code as diag.json). tests/measure/test_api.py asserts the exact part (the tracker's peak is the highest
requested level at an op's end).
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.getcwd())
from tests.helpers import train_step  # noqa: E402

import memtrim  # noqa: E402
from memtrim.models import SeedMLP, SmallGPT  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


class Rec(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        st = torch.cuda.memory_stats()
        self.log.append((str(func), torch.cuda.memory_allocated(), st.get("requested_bytes.all.current")))
        return out


res = {}
for wl in ("mlp", "gpt"):
    torch.manual_seed(0)
    if wl == "mlp":
        model = SeedMLP().cuda()
        x, y, loss_fn = torch.randn(256, 784, device="cuda"), torch.randint(0, 10, (256,), device="cuda"), F.nll_loss
    else:
        model = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128).cuda()
        x = torch.randint(0, 256, (8, 128), device="cuda")
        y = x

        def loss_fn(out, t):
            return F.cross_entropy(out.flatten(0, 1), t.flatten())
    optimizer = torch.optim.AdamW(model.parameters())
    train_step(model, optimizer, x, y, loss_fn)
    torch.cuda.synchronize()
    start_alloc = torch.cuda.memory_allocated()
    start_req = torch.cuda.memory_stats().get("requested_bytes.all.current")
    rec = Rec()
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

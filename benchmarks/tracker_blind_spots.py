"""Where the tracker sees less than the allocator: allocations no dispatched op makes (README, "Not counted").

For each workload, one training step's peak above its start as ``memtrim.track`` reports it and as the CPU
allocator's events say (``torch.profiler`` with ``profile_memory=True``, on a separate untracked run of the same
step). A plain MLP step is the control (the two agree to the scalar wrappers); CPU ``nn.LSTM`` runs oneDNN kernels
(``mkldnn_rnn_layer`` and its backward) that allocate inside, unseen.

Reproduce:  .venv/bin/python benchmarks/tracker_blind_spots.py
Writes benchmarks/results/tracker_blind_spots_cpu.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import memtrim
from _common import machine

RESULTS = Path(__file__).parent / "results" / "tracker_blind_spots_cpu.json"


class LSTMNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.lstm, self.head = nn.Embedding(1000, 64), nn.LSTM(64, 128, 2, batch_first=True), \
            nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(x))[0][:, -1])


def allocator_peak(step) -> int:
    """The CPU allocator's peak above the start over ``step()``, from torch.profiler's allocation events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = []

    def walk(node) -> None:
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    now = peak = 0
    for _, size in sorted(events):
        now += size
        peak = max(peak, now)
    return peak


def workload(name: str):
    torch.manual_seed(0)
    if name == "lstm":
        model = LSTMNet()
        x, y = torch.randint(0, 1000, (16, 32)), torch.randint(0, 10, (16,))
    else:
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    optimizer = torch.optim.Adam(model.parameters())

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad()

    return model, optimizer, step


def main() -> None:
    torch.set_num_threads(1)
    rows = {}
    for name in ("mlp", "lstm"):
        model, optimizer, step = workload(name)
        step()  # optimizer state made: both runs below start from the same memory
        untracked = allocator_peak(step)
        with memtrim.track(model, optimizer) as tracker:
            step()
        report = tracker.report()
        tracked = report.peak_bytes - report.timeline[0].total_bytes
        rows[name] = {"tracked_peak_above_start": tracked, "allocator_peak_above_start": untracked,
                      "tracked_over_allocator": round(tracked / untracked, 4)}
        print(f"{name}: tracked {tracked:,} B, allocator {untracked:,} B ({tracked / untracked:.3f})")
    RESULTS.write_text(json.dumps({"machine": machine(), "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""What a tracker measured: :class:`MemoryReport` (data), and its JSON, PNG and text forms (formatting)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .plots import pyplot

__all__ = ["CATEGORIES", "PHASES", "Category", "MemoryReport", "TimelineEvent", "format_bytes"]


class Category(str, Enum):
    """What a tracked storage holds (see NOTE [ memtrim's accounting ] in tracker.py).

    A ``str`` Enum, as torch's ``mem_tracker`` names its reference types: each member equals its value
    (``Category.GRADIENTS == "gradients"``), so reports, keyed by the plain strings in :data:`CATEGORIES`, accept
    either. The first five say what a storage *is* and are given from its birth (``Tracker.label`` assigns them);
    the last three are decided by the tracker from what keeps the storage alive.

    - ``PARAMETERS``: the model's parameters (trainable leaves when no model is given).
    - ``BUFFERS``: the model's buffers (BatchNorm running statistics...).
    - ``GRADIENTS``: parameter gradients, from the op that computes them on.
    - ``OPTIMIZER_STATE``: what the optimizer keeps between steps (Adam's ``exp_avg``...).
    - ``ACTIVATIONS``: storages kept for backward, by autograd or by a technique (``hooks.hold_for_backward``).
    - ``TEMPORARIES``: born inside the tracker and kept by nothing above.
    - ``INPUTS``: the batch (the model's tensor arguments, or what a measurement is told).
    - ``OTHER``: existed before the tracker started and is none of the above.
    """

    PARAMETERS = "parameters"
    BUFFERS = "buffers"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    INPUTS = "inputs"
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


CATEGORIES: tuple[str, ...] = tuple(category.value for category in Category)
"""The category names as plain strings, in report order (the keys of every by-category dict)."""
PHASES = ("forward", "backward", "optimizer", "other")
"""The phases a report names (``peak_phase``, :attr:`TimelineEvent.phase`), in training-step order."""

_COLORS = {
    "parameters": "#4c72b0",
    "buffers": "#64b5cd",
    "gradients": "#dd8452",
    "optimizer_state": "#8172b3",
    "activations": "#c44e52",
    "temporaries": "#ccb974",
    "inputs": "#55a868",
    "other": "#8c8c8c",
}
_PHASE_COLORS = {"forward": "#e8f1fa", "backward": "#fbeee6", "optimizer": "#efeaf7", "other": "#ffffff"}


def format_bytes(n: int | float) -> str:
    """``1536`` -> ``'1.50 KiB'`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class TimelineEvent:
    """One change in live memory: a storage born, freed, resized, or taken/released by autograd."""

    index: int
    kind: str  # "start", "alloc", "free", "resize", "hold"
    op: str | None
    phase: str
    module: str | None
    delta_bytes: int
    category: str | None  # the category of the storage this event changed, after the change
    totals: tuple[int, ...]  # running live bytes, in CATEGORIES order

    @property
    def by_category(self) -> dict[str, int]:
        """Live bytes per category right after this event."""
        return dict(zip(CATEGORIES, self.totals))

    @property
    def total_bytes(self) -> int:
        """Live bytes, all categories together, right after this event."""
        return sum(self.totals)


@dataclass(frozen=True)
class MemoryReport:
    """Where memory went while a tracker was active, for one device.

    ``peak_by_category`` is the breakdown at the peak instant; ``timeline`` holds every change with running
    totals. On CUDA, ``allocator_peak_*`` carry the caching allocator's own peaks over the same span and
    ``allocator_start_allocated_bytes`` its level when the tracker started (the allocator also holds what is
    no tensor storage, e.g. cuBLAS workspaces, so compare peaks relative to the start).
    """

    peak_bytes: int
    peak_by_category: dict[str, int]
    peak_phase: str
    peak_module: str | None
    peak_op: str | None
    final_by_category: dict[str, int]
    timeline: list[TimelineEvent] = field(repr=False)
    device: str
    allocator_peak_allocated_bytes: int | None = None
    allocator_peak_reserved_bytes: int | None = None
    allocator_start_allocated_bytes: int | None = None

    @property
    def final_bytes(self) -> int:
        """Live bytes, all categories together, when the tracker stopped."""
        return sum(self.final_by_category.values())

    @property
    def activations_at_backward_start(self) -> int:
        """Activation bytes alive just before the first backward event: what the forward left for backward (what
        a technique that keeps less shrinks). 0 when the tracked span holds no backward."""
        for i, event in enumerate(self.timeline):
            if event.phase == "backward":
                return self.timeline[max(i - 1, 0)].by_category["activations"]
        return 0

    @property
    def forward_transient_peak(self) -> int:
        """The most bytes of activations plus temporaries alive at once before the first backward event: the
        forward's transient peak (what an in-place op shrinks even when it keeps the same activations)."""
        peak = 0
        for event in self.timeline:
            if event.phase == "backward":
                break
            by_category = event.by_category
            peak = max(peak, by_category["activations"] + by_category["temporaries"])
        return peak

    def to_dict(self, timeline: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (the timeline as lists of running totals by category)."""
        data: dict[str, Any] = {
            "device": self.device,
            "peak_bytes": self.peak_bytes,
            "peak_by_category": self.peak_by_category,
            "peak_phase": self.peak_phase,
            "peak_module": self.peak_module,
            "peak_op": self.peak_op,
            "final_by_category": self.final_by_category,
            "allocator_peak_allocated_bytes": self.allocator_peak_allocated_bytes,
            "allocator_peak_reserved_bytes": self.allocator_peak_reserved_bytes,
            "allocator_start_allocated_bytes": self.allocator_start_allocated_bytes,
            "categories": list(CATEGORIES),
        }
        if timeline:
            data["timeline"] = [
                {
                    "index": e.index,
                    "kind": e.kind,
                    "op": e.op,
                    "phase": e.phase,
                    "module": e.module,
                    "delta_bytes": e.delta_bytes,
                    "category": e.category,
                    "totals": list(e.totals),
                }
                for e in self.timeline
            ]
        return data

    def to_json(self, path: str) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    def plot(self, path: str, title: str | None = None) -> None:
        """Write a PNG: live bytes by category over the timeline (stacked), peak marked, phases shaded.

        Raises:
            MissingDependencyError: matplotlib is not installed.
        """
        plt = pyplot("MemoryReport.plot")
        # event i holds its bytes from i to i + 1 (steps drawn "post"), so the last one is drawn too: a timeline of
        # one op was an empty plot, and each phase's shading was half an event off its bytes
        n = len(self.timeline)
        x = list(range(n + 1))
        mib = 1024 * 1024
        series = [[e.totals[i] / mib for e in self.timeline] for i in range(len(CATEGORIES))]
        series = [values + values[-1:] for values in series]
        fig, ax = plt.subplots(figsize=(10, 4.5))
        start = 0
        for i in range(1, n + 1):
            if i == n or self.timeline[i].phase != self.timeline[start].phase:
                phase = self.timeline[start].phase
                if phase != "other":
                    ax.axvspan(start, i, color=_PHASE_COLORS[phase], zorder=0, lw=0)
                start = i
        shown = [i for i, s in enumerate(series) if any(s)]
        if shown:
            ax.stackplot(
                x,
                *[series[i] for i in shown],
                labels=[CATEGORIES[i] for i in shown],
                colors=[_COLORS[CATEGORIES[i]] for i in shown],
                step="post",
                zorder=2,
            )
        else:  # nothing live (an empty block): an empty plot that says so (NumPy raised "need at least one array")
            ax.text(0.5, 0.5, "no tensor memory seen", transform=ax.transAxes, ha="center", va="center")
        peak_index = next((i for i, e in enumerate(self.timeline) if e.total_bytes == self.peak_bytes), 0)
        ax.axvline(peak_index + 0.5, color="black", ls="--", lw=1, zorder=3)  # the middle of the peak's step
        ax.annotate(
            f"peak {format_bytes(self.peak_bytes)}\n{self.peak_phase}"
            + (f", {self.peak_module}" if self.peak_module else "")
            + (f"\n{self.peak_op}" if self.peak_op else ""),
            xy=(peak_index + 0.5, self.peak_bytes / mib),
            xytext=(5, -5),
            textcoords="offset points",
            va="top",
            fontsize=8,
            zorder=4,
        )
        from matplotlib.patches import Patch

        handles, labels = ax.get_legend_handles_labels()
        for phase in ("forward", "backward", "optimizer"):
            if any(e.phase == phase for e in self.timeline):
                handles.append(Patch(color=_PHASE_COLORS[phase], label=f"{phase} (phase)"))
                labels.append(f"{phase} (phase)")
        ax.legend(handles, labels, loc="upper left", fontsize=7, ncol=2)
        ax.set_xlabel("event (storage born, freed, resized, or taken/released by autograd)")
        ax.set_ylabel(f"live bytes on {self.device} (MiB)")
        ax.set_title(title or "memtrim timeline")
        ax.set_xlim(0, max(n, 1))
        ax.set_ylim(0, self.peak_bytes / mib * 1.25 or 1)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)

    def __str__(self) -> str:
        where = [self.peak_phase]
        if self.peak_module:
            where.append(f"module {self.peak_module}")
        if self.peak_op:
            where.append(f"op {self.peak_op}")
        lines = [
            f"memtrim memory report ({self.device})",
            f"peak {format_bytes(self.peak_bytes)} ({self.peak_bytes:,} B) in " + ", ".join(where),
            f"{'category':<16}{'at peak':>16}{'final':>16}",
        ]
        for name in CATEGORIES:
            lines.append(
                f"{name:<16}{format_bytes(self.peak_by_category[name]):>16}"
                f"{format_bytes(self.final_by_category[name]):>16}"
            )
        lines.append(f"{'total':<16}{format_bytes(self.peak_bytes):>16}{format_bytes(self.final_bytes):>16}")
        if self.allocator_peak_allocated_bytes is not None:
            lines.append(
                f"CUDA allocator peaks: allocated {format_bytes(self.allocator_peak_allocated_bytes)}, "
                f"reserved {format_bytes(self.allocator_peak_reserved_bytes or 0)}"
            )
        return "\n".join(lines)

"""``memtrim demo``'s results: small typed records, written to results.json and rendered as report.md.

Each record holds measured values only (bytes, seconds, verdicts from the library); the markdown reads fields,
never display strings. Fields marked ``_NOT_IN_JSON`` label a row in report.md and stay out of results.json.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_NOT_IN_JSON = {"json": False}

# The seed notebook's timing of its own "optimizer step inside backward" recipe (one Adam per parameter stepped from
# a post-accumulate-grad hook) against standard Adam on its Linear 50-50-50-1 network: 3.33 s vs 1.71 s. Quoted from
# the seed article (see FIELD_NOTES, "Optimizer step inside backward"), not measured here.
SEED_PER_PARAMETER_ADAM_SECONDS = (3.33, 1.71)
SEED_PER_PARAMETER_ADAM_SLOWDOWN = 1.95


def to_json(record: Any) -> Any:
    """A record as JSON-ready data: dataclasses as dicts (without their ``_NOT_IN_JSON`` fields), recursively."""
    if dataclasses.is_dataclass(record) and not isinstance(record, type):
        data = {f.name: to_json(getattr(record, f.name)) for f in dataclasses.fields(record)
                if f.metadata.get("json", True)}
        return {**data, **to_json(getattr(record, "extra_json", {}))}
    if isinstance(record, dict):
        return {key: to_json(value) for key, value in record.items()}
    if isinstance(record, (list, tuple)):
        return [to_json(value) for value in record]
    return record


@dataclass(frozen=True)
class Machine:
    platform: str
    processor: str
    torch: str
    memtrim: str
    device: str


@dataclass(frozen=True)
class Settings:
    epochs: int
    batch_size: int
    seed: int
    data: str
    quick: bool


@dataclass(frozen=True)
class OpBytes:
    """``memtrim.op_memory`` of one op."""

    allocated_bytes: int
    peak_bytes: int
    allocator_allocated_bytes: int | None
    allocator_peak_bytes: int | None


@dataclass(frozen=True)
class ReluOp:
    """Section 1: ``torch.relu`` vs ``torch.relu_`` on one square tensor (results.json lists each op by name)."""

    shape: list[int]
    input_bytes: int
    ops: dict[str, OpBytes] = field(metadata=_NOT_IN_JSON)

    @property
    def extra_json(self) -> dict[str, OpBytes]:
        return self.ops


@dataclass(frozen=True)
class TrainingRun:
    """Section 2: one training run of the seed MLP; memory from its first two steps (one where there is one)."""

    label: str = field(metadata=_NOT_IN_JSON)
    inplace: bool
    loss_per_epoch: list[float]
    test_accuracy_per_epoch: list[float | None]
    seconds_per_epoch: list[float]
    memory: dict[str, Any]  # MemoryReport.to_dict(timeline=False)
    activations_at_backward_start: int
    forward_new_bytes: int  # MemoryReport.forward_transient_peak
    timeline_png: str
    tracked_steps: int = 2  # (one where the first epoch has one batch)


@dataclass(frozen=True)
class Equivalence:
    """Section 3: whether the ReLU and in-place ReLU runs stayed equal."""

    losses_equal: bool
    final_parameters_bitwise_equal: bool
    verify: str
    verify_ok: bool
    verify_bitwise: bool
    verify_steps: int


@dataclass(frozen=True)
class Timing:
    seconds: float
    ratio: float  # to standard Adam's seconds


@dataclass(frozen=True)
class StepMemory:
    """One tracked Adam step of the seed MLP, standard or in backward."""

    peak_bytes: int
    peak_phase: str
    peak_gradients: int
    largest_bucket_bytes: int | None


@dataclass(frozen=True)
class InBackward:
    """Section 4: the optimizer step inside backward: equality, timing and memory."""

    verify: str
    verify_bitwise: bool
    verify_steps: int
    steps_timed: int
    timing: dict[str, Timing]
    memory: dict[str, StepMemory]  # "standard", "in backward"


@dataclass(frozen=True)
class InplaceResult:
    """Section 5: ``memtrim.check_inplace`` of one function against its reference."""

    reference: str = field(metadata=_NOT_IN_JSON)
    ok: bool
    problems: list[str]
    verdict: str
    activation_bytes: int | None
    reference_activation_bytes: int
    peak_bytes: int | None
    reference_peak_bytes: int


@dataclass(frozen=True)
class Converted:
    """Section 6: ``memtrim.convert`` of one workload: activation bytes before and after, what changed, why not."""

    before: int
    after: int
    changes: list[str]
    skipped: list[str]


@dataclass(frozen=True)
class Reversible:
    """Section 7: the seed MLP's hidden layers as a reversible stack."""

    verify: str
    verify_ok: bool
    depths: list[int]
    curve: dict[str, list[int]]  # "plain", "reversible" -> activation bytes kept after forward, per depth
    drift: dict[str, float]  # stack -> largest relative reconstruction error
    depth: int  # of the verified stack
    steps: int = 10  # verified SGD steps


@dataclass(frozen=True)
class Planned:
    """Section 8: ``memtrim.plan`` for a budget below the plain step's peak, and the chosen plan measured."""

    workload: str
    budget: int
    plans: list[dict[str, object]]  # name, predicted peak, phase, time ratio, numerics, fits
    chosen: str
    predicted: int
    measured: int  # the chosen plan's step, run for real and measured by the tracker


@dataclass(frozen=True)
class DemoResults:
    machine: Machine
    settings: Settings
    relu_op: ReluOp
    runs: dict[str, TrainingRun]  # "nn.ReLU()", "nn.ReLU(inplace=True)"
    equivalence: Equivalence
    optimizer_in_backward: InBackward
    check_inplace: dict[str, InplaceResult]
    convert: dict[str, Converted]
    reversible: Reversible
    plan: Planned

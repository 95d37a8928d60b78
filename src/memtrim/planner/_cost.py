"""The time model: a step costs ``flops / F + moved_bytes / B`` seconds, with ``F`` and ``B`` per device.

The constants are rough peak-like figures per device type; :func:`calibrate` replaces them with two measured
micro-benchmarks (a matmul and an elementwise add) on a device that is present. A plan's time is quoted as a ratio to
the plain step traced the same way, so only the balance of F and B matters, not their absolute values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import InvalidInputError
from ._trace import Work


@dataclass(frozen=True)
class DeviceCost:
    """Throughput of a device: ``flops_per_s`` (matmul-bound work) and ``bytes_per_s`` (memory-bound work)."""

    name: str
    flops_per_s: float
    bytes_per_s: float
    calibrated: bool = False

    def seconds(self, flops: int, moved_bytes: int) -> float:
        """The modelled time of work that does ``flops`` and reads/writes ``moved_bytes``."""
        return flops / self.flops_per_s + moved_bytes / self.bytes_per_s

    def step_seconds(self, work: Work) -> float:
        """The modelled time of a step's :class:`Work`: device work here, host work at the host's default
        throughput, copies between them at ``HOST_LINK_BYTES_PER_S`` (not overlapped: an upper bound)."""
        host = _DEFAULTS["cpu"]
        return (self.seconds(work.flops, work.moved) + host.seconds(work.host_flops, work.host_moved)
                + work.transferred / HOST_LINK_BYTES_PER_S)


HOST_LINK_BYTES_PER_S = 2.5e10
"""Host-device copy bandwidth of the time model (PCIe 4.0 x16, about what pinned copies reach)."""

_DEFAULTS = {
    "cpu": DeviceCost("cpu", 5e10, 1e10),
    "cuda": DeviceCost("cuda", 4e14, 2.5e12),
}


def device_cost(device: str | torch.device) -> DeviceCost:
    """The default :class:`DeviceCost` of a device type (``cpu``, ``cuda``; others are modelled as ``cuda``)."""
    kind = torch.device(device).type
    return _DEFAULTS.get(kind, _DEFAULTS["cuda"])


def _time(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(device: str | torch.device, *, size: int = 1024) -> DeviceCost:
    """Measure F (a ``size``x``size`` matmul) and B (an add over 16M floats) on ``device``, which must be present.

    Raises:
        InvalidInputError: ``device`` is not available here.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"memtrim.plan: cannot calibrate on {dev}: no CUDA device here. Use calibrate=False.")
    if dev.type == "meta":
        raise InvalidInputError("memtrim.plan: cannot calibrate on the meta device. Use calibrate=False.")

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    a = torch.randn(size, size, device=dev)
    b = torch.randn(size, size, device=dev)
    x = torch.randn(1 << 24, device=dev)
    y = torch.empty_like(x)
    torch.mm(a, b)
    mm = _time(lambda: torch.mm(a, b), 5, sync)
    add = _time(lambda: torch.add(x, 1.0, out=y), 5, sync)
    return DeviceCost(dev.type, 2 * size**3 / mm, 2 * x.numel() * x.element_size() / add, calibrated=True)

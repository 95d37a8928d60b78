"""Plans traced side by side in forked worker processes.

NOTE [ tracing plans in parallel ]
Every plan is an independent trace: its own ``FakeTensorMode``, its own copy of the model, the same inputs, nothing
shared but read-only Python objects. Tracing is Python-bound (the fake tensors' dispatch), so one process uses one
core; :class:`Tracer` spreads the plans over worker processes and gives the results back in the order asked, the
same estimates as tracing them in turn (a test compares).

The workers are forked: the model, its factory, the loss and the optimizer factory are often lambdas or closures
that do not pickle, and a forked child inherits them. Only the combination (a tuple of names) goes to a worker, and
only the estimate (dicts, ints, strings) or the failure's kind and message comes back. Forking is used only where it
is safe: on Linux, with CUDA not initialised in this process (a forked child cannot use it), and with no other
Python thread running (a lock held by another thread at the fork stays held in the child; tqdm's monitor thread
excepted, whose lock a child never takes), in a process allowed children (not a daemon). Elsewhere, where a child
cannot run a backward (a torch whose autograd engine started its device threads before the fork refuses it), with
``workers=1``, or for two plans or fewer, the plans are traced in turn in this process; and if a worker dies (killed
for memory, a crash in a kernel) the remaining plans are traced in turn here too, as they would have been without
workers. Workers run torch on one thread (the values a trace computes are small, and ATen then never enters OpenMP
in the child), which is why the warning Python 3.12 gives for a fork beside torch's idle OpenMP threads is silenced.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from ._techniques import NotApplicable

__all__ = ["Failed", "Tracer", "default_workers", "fork_is_safe"]

Combo = tuple[str, ...]

_JOB: dict[str, Callable[[Combo], Any]] = {}  # set in the parent just before the fork; read by the children


class Failed:
    """A trace that raised: whether it was the technique's own ``NotApplicable``, the exception's class
    name and its message on one line."""

    __slots__ = ("not_applicable", "kind", "message")

    def __init__(self, not_applicable: bool, kind: str, message: str) -> None:
        self.not_applicable, self.kind, self.message = not_applicable, kind, message


def default_workers() -> int:
    """The CPUs this process may run on (at most 8)."""
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        available = os.cpu_count() or 1
    return max(1, min(8, available))


def _other_threads() -> int:
    # tqdm's monitor wakes every few seconds to look at its bars; a child never draws one, so it may hold its lock
    return sum(1 for t in threading.enumerate() if t is not threading.main_thread() and type(t).__name__ != "TMonitor")


def fork_is_safe() -> bool:
    """Whether :class:`Tracer` may fork workers here (NOTE [ tracing plans in parallel ])."""
    return (sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()
            and not torch.cuda.is_initialized() and _other_threads() == 0
            and not multiprocessing.current_process().daemon)  # a daemon process may not have children


def _start_worker() -> None:
    torch.set_num_threads(1)


def _autograd_runs() -> bool:
    """Whether a backward runs in this (forked) process: torch builds whose autograd engine started its device
    threads in the parent refuse every backward in a forked child ("Unable to handle autograd's threading in
    combination with fork-based multiprocessing"; seen with torch 2.11's CUDA build after one backward, on a machine
    without a GPU)."""
    try:
        torch.ones(1, requires_grad=True).sum().backward()
    except RuntimeError:
        return False
    return True


def _outcome(estimate: Callable[[Combo], Any], combo: Combo) -> tuple[Combo, Any]:
    try:
        return combo, estimate(combo)
    except NotApplicable as e:
        return combo, Failed(True, type(e).__name__, str(e))
    except Exception as e:  # said in the plan's notes
        return combo, Failed(False, type(e).__name__, " ".join(str(e).split()))


def _load_fake_tensors() -> None:
    """Import what a fake trace imports, once, here: the first ``FakeTensorMode`` imports torch._dynamo and sympy
    (about 2 s), which every forked worker would otherwise import again at its first trace. Imports start no thread."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode()


def _trace(combo: Combo) -> tuple[Combo, Any]:
    return _outcome(_JOB["estimate"], combo)


class Tracer:
    """Traces combinations with ``estimate(combo)``, in worker processes where that is safe (NOTE [ tracing plans in
    parallel ]); a context manager that stops them on exit."""

    def __init__(self, estimate: Callable[[Combo], Any], workers: int, expected: int) -> None:
        self.estimate = estimate
        self._pool: ProcessPoolExecutor | None = None
        self.workers = min(workers, expected)
        if self.workers > 1 and expected > 2 and fork_is_safe():
            _JOB["estimate"] = estimate
            _load_fake_tensors()
            try:
                with warnings.catch_warnings():  # Python >= 3.12 warns of torch's own idle OpenMP threads
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pool = ProcessPoolExecutor(self.workers, multiprocessing.get_context("fork"),
                                               initializer=_start_worker)
                    # forks every worker now, before this process starts any thread, and asks one for a backward
                    runs = pool.submit(_autograd_runs).result()
                if runs:
                    self._pool = pool
                else:  # the children inherited an autograd that refuses them: trace in turn here
                    pool.shutdown(wait=True)
            except (OSError, RuntimeError, BrokenProcessPool):  # no process to be had: trace in turn
                self._pool = None
            finally:
                _JOB.clear()  # the children have their copy; the parent keeps no reference to the model

    @property
    def parallel(self) -> bool:
        """Whether worker processes trace the plans."""
        return self._pool is not None

    def map(self, combos: Iterable[Combo]) -> Iterator[tuple[Combo, Any]]:
        """``(combo, estimate or Failed)`` for each combination, in the order given. A worker that dies (killed for
        memory, a crash in a kernel) stops the workers, and the rest is traced here in turn, as without them."""
        pending = list(combos)
        if self._pool is not None:
            try:
                for outcome in self._pool.map(_trace, pending):
                    pending.pop(0)
                    yield outcome
            except BrokenProcessPool:
                self.close()
        for combo in pending:
            yield _outcome(self.estimate, combo)

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> Tracer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

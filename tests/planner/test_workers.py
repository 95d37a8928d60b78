"""Plans traced in forked worker processes (NOTE [ tracing plans in parallel ]): the results of tracing in turn, in
the order asked, and a worker that dies leaves the rest to be traced here."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from memtrim.planner._techniques import NotApplicable
from memtrim.planner._workers import Failed, Tracer

from ..helpers import workers_can_fork

PARENT = os.getpid()
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked only on Linux")


@pytest.fixture
def one_thread():
    """Workers are forked only with no other Python thread, and used only where a forked child can run a backward: an
    earlier test in this process may have left a thread, or run a backward that makes torch 2.11's CUDA build refuse
    one in a child, so these tests then run in a fresh interpreter instead."""
    if not workers_can_fork():
        pytest.skip("another thread runs here, or a forked child cannot run a backward: run by "
                    "test_in_a_fresh_interpreter")


def test_in_a_fresh_interpreter():
    # the tests below, in a process with one thread whatever ran before in this one
    if workers_can_fork():
        pytest.skip("ran here directly")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout, result.stdout


def _estimate(combo):
    if combo == ("dies",) and os.getpid() != PARENT:
        os.kill(os.getpid(), signal.SIGKILL)  # killed for memory, say
    if combo == ("nothing to do",):
        raise NotApplicable("no block")
    if combo == ("raises",):
        raise KeyError("boom")
    return ("traced in", "parent" if os.getpid() == PARENT else "worker", combo)


def test_outcomes_come_in_the_order_asked_from_the_workers(one_thread):
    combos = [(str(i),) for i in range(6)] + [("nothing to do",), ("raises",)]
    with Tracer(_estimate, workers=2, expected=len(combos)) as tracer:
        assert tracer.parallel
        outcomes = list(tracer.map(combos))
    assert [c for c, _ in outcomes] == combos
    assert all(o == ("traced in", "worker", c) for c, o in outcomes[:6])
    failed = [o for _, o in outcomes[6:]]
    assert all(isinstance(o, Failed) for o in failed)
    assert (failed[0].not_applicable, failed[0].message) == (True, "no block")
    assert (failed[1].not_applicable, failed[1].kind) == (False, "KeyError")


def test_a_worker_that_dies_leaves_the_rest_to_this_process(one_thread):
    combos = [("a",), ("dies",), ("b",), ("c",)]
    with Tracer(_estimate, workers=2, expected=len(combos)) as tracer:
        outcomes = dict(tracer.map(combos))
        assert not tracer.parallel  # stopped
    assert list(outcomes) == combos
    assert outcomes[("dies",)] == ("traced in", "parent", ("dies",))
    assert outcomes[("c",)][1] == "parent"


def test_one_worker_or_two_plans_trace_here(one_thread):
    for workers, expected in ((1, 8), (4, 2)):
        with Tracer(_estimate, workers=workers, expected=expected) as tracer:
            assert not tracer.parallel
            assert list(tracer.map([("a",)])) == [(("a",), ("traced in", "parent", ("a",)))]


def test_children_that_cannot_run_a_backward_leave_every_plan_to_this_process(one_thread, monkeypatch):
    # torch 2.11's CUDA build, after one backward in the parent, refuses every backward in a forked child: every plan
    # traced there failed and was left out of the plan. Simulated here: autograd refuses in children only.
    backward = torch.autograd.backward

    def refuses_in_children(*args, **kwargs):
        if os.getpid() != PARENT:
            raise RuntimeError("Unable to handle autograd's threading in combination with fork-based multiprocessing")
        return backward(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "backward", refuses_in_children)
    combos = [("a",), ("b",), ("c",)]
    with Tracer(_estimate, workers=2, expected=len(combos)) as tracer:
        assert not tracer.parallel
        assert [o for _, o in tracer.map(combos)] == [("traced in", "parent", c) for c in combos]

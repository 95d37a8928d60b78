"""Plans traced in forked worker processes (NOTE [ tracing plans in parallel ]): the results of tracing in turn, in
the order asked, and a worker that dies leaves the rest to be traced here."""

import os
import signal
import subprocess
import sys

import pytest

from memtrim.planner._techniques import NotApplicable
from memtrim.planner._workers import Failed, Tracer, fork_is_safe

PARENT = os.getpid()
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked only on Linux")


@pytest.fixture
def one_thread():
    """Workers are forked only with no other Python thread: an earlier test in this process may have left one, so
    these tests then run in a fresh interpreter instead."""
    if not fork_is_safe():
        pytest.skip("another thread runs here: run by test_in_a_fresh_interpreter")


def test_in_a_fresh_interpreter():
    # the tests below, in a process with one thread whatever ran before in this one
    if fork_is_safe():
        pytest.skip("ran here directly")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 passed" in result.stdout, result.stdout


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

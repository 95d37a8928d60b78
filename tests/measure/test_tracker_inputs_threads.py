"""Inputs passed by keyword, and trackers in several threads (issue 10, item 13)."""

import threading

import pytest
import torch
import torch.autograd.function as autograd_function
import torch.nn.functional as F

import memtrim
from memtrim.measure.hooks import top_saved_tensors_hooks


class MaskedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x, mask=None):
        return self.lin(x) * mask


def _report_of(call):
    torch.manual_seed(0)
    model = MaskedHead()
    x, mask = torch.randn(16, 8), torch.ones(16, 4)
    with memtrim.track(model) as tracker:
        out = call(model, x, mask)
        out.sum().backward()
        del out
    return tracker.report(), x, mask


@pytest.mark.parametrize("call", [
    lambda m, x, mask: m(x=x, mask=mask),
    lambda m, x, mask: m(**{"x": x, "mask": mask}),
    lambda m, x, mask: m(x, mask=mask),
], ids=["keywords", "double-star", "mixed"])
def test_keyword_arguments_are_inputs(call):
    positional, _, _ = _report_of(lambda m, x, mask: m(x, mask))
    report, x, mask = _report_of(call)
    assert report.peak_by_category["inputs"] == x.nbytes + mask.nbytes == 512 + 256
    assert report.peak_by_category == positional.peak_by_category
    assert report.final_by_category == positional.final_by_category


def _no_hooks_left() -> None:
    assert top_saved_tensors_hooks() is None
    assert "__setattr__" not in autograd_function.FunctionCtx.__dict__
    assert "resize_" not in torch.UntypedStorage.__dict__


def _step_report(width: int, steps: int, between=lambda: None):
    """A tracked Adam training loop; ``between`` runs between steps (where another thread does its work)."""
    torch.manual_seed(width)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(32, width), torch.randint(0, 2, (32,))
    with memtrim.track(model, optimizer) as tracker:
        between()
        for _ in range(steps):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            del loss
            between()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            between()
    report = tracker.report()
    return report, [(e.kind, e.op, e.phase, e.module, e.delta_bytes, e.category) for e in report.timeline]


def _in_threads(*targets):
    """Run each target in its own thread; re-raise the first error here."""
    errors = []

    def wrap(target):
        def run():
            try:
                target()
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                errors.append(e)
        return run

    threads = [threading.Thread(target=wrap(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    if errors:
        raise errors[0]


@pytest.mark.parametrize("first_out", [0, 1])
def test_two_threads_each_measure_their_own_work(first_out):
    """Two trackers, each in its own thread, active at the same time and stepping in lockstep: each report equals
    the one its thread gets alone, and no hooks are left behind whichever thread finishes first."""
    widths = (64, 48)
    alone = [_step_report(w, 3) for w in widths]
    barrier = threading.Barrier(2, timeout=30)
    done = threading.Event()
    results = {}

    def worker(i):
        def run():
            def between():
                barrier.wait()  # both trackers are active; the threads alternate at every step boundary

            results[i] = _step_report(widths[i], 3, between)
            if i == first_out:
                done.set()
            else:
                done.wait(30)  # exit only after the other thread's tracker has stopped
        return run

    _in_threads(worker(0), worker(1))
    for i in range(2):
        assert results[i][0].peak_by_category == alone[i][0].peak_by_category
        assert results[i][0].peak_bytes == alone[i][0].peak_bytes
        assert results[i][1] == alone[i][1]
    _no_hooks_left()


def test_untracked_thread_does_not_leak_into_a_tracker():
    """Another thread that runs modules and an optimizer while a tracker is active: none of its modules,
    parameters or optimizer state show up in the tracker's report."""
    alone = _step_report(64, 2)
    started, finished = threading.Event(), threading.Event()

    def other():
        started.wait(30)
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 3))
        optimizer = torch.optim.Adam(model.parameters())
        for _ in range(2):
            model(torch.randn(8, 100)).sum().backward()
            optimizer.step()
        finished.set()

    results = {}

    def tracked():
        def between():
            if not started.is_set():
                started.set()
                finished.wait(30)  # the other thread does all its work while this tracker is active

        results["tracked"] = _step_report(64, 2, between)

    _in_threads(tracked, other)
    report, timeline = results["tracked"]
    assert report.peak_by_category == alone[0].peak_by_category
    assert timeline == alone[1]
    _no_hooks_left()


def test_tracker_in_a_thread_leaves_no_hooks_on_error():
    def run():
        model = torch.nn.Linear(4, 4)
        with memtrim.track(model):
            model(torch.randn(2, 5))

    with pytest.raises(RuntimeError):
        _in_threads(run)
    _no_hooks_left()


def test_model_copied_or_saved_inside_the_block(tmp_path):
    """The inputs hook the tracker puts on the model neither drags the tracker into a deep copy nor breaks
    pickling the whole model."""
    import copy

    model = MaskedHead()
    with memtrim.track(model) as tracker:
        twin = copy.deepcopy(model)
        torch.save(model, tmp_path / "model.pt")
        out = twin(torch.randn(2, 8), mask=torch.ones(2, 4))
    assert out.shape == (2, 4)
    assert tracker.report().peak_by_category["inputs"] == 0  # the twin is not the tracked model
    assert not model._forward_pre_hooks  # removed at exit

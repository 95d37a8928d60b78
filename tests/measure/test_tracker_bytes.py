"""Exact bytes for known allocations, views, in-place ops, dtypes, frees, resizes, nesting and repeats."""

import gc
import weakref

import pytest
import torch

import memtrim
from memtrim.measure.hooks import top_saved_tensors_hooks


def total(tracker):
    return sum(tracker.report().final_by_category.values())


def test_known_allocations_exact():
    with memtrim.track() as tracker:
        a = torch.empty(1000)  # 4000 B
        b = torch.zeros(10, 10, dtype=torch.float64)  # 800 B
        c = torch.ones(7, dtype=torch.float16)  # 14 B
        d = torch.arange(5)  # int64: 40 B
    report = tracker.report()
    assert report.final_by_category["temporaries"] == 4000 + 800 + 14 + 40
    assert report.peak_bytes == 4854
    del a, b, c, d


def test_views_count_once():
    with memtrim.track() as tracker:
        a = torch.empty(100, 100)
        views = [a[1:], a.t(), a.view(-1), a[:, 3], a.reshape(10000)]
    assert total(tracker) == 40_000
    assert tracker.report().peak_bytes == 40_000
    del views, a


def test_inplace_ops_allocate_nothing():
    a = torch.randn(1000)
    with memtrim.track() as tracker:
        a.add_(1)
        a.relu_()
        a.mul_(2)
    report = tracker.report()
    assert report.peak_bytes == 4000  # only the pre-existing tensor, counted from the start
    assert report.final_by_category["other"] == 4000
    assert all(e.kind in ("start",) for e in report.timeline)


def test_freed_inside_block_counts_in_peak_not_final():
    with memtrim.track() as tracker:
        keep = torch.empty(250)  # 1000 B
        tmp = torch.empty(500, dtype=torch.float64)  # 4000 B
        del tmp
    report = tracker.report()
    assert report.peak_bytes == 5000
    assert report.final_by_category["temporaries"] == 1000
    kinds = [e.kind for e in report.timeline]
    assert kinds == ["start", "alloc", "alloc", "free"]
    del keep


def test_intermediates_of_an_expression():
    x = torch.randn(1000)
    with memtrim.track() as tracker:
        y = (x * 2 + 1).sum()  # two 4000 B intermediates alive one after the other at most
    report = tracker.report()
    start = report.timeline[0].total_bytes
    assert start == 4000
    assert report.peak_bytes - start == 8000  # x*2 alive while (x*2)+1 is born
    assert report.final_bytes - start == 4  # the scalar sum
    del y


def test_storage_resize_is_counted():
    with memtrim.track() as tracker:
        a = torch.empty(100)  # 400 B
        a.untyped_storage().resize_(0)  # what memcnn does to free an input
        mid = tracker.live_bytes()
        a.resize_(1000)  # aten.resize_ through the dispatcher: 4000 B
    assert mid == 0
    report = tracker.report()
    assert report.final_bytes == 4000
    assert report.peak_bytes == 4000
    assert [e.kind for e in report.timeline] == ["start", "alloc", "resize", "resize"]
    del a


def test_peak_is_per_tracker():
    with memtrim.track() as first:
        big = torch.empty(10_000)
        del big
    with memtrim.track() as second:
        small = torch.empty(10)
    assert first.report().peak_bytes == 40_000
    assert second.report().peak_bytes == 40
    del small


def test_nested_trackers_both_exact():
    with memtrim.track() as outer:
        a = torch.empty(1000)
        with memtrim.track() as inner:
            b = torch.empty(500)
            c = torch.empty(2000)
            del c
        d = torch.empty(10)
    assert inner.report().peak_bytes == 2000 + 8000
    assert inner.report().final_by_category["temporaries"] == 2000
    assert outer.report().peak_bytes == 4000 + 2000 + 8000
    assert outer.report().final_bytes == 4000 + 2000 + 40
    del a, b, d


def test_holds_no_strong_reference():
    with memtrim.track() as tracker:
        a = torch.empty(1000)
        ref = weakref.ref(a)
        storage_ref = weakref.ref(a.untyped_storage())
    del a
    gc.collect()
    assert ref() is None and storage_ref() is None
    assert tracker.report().peak_bytes == 4000


def test_tracker_is_single_use():
    tracker = memtrim.track()
    with tracker:
        pass
    with pytest.raises(memtrim.MemtrimStateError, match="already used"), tracker:
        pass


def test_meta_tensors_counted_by_size():
    with memtrim.track() as tracker:
        a = torch.empty(1 << 30, device="meta")  # 4 GiB, never allocated
    assert tracker.report(device="meta").final_bytes == 4 << 30
    assert tracker.report().device == "meta"
    del a


def test_leaves_no_hooks_behind_even_on_error():
    import torch.autograd.function as autograd_function

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    try:
        with memtrim.track(model):
            model(torch.randn(2, 5))  # wrong width: raises inside the model's forward
    except RuntimeError:
        pass
    else:
        raise AssertionError("the shape error should propagate")
    assert top_saved_tensors_hooks() is None
    assert "__setattr__" not in autograd_function.FunctionCtx.__dict__
    assert "resize_" not in torch.UntypedStorage.__dict__
    # and a later tracker starts clean
    with memtrim.track(model) as tracker:
        model(torch.randn(2, 4))
    assert {e.module for e in tracker.report().timeline if e.phase == "forward"} >= {"0"}

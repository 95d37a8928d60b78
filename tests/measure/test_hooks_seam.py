"""The seam techniques report to (memtrim.measure.hooks) and Tracker.label, asserted in bytes."""

import gc

import pytest
import torch

import memtrim
from memtrim.measure import hooks


def test_label_accounts_what_code_knows():
    batch = torch.randn(64, 16)
    with memtrim.track() as tracker:
        tracker.label({"x": batch, "mask": [batch[:1]]}, memtrim.Category.INPUTS)
        mask = torch.ones(8)  # born inside the tracker: a temporary until labelled
        tracker.label(mask, "inputs")  # the plain string is the same category
        live = tracker.live_by_category()
    assert live["inputs"] == batch.nbytes + mask.nbytes and live["temporaries"] == 0


@pytest.mark.parametrize("category", ["activations", "temporaries", "other", "weights"])
def test_label_refuses_what_the_tracker_decides(category):
    with memtrim.track() as tracker, pytest.raises(memtrim.InvalidInputError, match="Tracker.label"):
        tracker.label(torch.ones(2), category)


def test_hold_for_backward_counts_activations_until_the_owner_dies():
    class Owner:
        pass

    owner = Owner()
    with memtrim.track() as tracker:
        kept = torch.randn(256)
        hooks.hold_for_backward([kept], owner)
        held = tracker.live_by_category()["activations"]
        del owner
        gc.collect()
        released = tracker.live_by_category()["activations"]
    assert (held, released) == (kept.nbytes, 0)


def test_note_gradients_and_nothing_without_a_tracker():
    grad = torch.randn(32)
    hooks.note_gradients([grad])  # no tracker: nothing to tell, nothing raised
    hooks.hold_for_backward(grad, torch.nn.Linear(1, 1))
    assert hooks.active() == () and hooks.current() == ()
    with memtrim.track() as tracker:
        assert hooks.current() == (tracker,) and hooks.active() == (tracker,)
        hooks.note_gradients([grad])
        assert tracker.live_by_category()["gradients"] == grad.nbytes


def test_category_is_a_str_enum_of_the_report_keys():
    assert tuple(memtrim.Category) == memtrim.CATEGORIES
    assert all(type(name) is str for name in memtrim.CATEGORIES)
    assert f"{memtrim.Category.OPTIMIZER_STATE}" == "optimizer_state"
    with memtrim.track() as tracker:
        torch.ones(4)
    assert all(type(name) is str for name in tracker.report().final_by_category)

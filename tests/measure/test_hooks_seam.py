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


_MIRROR_SCRIPT = r"""
import json, sys
import torch
if sys.argv[1] == "mirror":  # torch before 2.8 has no getter for the saved-tensor hooks on top
    del torch._C._autograd._top_saved_tensors_default_hooks
import torch.nn.functional as F
import memtrim
from memtrim.measure import hooks
from memtrim.models import GPTConfig, SmallGPT

assert (hooks._TOP_HOOKS is None) == (sys.argv[1] == "mirror")
torch.manual_seed(0)
model = SmallGPT(GPTConfig(vocab_size=32, seq_len=8, n_layer=2, n_head=2, d_model=16)).double()
x = torch.randint(0, 32, (2, 8))
model, report = memtrim.convert(model, example_inputs=x)
optimizer = torch.optim.AdamW(model.parameters())
out = {"changes": [c.rule for c in report.changes], "saved": report.bytes_saved}
for outer in (False, True):  # a tracker inside a user's own checkpoint of the whole step's forward
    with memtrim.track(model, optimizer) as tracker:
        if outer:
            logits = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
        else:
            logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), x.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()
    r = tracker.report()
    out[str(outer)] = [r.peak_bytes, dict(r.peak_by_category)]
out["weights"] = [p.sum().item() for p in model.parameters()]
print(json.dumps(out))
"""


def test_before_torch_2_8_the_saved_tensor_hooks_on_top_are_mirrored():
    # torch 2.4 to 2.7 cannot read the hooks on top: without the mirror, tracking, convert and checkpointing failed
    # there with an AttributeError. Here the getter is taken away and the same script must give the same numbers.
    import json
    import subprocess
    import sys

    if not hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks"):
        pytest.skip("this torch has no getter: every test here runs on the mirror")
    runs = [subprocess.Popen([sys.executable, "-c", _MIRROR_SCRIPT, how], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for how in ("getter", "mirror")]  # side by side
    outputs = [run.communicate(timeout=300) for run in runs]
    for run, (_, err) in zip(runs, outputs):
        assert run.returncode == 0, err
    getter, mirror = (json.loads(out) for out, _ in outputs)
    assert getter["changes"] and getter["saved"] > 0
    assert mirror == getter

"""memtrim.plan under torch.distributed: 2 gloo processes on CPU."""

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import memtrim

from ..distributed import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="gloo file rendezvous")


def _body(rank):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    try:
        memtrim.plan(model, x, F.cross_entropy, lambda m: torch.optim.AdamW(m.parameters()), targets=y,
                     budget=1 << 30)
    except memtrim.InvalidInputError as e:
        refused = str(e)
    else:
        refused = ""
    plans = memtrim.plan(model.module, x, F.cross_entropy, lambda m: torch.optim.AdamW(m.parameters()), targets=y,
                         budget=1 << 30)
    return {"refused": refused, "plans": len(plans)}


def test_a_ddp_model_is_refused_naming_its_module():
    # found by an adversarial pass: the fake-tensor trace failed on DDP's buffers, and the message blamed the step
    for result in spawn(_body):
        assert "wrapped in DistributedDataParallel" in result["refused"]
        assert "memtrim.plan(ddp_model.module, ...)" in result["refused"]
        assert result["plans"] >= 1

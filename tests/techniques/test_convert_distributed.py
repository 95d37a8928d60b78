"""memtrim.convert under torch.distributed: 2 gloo processes on CPU."""

import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

import memtrim

from ..distributed import spawn

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
              pytest.mark.skipif(sys.platform == "win32", reason="gloo file rendezvous")]


class _LoadBalanced(nn.Module):
    """A LayerNorm -> Linear (a change convert makes) and a global statistic all-reduced in the forward (an MoE's
    expert load)."""

    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        load = (x > 0).sum().float()
        dist.all_reduce(load)
        return self.fc(self.norm(x)) * (load / load)


def _collectives_body(rank):
    torch.manual_seed(0)
    model = _LoadBalanced()
    g = torch.Generator().manual_seed(rank)  # each rank converts on its own batch
    try:
        memtrim.convert(model, example_inputs=torch.randn(8, 16, generator=g))
    except memtrim.InvalidInputError as e:
        refused = str(e)
    else:
        refused = ""
    plain = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 4))  # no collective: converts under the process group
    _, report = memtrim.convert(plain, example_inputs=torch.randn(8, 16, generator=g))
    # a DDP model broadcasts its buffers in its forward: the message names the module inside, which converts
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)))
    images = torch.randn(2, 3, 8, 8, generator=g)
    try:
        memtrim.convert(ddp, example_inputs=images)
    except memtrim.InvalidInputError as e:
        refused_ddp = str(e)
    else:
        refused_ddp = ""
    _, inside = memtrim.convert(ddp.module, example_inputs=images)
    return {"refused": refused, "changes": len(report.changes), "classes": [type(m).__name__ for m in model.modules()],
            "refused_ddp": refused_ddp, "changes_inside": len(inside.changes)}


def test_a_forward_running_collectives_is_refused_on_every_rank():
    # found by an adversarial pass: convert's forwards were 4 on one rank and 5 on the other (their number depends on
    # the example's values), so an MoE's all_reduce paired a convert-time forward with a training one: one rank
    # trained on wrong values, silently, the other failed
    for result in spawn(_collectives_body):
        assert "runs torch.distributed collectives (c10d.allreduce_) across 2 ranks" in result["refused"]
        assert result["classes"] == ["_LoadBalanced", "LayerNorm", "Linear"]  # left as it was
        assert result["changes"] == 1
        assert "convert the module inside it (memtrim.convert(ddp_model.module, ...))" in result["refused_ddp"]
        assert result["changes_inside"] == 1


class _NormLast(nn.Module):
    """A block that ends in a LayerNorm, read by the next block's Linear (BERT's layout)."""

    def __init__(self):
        super().__init__()
        self.fc, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.ln(torch.relu(self.fc(x)) + x)


def _fsdp_body(rank):
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(_NormLast(), _NormLast(), nn.Linear(16, 4))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    _, report = memtrim.convert(model, example_inputs=x[:2])
    for block in model[:2]:
        fully_shard(block)
    fully_shard(model)
    try:
        model(x).square().mean().backward()
    except memtrim.ConvertError as e:
        return {"changes": len(report.changes), "error": str(e)}
    return {"changes": len(report.changes), "error": ""}


@pytest.mark.skipif(tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 5),
                    reason="torch 2.4's FSDP2 makes CUDA streams: it does not run on a CPU")
def test_a_norm_rebuilt_in_a_later_fsdp2_units_backward_raises_naming_the_fix():
    # found by an adversarial pass: FSDP2 frees a unit's parameters after its forward, and the LayerNorm ending one
    # unit was rebuilt in the next unit's backward from its freed weight: torch's bare "data is not allocated yet"
    for result in spawn(_fsdp_body):
        assert result["changes"] >= 1
        assert "rebuilds in backward a tensor it did not keep, from tensors freed" in result["error"]
        assert "reshard_after_forward=False" in result["error"]

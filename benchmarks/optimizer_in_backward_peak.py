"""Peak memory of one training step, standard loop vs OptimizerInBackward, on an activation-heavy conv net
(MobileNetV3-small's shape, BatchNorm) and a parameter-heavy small GPT, measured by memtrim's tracker.

The update inside backward runs while activations are alive: its temporaries (AdamW: about twice the bucket)
can lift the peak of an activation-heavy model. ``peak="never_higher"`` (default) holds such buckets back;
``peak="lowest"`` updates every bucket as soon as it is complete.

Reproduce:  .venv/bin/python benchmarks/optimizer_in_backward_peak.py
Writes benchmarks/results/optimizer_in_backward_peak_cpu.json.
"""

import copy

import torch
import torch.nn.functional as F

import memtrim
from _common import machine, third_step_report, write
from memtrim.models import MobileNetLike, SmallGPT


def cases():
    torch.manual_seed(0)
    yield ("MobileNetV3-small-like conv net, batch 8, 64x64, AdamW", MobileNetLike(),
           torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)), F.cross_entropy)
    torch.manual_seed(0)
    idx = torch.randint(0, 2048, (2, 16))
    yield ("small GPT (2 layers, d=128, seq 16, batch 2, vocab 2048), AdamW",
           SmallGPT(n_layer=2, d_model=128, n_head=4, seq_len=16, vocab_size=2048), idx, idx,
           lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))


VARIANTS = [("standard", None, None)] + [
    (f"OptimizerInBackward(peak={peak!r}, bucket_bytes={bucket})", peak, bucket)
    for peak in ("never_higher", "lowest") for bucket in (0, 1 << 20, 25 << 20)
]


def main():
    results = {}
    for label, base, x, y, loss_fn in cases():
        results[label] = {}
        for name, peak, bucket in VARIANTS:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            if peak is not None:
                opt = memtrim.OptimizerInBackward(opt, model=model, bucket_bytes=bucket, peak=peak)

            def step(model=model, opt=opt, x=x, y=y, loss_fn=loss_fn):
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()

            report = third_step_report(step, model, opt)
            results[label][name] = {"peak_bytes": report.peak_bytes, "peak_phase": report.peak_phase,
                                    "peak_by_category": report.peak_by_category}
            print(f"{label} | {name}: {report.peak_bytes} bytes ({report.peak_phase})")
    path = write("optimizer_in_backward_peak_cpu.json", {"machine": machine(), "results": results})
    print("wrote", path)


if __name__ == "__main__":
    main()

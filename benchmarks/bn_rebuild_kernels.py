"""Whether a converted BatchNorm + ReLU can rebuild its output in one pass, kernel by kernel: the two-pass rebuild runs
the BatchNorm's training forward again (NOTE [ BatchNorm + ReLU, recomputed ] in norms/bn_relu.py), which computes
the batch statistics again (a second read of the input; 8.5 % more GPU kernel time in a converted ResNet's step,
results/convert_cuda_check_cuda.txt). The one-pass rebuild (NOTE [ the one-pass rebuild ]) normalises with the
statistics the forward computed (and its autograd node saved): ``torch.batch_norm_elemt`` on CUDA, the CPU kernel's
arithmetic on the CPU (``bn_relu._one_pass``, the function converted models call). A rebuild must give the forward's
output bit for bit (the next convolution's weight gradient reads it), so this compares, at each shape, the forward's
output with the training kernel run again and with the one-pass rebuild, and times both (and the probe that decides
between them, NOTE [ the one-pass rebuild ]): on CUDA at a ResNet's BatchNorm + ReLU shapes at batch 128, with cuDNN
on and off; on the CPU at a ResNet's shapes at batch 8 and at small ones, contiguous and channels-last, where the
times give the size below which converted models keep the two-pass rebuild (``bn_relu._ONE_PASS_CPU_MIN``).
results/bn_rebuild_kernels_cuda.json was written by this script's first version (a5fb446), which called the one-pass
kernel ``elemt``.

Reproduce:  .venv/bin/python benchmarks/bn_rebuild_kernels.py [--device cpu]   (on an otherwise idle machine)
Writes benchmarks/results/bn_rebuild_kernels_<device>.json.
"""

import argparse
import statistics
import time

import torch

from _common import machine, write
from memtrim.techniques.norms import bn_relu

CUDA_SHAPES = [(128, 64, 112, 112), (128, 64, 56, 56), (128, 128, 28, 28), (128, 256, 14, 14), (128, 512, 7, 7)]
CPU_SHAPES = [(2, 4, 6, 6), (64, 16), (8, 16, 8, 8), (4, 32, 100), (8, 32, 16, 16), (256, 512), (8, 64, 56, 56),
              (8, 128, 28, 28), (8, 256, 14, 14), (8, 512, 7, 7)]


def ms(fn, device: str, repeats: int = 20) -> float:
    """The median milliseconds of ``fn`` (CUDA events on a GPU; on the CPU the clock, over enough calls for 20 ms)."""
    for _ in range(3):
        fn()
    times = []
    if device == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)
    start = time.perf_counter()
    fn()
    calls = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e3)
    return statistics.median(times)


def compare(shape, dtype, cudnn: bool, channels_last: bool, device: str) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, device=device, dtype=dtype, generator=g) * 2 + 0.5
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_()
    w = (torch.rand(shape[1], device=device, dtype=dtype, generator=g) + 0.5).requires_grad_()
    b = torch.randn(shape[1], device=device, dtype=dtype, generator=g).requires_grad_()
    eps = 1e-5
    with torch.backends.cudnn.flags(enabled=cudnn):
        # torch.batch_norm's op, with the batch mean and inverse standard deviation (NOTE [ the one-pass rebuild ])
        out, mean, invstd, _, kernel = torch._batch_norm_impl_index(x, w, b, None, None, True, 0.0, eps, cudnn)
        node = out.grad_fn
        xd, wd, bd = x.detach(), w.detach(), b.detach()
        again = torch.batch_norm(xd, wd, bd, None, None, True, 0.0, eps, cudnn)
        once = bn_relu._one_pass(xd, wd, bd, mean, invstd, eps)
        return {
            "node": type(node).__name__,
            "training_kernel_again_equal": torch.equal(again, out.detach()),
            "one_pass_equal": torch.equal(once, out.detach()),
            "one_pass_mismatches": int((once != out.detach()).sum()),
            "one_pass_max_abs_diff": float((once - out.detach()).abs().max()),
            "ms_training_kernel_again": ms(lambda: torch.batch_norm(xd, wd, bd, None, None, True, 0.0, eps, cudnn),
                                          device),
            "ms_one_pass": ms(lambda: bn_relu._one_pass(xd, wd, bd, mean, invstd, eps), device),
            # what a converted model's first rebuild at this key adds, once (NOTE [ the one-pass rebuild ])
            "probe_equal": bn_relu._same_bits(xd, wd, bd, kernel, False, eps, cudnn),
            "ms_probe": ms(lambda: bn_relu._same_bits(xd, wd, bd, kernel, False, eps, cudnn), device, repeats=5),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = parser.parse_args().device
    rows = []
    cases = ([(s, d, c, False) for d in (torch.float32, torch.float64) for c in (True, False) for s in CUDA_SHAPES]
             if device == "cuda" else
             [(s, d, True, cl) for d in (torch.float32, torch.float64, torch.bfloat16) for s in CPU_SHAPES
              for cl in ((False, True) if len(s) == 4 else (False,))])
    for shape, dtype, cudnn, channels_last in cases:
        row = {"shape": list(shape), "dtype": str(dtype), "cudnn": cudnn, "channels_last": channels_last}
        try:
            row.update(compare(shape, dtype, cudnn, channels_last, device))
        except Exception as e:  # (one path's failure is a result too)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
        print({k: v for k, v in row.items() if not k.startswith("one_pass_m")})
    result = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "one_pass_cpu_min": bn_relu._ONE_PASS_CPU_MIN, "rows": rows}
    print(write(f"bn_rebuild_kernels_{device}.json", result))


if __name__ == "__main__":
    main()

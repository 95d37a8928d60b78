"""Whether a converted BatchNorm + ReLU could rebuild its output on CUDA in one pass: today the rebuild in backward
runs the BatchNorm's training forward again (NOTE [ BatchNorm + ReLU, recomputed ] in norms/bn_relu.py), which
computes the batch statistics again (a second read of the input), and is 8.5 % more GPU kernel time in a converted
ResNet's step (results/convert_cuda_check_cuda.txt). ``torch.batch_norm_elemt`` (the normalisation kernel of torch's
native and SyncBatchNorm paths) normalises with given statistics in one pass; the forward's own statistics are saved
by its autograd node. A rebuild must give the forward's output bit for bit (the next convolution's weight gradient
reads it), so this compares, at the BatchNorm + ReLU shapes of a ResNet at batch 128, the forward's output with the
training kernel run again (the rebuild today) and with ``batch_norm_elemt`` from the saved statistics, and times both.

Reproduce (a CUDA GPU):  python benchmarks/bn_rebuild_kernels.py
Writes benchmarks/results/bn_rebuild_kernels_cuda.json.
"""

import statistics

import torch

from _common import machine, write

SHAPES = [(128, 64, 112, 112), (128, 64, 56, 56), (128, 128, 28, 28), (128, 256, 14, 14), (128, 512, 7, 7)]


def ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def compare(shape, dtype, cudnn: bool) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(shape, device="cuda", dtype=dtype, generator=g) * 2 + 0.5).requires_grad_()
    w = (torch.rand(shape[1], device="cuda", dtype=dtype, generator=g) + 0.5).requires_grad_()
    b = torch.randn(shape[1], device="cuda", dtype=dtype, generator=g).requires_grad_()
    eps = 1e-5
    with torch.backends.cudnn.flags(enabled=cudnn):
        out = torch.batch_norm(x, w, b, None, None, True, 0.0, eps, cudnn)
        node = out.grad_fn
        names = sorted(a for a in dir(node) if a.startswith("_saved_result"))
        # (cuDNN's node: result1 the batch mean, result2 its inverse std, result3 its reserve space)
        saved = [getattr(node, a) for a in names]
        mean, invstd = [t for t in saved if isinstance(t, torch.Tensor) and t.dim() == 1][:2]
        xd, wd, bd = x.detach(), w.detach(), b.detach()
        again = torch.batch_norm(xd, wd, bd, None, None, True, 0.0, eps, cudnn)
        elemt = torch.batch_norm_elemt(xd, wd, bd, mean, invstd, eps)
        found = {
            "node": type(node).__name__,
            "saved_shapes": [list(mean.shape), list(invstd.shape)],
            "training_kernel_again_equal": torch.equal(again, out.detach()),
            "elemt_equal": torch.equal(elemt, out.detach()),
            "elemt_mismatches": int((elemt != out.detach()).sum()),
            "elemt_max_abs_diff": float((elemt - out.detach()).abs().max()),
            "ms_training_kernel_again": ms(lambda: torch.batch_norm(xd, wd, bd, None, None, True, 0.0, eps, cudnn)),
            "ms_elemt": ms(lambda: torch.batch_norm_elemt(xd, wd, bd, mean, invstd, eps)),
        }
    return found


def main() -> None:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (batch_norm_elemt has no CPU kernel)")
        return
    rows = []
    for dtype in (torch.float32, torch.float64):
        for cudnn in (True, False):
            for shape in SHAPES:
                row = {"shape": list(shape), "dtype": str(dtype), "cudnn": cudnn}
                try:
                    row.update(compare(shape, dtype, cudnn))
                except Exception as e:  # (one path's failure is a result too)
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                rows.append(row)
                print({k: v for k, v in row.items() if k != "saved_shapes"})
    print(write("bn_rebuild_kernels_cuda.json", {"machine": machine(), "torch": torch.__version__, "rows": rows}))


if __name__ == "__main__":
    main()

"""Step time of memtrim.convert on the real model libraries of benchmarks/convert_zoo.py: each model and its converted
copy train (forward, backward, AdamW step) in interleaved rounds; the median of the per-round ratios, with quartiles.
Beside the times, a count that needs no clock: the ops one step runs and the bytes their outputs write, plain and
converted (the recompute work convert adds).

Reproduce:  zoovenv/bin/python benchmarks/convert_zoo_time.py [--rounds 15] [--only NAME ...] [--wide]
                [--device cuda] [--batch-mult N] [--dtype bfloat16]
            (the venv that convert_zoo.py's docstring sets up; run on an otherwise idle machine)
Writes benchmarks/results/convert_zoo_time_<device>.json (--wide: convert_zoo_time_wide_<device>.json; ``--dtype
bfloat16``: each model and its batch cast as in convert_zoo.py, written to ..._bfloat16_<device>.json).
``--ops-only`` counts without timing (seconds a model, any machine load): convert_zoo_ops_<device>.json.

On CUDA each row also gives, from the caching allocator, the bytes one training-mode forward leaves allocated and
the step's peak (both above what was allocated before the forward), plain and converted, beside the tracker's held
activations; the times one step makes the host wait for the GPU, and where (``host_syncs_per_step``); the host's
milliseconds in forward, backward and the optimizer step, each phase started on an empty queue
(``host_ms_by_phase``: which phase convert's extra time is in where the GPU waits on the host); and the
largest parameter-gradient difference of one seeded training-mode step against the plain model, with the plain
model against itself as the floor (cuDNN's backward kernels need not be deterministic).
``--batch-mult N`` repeats each batch N times along its first dimension (GPU-sized batches).

``--wide`` times the same libraries' models at the widths people train (d_model 768-1024, 224x224 images), batch 1-2:
convert's recompute work is elementwise, so its share of a step shrinks as matmuls and convolutions grow with width.
The memory figures are those of convert_zoo.py (a fraction of the activations, which does not depend on width here).
"""

import argparse
import collections
import contextlib
import copy
import os
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memtrim
from _common import machine, pin_malloc, quartiles, write
from convert_zoo import MODELS, build, cast, first_tensor, held_activations, import_torchvision, version
from memtrim.measure.hooks import tensors_in


def loss_of(model, batch) -> torch.Tensor:
    """The loss every step here trains on: the mean square of the model's first output, in float32 at least."""
    return first_tensor(model(**batch)).float().square().mean()


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    opt.step()


class _OpBytes(TorchDispatchMode):
    """Counts the ops a step runs and the bytes their outputs write: the recompute work convert adds, without a
    clock (deterministic, unlike the times). Views and other outputs that alias an input (``detach``, ``t``,
    ``_unsafe_view``) write nothing and count 0 B; in-place and ``out=`` ops count what they write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.bytes = 0
        self.names: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        self.names[str(func)] += 1
        if not func.is_view:
            aliased = (set() if func._schema.is_mutable
                       else {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))})
            self.bytes += sum(t.nbytes for t in tensors_in(out) if t.untyped_storage()._cdata not in aliased)
        return out


HOST_WAIT_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.equal", "aten.is_nonzero", "aten.masked_select",
                 "aten._unique2", "aten.unique_consecutive", "aten.repeat_interleave", "aten.bincount")
"""Ops whose result's size or value the host reads: on a GPU, on a GPU tensor, each makes the host wait, which
fails a CUDA graph's capture (``.item()`` runs ``_local_scalar_dense``)."""


def host_wait_ops(model, batch) -> dict:
    """The :data:`HOST_WAIT_OPS` of one training-mode forward and backward, by name (counted on any device; the
    optimizer's step is left out: AdamW reads its step count from a CPU tensor unless ``capturable``)."""
    counter = _OpBytes()
    with counter:
        loss_of(model, batch).backward()
    model.zero_grad(set_to_none=True)
    return {name: n for name, n in sorted(counter.names.items()) if name.rsplit(".", 1)[0] in HOST_WAIT_OPS}


def work(model, opt, batch) -> tuple[int, int, collections.Counter]:
    """(ops, bytes their outputs write, ops by name) of one step."""
    counter = _OpBytes()
    with counter:
        step(model, opt, batch)
    return counter.ops, counter.bytes, counter.names


def train_gradients(model, batch) -> dict:
    """Parameter gradients of one training-mode forward and backward, dropout seeded."""
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss_of(model, batch).backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def max_difference(a: dict, b: dict) -> float:
    if sorted(a) != sorted(b):
        raise AssertionError(f"different parameters got gradients: {sorted(set(a) ^ set(b))}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def host_syncs(model, opt, batch) -> dict:
    """The times one step makes the host wait for the GPU (``torch.cuda.set_sync_debug_mode``'s warnings), and the
    lines of Python that asked: a wait empties the queue the host keeps ahead of the GPU, which a host-bound step
    pays in full."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step(model, opt, batch)
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    where = collections.Counter(f"{os.path.relpath(w.filename)}:{w.lineno}" for w in caught
                                if "synchronizing" in str(w.message))
    return {"count": sum(where.values()), "where": dict(where)}


def host_ms_by_phase(model, opt, batch, steps: int = 10) -> dict:
    """The host's milliseconds per step in forward, backward and the optimizer step, each timed without waiting for
    the GPU, with a wait after every step (each phase starts with an empty queue): on a GPU that waits on the CPU
    this says which phase convert's extra time is in. Forward is this thread's Python and launches; backward is
    autograd's device thread (memtrim's unpack hooks and the rebuilds' launches run there) while this one waits."""
    spent = {"forward": 0.0, "backward": 0.0, "optimizer_step": 0.0}
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = loss_of(model, batch)
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        opt.step()
        spent["forward"] += middle - start
        spent["backward"] += end - middle
        spent["optimizer_step"] += time.perf_counter() - end
        torch.cuda.synchronize()
    return {k: 1e3 * v / steps for k, v in spent.items()}


def cuda_memory(model, opt, batch) -> dict:
    """The allocator's bytes left allocated by one training-mode forward, and the step's peak, above the start."""
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = loss_of(model, batch)
    held = torch.cuda.memory_allocated() - base
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    return {"allocated_after_forward": held, "step_peak": torch.cuda.max_memory_allocated() - base}


def hf(config_name: str, model_name: str, inputs: Callable[[], dict], **config: Any) -> Callable:
    def make():
        import_torchvision()  # transformers imports torchvision when it is installed
        import transformers

        model = getattr(transformers, model_name)(getattr(transformers, config_name)(**config))
        return model, inputs(), "transformers"

    return make


def wide_tokens() -> dict:
    return {"input_ids": torch.randint(0, 1024, (1, 256))}


def wide_images(batch: int, key: str = "pixel_values") -> Callable[[], dict]:
    return lambda: {key: torch.randn(batch, 3, 224, 224)}


def vision(library: str, name: str, batch: int, **kwargs: Any) -> Callable:
    def make():
        torchvision, note = import_torchvision()
        if library == "timm":
            import timm

            model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
            return model, wide_images(batch, "x")(), "timm"
        if torchvision is None:
            raise ImportError(f"torchvision {note}")
        return getattr(torchvision.models, name)(num_classes=10), wide_images(batch, "x")(), "torchvision"

    return make


WIDE = {
    "hf_llama": ("HF Llama (d=1024, 4 layers, mlp 2752, 16 heads, batch 1, seq 256)",
                 hf("LlamaConfig", "LlamaForCausalLM", wide_tokens, vocab_size=1024, hidden_size=1024,
                    intermediate_size=2752, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                    max_position_embeddings=256, use_cache=False)),
    "hf_gpt2": ("HF GPT-2 (d=1024, 4 layers, 16 heads, batch 1, seq 256)",
                hf("GPT2Config", "GPT2LMHeadModel", wide_tokens, vocab_size=1024, n_positions=256, n_embd=1024,
                   n_layer=4, n_head=16, use_cache=False, bos_token_id=1023, eos_token_id=1023)),
    "hf_bert": ("HF BERT (d=1024, 4 layers, mlp 4096, 16 heads, batch 1, seq 256)",
                hf("BertConfig", "BertForMaskedLM", wide_tokens, vocab_size=1024, hidden_size=1024,
                   num_hidden_layers=4, num_attention_heads=16, intermediate_size=4096, max_position_embeddings=256)),
    "hf_vit": ("HF ViT (ViT-B widths: d=768, mlp 3072, 12 heads; 4 layers, patch 16, batch 2, 224x224)",
               hf("ViTConfig", "ViTForImageClassification", wide_images(2), image_size=224, patch_size=16,
                  hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072,
                  num_labels=10)),
    "timm_convnext_tiny": ("timm convnext_tiny (batch 1, 224x224)", vision("timm", "convnext_tiny", 1)),
    "timm_resnet18": ("timm resnet18 (batch 2, 224x224)", vision("timm", "resnet18", 2)),
    "tv_resnet18": ("torchvision resnet18 (batch 2, 224x224)", vision("torchvision", "resnet18", 2)),
    "tv_resnet50": ("torchvision resnet50 (batch 2, 224x224)", vision("torchvision", "resnet50", 2)),
}


def interleaved_times(models: dict, opts: dict, batch: dict, rounds: int, device: str,
                      scope: Callable[[str], Any] = lambda k: contextlib.nullcontext(),
                      take_step: Callable[[str], None] | None = None) -> tuple[dict, int]:
    """Seconds per step of each model (the first is the base), in ``rounds`` rounds that take the models in turn,
    each round as many steps as 0.2 s of the base's (at least 2); ``scope(name)`` is entered around a model's steps,
    ``take_step(name)``, if given, takes a step instead of :func:`step` (a CUDA graph's replay).
    Returns ({name: [seconds per step, one per round]}, steps per round)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    if take_step is None:
        def take_step(k: str) -> None:
            step(models[k], opts[k], batch)
    base = next(iter(models))
    sync()
    start = time.perf_counter()
    with scope(base):
        take_step(base)
    sync()
    repeats = max(2, int(0.2 / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for k in models:
            with scope(k):
                sync()
                start = time.perf_counter()
                for _ in range(repeats):
                    take_step(k)
                sync()
            times[k].append((time.perf_counter() - start) / repeats)
    return times, repeats


def run(key: str, rounds: int, models: dict | None = None, device: str = "cpu", batch_mult: int = 1,
        dtype: torch.dtype = torch.float32) -> dict:
    label, built, skipped = build(key, models)
    if built is None:
        return skipped or {}
    plain, batch, library = built
    plain, batch = cast(plain, batch, dtype)
    plain.train().to(device)
    batch = {k: v.repeat(batch_mult, *[1] * (v.dim() - 1)).to(device) for k, v in batch.items()}
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=batch)
    models = {"plain": plain, "converted": converted}
    checks = {}
    if device != "cpu":
        reference = train_gradients(plain, batch)
        checks["gradient_max_difference"] = {"converted_vs_plain": max_difference(train_gradients(converted, batch),
                                                                                  reference),
                                             "plain_vs_plain": max_difference(train_gradients(plain, batch),
                                                                              reference)}
        checks["tracker_held_activations"] = {k: held_activations(m, batch) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k in models:
        step(models[k], opts[k], batch)
    if device.startswith("cuda"):
        checks["cuda_allocator"] = {k: cuda_memory(models[k], opts[k], batch) for k in models}
        checks["host_syncs_per_step"] = {k: host_syncs(models[k], opts[k], batch) for k in models}
        checks["host_ms_by_phase"] = {k: host_ms_by_phase(models[k], opts[k], batch) for k in models}
    ops = {k: work(models[k], opts[k], batch) for k in models}
    counted = {"ops_per_step": {k: v[0] for k, v in ops.items()},
               "bytes_written_per_step": {k: v[1] for k, v in ops.items()},
               "bytes_written_ratio": ops["converted"][1] / ops["plain"][1],
               # which ops convert adds (its rebuilds, memtrim's aliases) and removes, by name
               "ops_added": dict(ops["converted"][2] - ops["plain"][2]),
               "ops_removed": dict(ops["plain"][2] - ops["converted"][2]),
               # what would make a GPU's host wait (and fail a CUDA graph's capture: convert_cuda_graph.py)
               "host_wait_ops_forward_backward": {k: host_wait_ops(m, batch) for k, m in models.items()}}
    head = {"model": label, "library": library, "changes": len(report.changes), "batch_mult": batch_mult,
            "dtype": str(dtype).removeprefix("torch."), **checks}
    if rounds == 0:  # --ops-only
        return {**head, **counted}
    times, repeats = interleaved_times(models, opts, batch, rounds, device)
    ratios = sorted(c / p for c, p in zip(times["converted"], times["plain"]))
    return {**head, "step_ms_plain": 1e3 * statistics.median(times["plain"]),
            "step_time_ratio_median": statistics.median(ratios), "step_time_ratio_quartiles": quartiles(ratios),
            "step_time_ratio_range": [ratios[0], ratios[-1]], "repeats_per_round": repeats, **counted}


CUDA_CHECKS = ("gradient_max_difference", "cuda_allocator", "host_syncs_per_step", "host_ms_by_phase")


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", choices=sorted(set(MODELS) | set(WIDE)), default=None)
    parser.add_argument("--wide", action="store_true", help="the models at the widths people train (see above)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch-mult", type=int, default=1, help="repeat each batch N times (GPU-sized batches)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="cast each model and its batch's floating tensors (written to ..._<dtype>_<device>.json)")
    parser.add_argument("--suffix", default="",
                        help="added to the file's name before the device (a second batch size of some models: "
                             "--only tv_resnet50 --batch-mult 64 --suffix _bm64)")
    parser.add_argument("--ops-only", action="store_true",
                        help="count the ops and bytes of a step, no clock (writes convert_zoo_ops_<device>.json)")
    args = parser.parse_args()
    if args.ops_only:
        args.rounds = 0
    _, tv_note = import_torchvision()
    models = WIDE if args.wide else MODELS
    results = {}
    for key in args.only or models:
        results[key] = r = run(key, args.rounds, models, args.device, args.batch_mult, getattr(torch, args.dtype))
        if "step_time_ratio_median" in r:
            q = r["step_time_ratio_quartiles"]
            print(f"{r['model']}: {r['step_ms_plain']:.1f} ms, converted {r['step_time_ratio_median']:.3f}x "
                  f"({q[0]:.3f}-{q[1]:.3f}); ops write {r['bytes_written_ratio']:.3f}x the bytes; "
                  f"{ {k: r[k] for k in CUDA_CHECKS if k in r} }", flush=True)
        elif "ops_per_step" in r:
            print(f"{r['model']}: ops {r['ops_per_step']}, added {r['ops_added']}", flush=True)
        else:
            print(f"{r['model']}: {r['skipped']}")
    environment = {"torch": torch.__version__, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                   "float32_matmul_precision": torch.get_float32_matmul_precision(),
                   "transformers": version("transformers"), "timm": version("timm"),
                   "torchvision": version("torchvision"), "torchvision_import": tv_note}
    kind = "ops" if args.ops_only else "time"
    precision = "" if args.dtype == "float32" else f"_{args.dtype}"
    name = f"convert_zoo_{kind}{'_wide' if args.wide else ''}{precision}{args.suffix}_{args.device.split(':')[0]}.json"
    print("wrote", write(name, {"machine": machine(), "environment": environment, "rounds": args.rounds,
                                "results": results}))


if __name__ == "__main__":
    main()

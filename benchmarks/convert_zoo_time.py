"""Step time of memtrim.convert on the real model libraries of benchmarks/convert_zoo.py: each model and its converted
copy train (forward, backward, AdamW step) in interleaved rounds; the median of the per-round ratios, with quartiles.
Beside the times, a count that needs no clock: the ops one step runs and the bytes their outputs write, plain and
converted (the recompute work convert adds).

Reproduce:  zoovenv/bin/python benchmarks/convert_zoo_time.py [--rounds 15] [--only NAME ...] [--wide]
            (the venv that convert_zoo.py's docstring sets up; run on an otherwise idle machine)
Writes benchmarks/results/convert_zoo_time_cpu.json (--wide: convert_zoo_time_wide_cpu.json).

``--wide`` times the same libraries' models at the widths people train (d_model 768-1024, 224x224 images), batch 1-2:
convert's recompute work is elementwise, so its share of a step shrinks as matmuls and convolutions grow with width.
The memory figures are those of convert_zoo.py (a fraction of the activations, which does not depend on width here).
"""

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memtrim
from _common import machine, pin_malloc, quartiles, write
from convert_zoo import MODELS, build, first_tensor, import_torchvision, version
from memtrim.measure.hooks import tensors_in


def step(model, opt, batch) -> None:
    opt.zero_grad(set_to_none=True)
    first_tensor(model(**batch)).float().square().mean().backward()
    opt.step()


class _OpBytes(TorchDispatchMode):
    """Counts the ops a step runs and the bytes their outputs write: the recompute work convert adds, without a
    clock (deterministic, unlike the times). Views and other outputs that alias an input (``detach``, ``t``,
    ``_unsafe_view``) write nothing and count 0 B; in-place and ``out=`` ops count what they write."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        if not func.is_view:
            aliased = (set() if func._schema.is_mutable
                       else {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))})
            self.bytes += sum(t.nbytes for t in tensors_in(out) if t.untyped_storage()._cdata not in aliased)
        return out


def work(model, opt, batch) -> tuple[int, int]:
    """(ops, bytes their outputs write) of one step."""
    counter = _OpBytes()
    with counter:
        step(model, opt, batch)
    return counter.ops, counter.bytes


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


def run(key: str, rounds: int, models: dict | None = None) -> dict:
    label, built, skipped = build(key, models)
    if built is None:
        return skipped or {}
    plain, batch, library = built
    plain.train()
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=batch)
    models = {"plain": plain, "converted": converted}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    for k in models:
        step(models[k], opts[k], batch)
    ops = {k: work(models[k], opts[k], batch) for k in models}
    start = time.perf_counter()
    step(plain, opts["plain"], batch)
    repeats = max(2, int(0.2 / (time.perf_counter() - start)))
    times: dict[str, list[float]] = {k: [] for k in models}
    for _ in range(rounds):
        for k in models:
            start = time.perf_counter()
            for _ in range(repeats):
                step(models[k], opts[k], batch)
            times[k].append((time.perf_counter() - start) / repeats)
    ratios = sorted(c / p for c, p in zip(times["converted"], times["plain"]))
    return {"model": label, "library": library, "changes": len(report.changes),
            "step_ms_plain": 1e3 * statistics.median(times["plain"]),
            "step_time_ratio_median": statistics.median(ratios), "step_time_ratio_quartiles": quartiles(ratios),
            "step_time_ratio_range": [ratios[0], ratios[-1]], "repeats_per_round": repeats,
            "ops_per_step": {k: v[0] for k, v in ops.items()},
            "bytes_written_per_step": {k: v[1] for k, v in ops.items()},
            "bytes_written_ratio": ops["converted"][1] / ops["plain"][1]}


def main() -> None:
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", nargs="*", choices=sorted(set(MODELS) | set(WIDE)), default=None)
    parser.add_argument("--wide", action="store_true", help="the models at the widths people train (see above)")
    args = parser.parse_args()
    _, tv_note = import_torchvision()
    models = WIDE if args.wide else MODELS
    results = {}
    for key in args.only or models:
        results[key] = r = run(key, args.rounds, models)
        if "step_time_ratio_median" in r:
            q = r["step_time_ratio_quartiles"]
            print(f"{r['model']}: {r['step_ms_plain']:.1f} ms, converted {r['step_time_ratio_median']:.3f}x "
                  f"({q[0]:.3f}-{q[1]:.3f}); ops write {r['bytes_written_ratio']:.3f}x the bytes")
        else:
            print(f"{r['model']}: {r['skipped']}")
    environment = {"torch": torch.__version__, "transformers": version("transformers"), "timm": version("timm"),
                   "torchvision": version("torchvision"), "torchvision_import": tv_note}
    name = "convert_zoo_time_wide_cpu.json" if args.wide else "convert_zoo_time_cpu.json"
    print("wrote", write(name, {"machine": machine(), "environment": environment, "rounds": args.rounds,
                                "results": results}))


if __name__ == "__main__":
    main()

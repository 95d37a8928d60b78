"""memtrim.convert on models from real model libraries (HF transformers, timm, torchvision's ResNets): small
configs, random weights, offline. For each model: the activation bytes autograd keeps after one training-mode
forward (the tracker's "activations"), before and after ``memtrim.convert`` (and after it as a CUDA graph's capture
would record the forward: ``guards.as_if_capturing``, on the CPU), and the report's text. No timings.

Reproduce:  zoovenv/bin/python benchmarks/convert_zoo.py [--only NAME ...] [--dtype bfloat16]
Writes benchmarks/results/convert_zoo_cpu.json (``--dtype``: every model cast to that dtype after it is built, the
batch's floating tensors too; written to convert_zoo_<dtype>_cpu.json).

The environment (CPU torch, nothing downloaded at run time; the versions used are written to the JSON):
    python3 -m venv zoovenv && zoovenv/bin/pip install torch==2.13.0+cpu
    zoovenv/bin/pip install --no-deps transformers==5.24.0 timm==1.0.31 torchvision==0.28.0 pillow \
        huggingface_hub==1.33.0 httpx click safetensors tokenizers regex pyyaml numpy packaging filelock fsspec tqdm \
        idna httpcore anyio h11 certifi sniffio typing_extensions
    zoovenv/bin/pip install --no-deps -e .
--no-deps keeps pip from replacing the CPU torch (huggingface_hub pinned: 2.x needs packages transformers 5.23
does not). A model whose library is missing is skipped and says so.

torchvision: the 0.28.0 wheel (the one for torch 2.13) is a CUDA build. Its C++ ops do not load beside CPU
torch, and ``import torchvision`` then stops at ``torch.library.register_fake("torchvision::nms")`` ("operator
torchvision::nms does not exist"). Every timm release imports torchvision, and transformers imports it whenever it
is installed (its model classes then fail to import). ``import_torchvision`` below defines the two op schemas that
registration needs (no kernels: NMS is unusable; model code is untouched) and imports again, before timm or
transformers is imported. That is for this script only. Without torchvision the ResNets still run:
``memtrim.models.torchvision_resnet`` is torchvision's ResNet structure written out (one shared ``self.relu``
called 2-3 times per block); where torchvision imports, the script checks it has the same state_dict and computes
the same outputs.

HF models are called as ``model(**batch)``, and ``convert`` gets the same dict. Each row also gives the bytes saved per
rule, the issue's target where it sets one (issue 11: Llama >= 20 %, GPT-2 >= 25 %, resnet18 >= 25 %, resnet50 >= 20 %,
ConvNeXt >= 15 %), the largest output and parameter-gradient difference against the unconverted model (eval mode,
float32), and how long convert took (wall time on a shared machine: indicative only, not a benchmark timing).
"""

import argparse
import copy
import importlib.metadata
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import memtrim
from _common import machine, write
from memtrim.models.torchvision_resnet import TorchvisionBasicBlock, TorchvisionBottleneck, TorchvisionResNet
from memtrim.techniques.guards import as_if_capturing

SEQ, BATCH, IMAGE = 128, 2, 64


# ---------------------------------------------------------------------------------------------- libraries
def import_torchvision():
    """``import torchvision``; where its C++ ops cannot load (a CUDA wheel beside CPU torch), define the two op
    schemas its fake registrations need and import again. Returns (module or None, note)."""
    try:
        import torchvision

        return torchvision, "imported as is"
    except ImportError as e:
        return None, f"not installed ({e})"
    except RuntimeError as e:
        if "torchvision::nms does not exist" not in str(e):
            return None, f"import failed: {e}"
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import torchvision

    torchvision._convert_zoo_schemas = lib  # keep the definitions alive
    return torchvision, ("its C++ ops do not load beside CPU torch; imported after defining the torchvision::nms "
                         "and ::qnms schemas (no kernels)")


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def tokens(vocab: int) -> dict:
    return {"input_ids": torch.randint(0, vocab, (BATCH, SEQ))}


def images() -> dict:
    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE)}


def hf_llama():
    import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ, use_cache=False)
    return LlamaForCausalLM(config), tokens(1024), "transformers"


def hf_gemma():
    import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=SEQ,
                         use_cache=False)
    return GemmaForCausalLM(config), tokens(1024), "transformers"


def hf_gpt2():
    import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1024, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4, use_cache=False,
                        bos_token_id=1023, eos_token_id=1023)
    return GPT2LMHeadModel(config), tokens(1024), "transformers"


def hf_bert():
    import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=1024, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=SEQ)
    return BertForMaskedLM(config), tokens(1024), "transformers"


def hf_vit():
    import_torchvision()  # transformers imports torchvision when it is installed
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=IMAGE, patch_size=8, hidden_size=192, num_hidden_layers=4, num_attention_heads=3,
                       intermediate_size=768, num_labels=10)
    return ViTForImageClassification(config), images(), "transformers"


def timm_model(name: str, **kwargs) -> Callable:
    def build():
        import_torchvision()
        import timm

        model = timm.create_model(name, pretrained=False, num_classes=10, **kwargs)
        return model, {"x": images()["pixel_values"]}, "timm"

    return build


def not_in_place(build: Callable) -> Callable:
    """The model of ``build`` with its in-place activations made out of place by hand (convert does it itself
    where the outputs stay the same: the row shows both start from the same bytes)."""
    def built():
        model, batch, library = build()
        for module in model.modules():
            if getattr(module, "inplace", False) is True:
                module.inplace = False
        return model, batch, library

    return built


def tv_model(name: str) -> Callable:
    def build():
        torchvision, note = import_torchvision()
        if torchvision is None:
            raise ImportError(f"torchvision {note}")
        return getattr(torchvision.models, name)(num_classes=10), {"x": images()["pixel_values"]}, "torchvision"

    return build


class TwoViews(nn.Module):
    """One backbone called on two views in one forward, as SimCLR and BYOL do: the batch's two halves."""

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2)
        return torch.cat([self.backbone(a), self.backbone(b)])


def two_views(build: Callable) -> Callable:
    """The model of ``build`` called on two views of its batch's size each."""
    def built():
        model, batch, library = build()
        return TwoViews(model), {"x": torch.cat([batch["x"], torch.randn_like(batch["x"])])}, library

    return built


def pattern_model(block: type, layers: list[int]) -> Callable:
    def build():
        return TorchvisionResNet(block, layers, num_classes=10), {"x": images()["pixel_values"]}, "torchvision pattern"

    return build


MODELS = {
    "hf_llama": ("HF Llama (LlamaForCausalLM, d=256, 4 layers, mlp 688, batch 2, seq 128)", hf_llama),
    "hf_gemma": ("HF Gemma (GemmaForCausalLM, d=256, 4 layers, mlp 688, batch 2, seq 128)", hf_gemma),
    "hf_gpt2": ("HF GPT-2 (GPT2LMHeadModel, d=256, 4 layers, batch 2, seq 128)", hf_gpt2),
    "hf_bert": ("HF BERT (BertForMaskedLM, d=256, 4 layers, mlp 1024, batch 2, seq 128)", hf_bert),
    "hf_vit": ("HF ViT (ViTForImageClassification, d=192, 4 layers, patch 8, batch 2, 64x64)", hf_vit),
    "timm_convnext_atto": ("timm convnext_atto (conv_mlp: LayerNorm2d + 1x1 convs; batch 2, 64x64)",
                           timm_model("convnext_atto")),
    "timm_convnext_atto_linear": ("timm convnext_atto, conv_mlp=False (channels-last LayerNorm + Linear MLP as in "
                                  "convnext_tiny; batch 2, 64x64)", timm_model("convnext_atto", conv_mlp=False)),
    "timm_resnet18": ("timm resnet18 (separate act modules, batch 2, 64x64)", timm_model("resnet18")),
    "timm_regnetx_002": ("timm regnetx_002 (BatchNormAct2d: a BatchNorm and its ReLU in one module; batch 2, 64x64)",
                         timm_model("regnetx_002")),
    "timm_regnetx_002_two_views": ("timm regnetx_002 called on two views in one forward (2 + 2 images, 64x64)",
                                   two_views(timm_model("regnetx_002"))),
    "timm_cspdarknet53": ("timm cspdarknet53 (BatchNormAct2d: a BatchNorm and its LeakyReLU in one module; batch 2, "
                          "64x64)", timm_model("cspdarknet53")),
    "timm_efficientnet_b0": ("timm efficientnet_b0 (BatchNormAct2d + SiLU, in place as timm builds them; batch 2, "
                             "64x64)", timm_model("efficientnet_b0")),
    "timm_efficientnet_b0_out_of_place": ("timm efficientnet_b0, activations set inplace=False by hand first (the "
                                          "same bytes before convert; batch 2, 64x64)",
                                          not_in_place(timm_model("efficientnet_b0"))),
    "tv_resnet18": ("torchvision resnet18 (batch 2, 64x64)", tv_model("resnet18")),
    "tv_resnet18_two_views": ("torchvision resnet18 called on two views in one forward (SimCLR; 2 + 2 images, 64x64)",
                              two_views(tv_model("resnet18"))),
    "tv_resnet50": ("torchvision resnet50 (batch 2, 64x64)", tv_model("resnet50")),
    "pattern_resnet18": ("torchvision-pattern resnet18, written out here (batch 2, 64x64)",
                         pattern_model(TorchvisionBasicBlock, [2, 2, 2, 2])),
    "pattern_resnet50": ("torchvision-pattern resnet50, written out here (batch 2, 64x64)",
                         pattern_model(TorchvisionBottleneck, [3, 4, 6, 3])),
}
PATTERN_OF = {"pattern_resnet18": "resnet18", "pattern_resnet50": "resnet50"}
TARGETS = {"hf_llama": 0.20, "hf_gpt2": 0.25, "tv_resnet18": 0.25, "pattern_resnet18": 0.25, "tv_resnet50": 0.20,
           "pattern_resnet50": 0.20, "timm_convnext_atto": 0.15, "timm_convnext_atto_linear": 0.15}


# ---------------------------------------------------------------------------------------------- measuring
def held_activations(model: nn.Module, batch: dict, positional: bool = False) -> int:
    """Activation bytes autograd keeps after one training-mode forward of ``model(**batch)`` (or, positional,
    ``model(*batch.values())``: the tracker counts a model's positional arguments as "inputs", but a batch
    tensor passed by keyword that autograd keeps, such as the ids an embedding keeps, as "activations")."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    model.train()
    torch.manual_seed(1)
    with memtrim.track(model) as t:
        out = model(*batch.values()) if positional else model(**batch)
        held = t.live_by_category()["activations"]
    del out
    with torch.no_grad():  # measuring must not move BatchNorm's running statistics
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    return held


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if hasattr(out, "logits") else out[0]


def max_differences(a: nn.Module, b: nn.Module, batch: dict) -> dict:
    """Eval-mode (no dropout) output and parameter-gradient differences between two models on one batch."""
    grads = []
    outs = []
    for model in (a, b):
        model.eval()
        model.zero_grad(set_to_none=True)
        out = first_tensor(model(**batch))
        out.float().square().mean().backward()
        outs.append(out.detach())
        grads.append({k: p.grad for k, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
        model.train()
    grad_diff = max(((grads[0][k] - grads[1][k]).abs().max().item() for k in grads[0] if k in grads[1]), default=0.0)
    return {"output": (outs[0] - outs[1]).abs().max().item(), "parameter_gradients": grad_diff,
            "same_gradient_keys": sorted(grads[0]) == sorted(grads[1])}


def try_convert(model: nn.Module, example_inputs) -> tuple[object | None, str | None, float]:
    start = time.perf_counter()
    try:
        _, report = memtrim.convert(model, example_inputs=example_inputs)
        return report, None, time.perf_counter() - start
    except Exception as e:  # recorded, not raised: one model's failure must not hide the others
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - start


def pattern_check(key: str, model: nn.Module, batch: dict) -> dict:
    """Does the written-out ResNet match torchvision's (state_dict keys and shapes, outputs with equal weights)?"""
    torchvision, note = import_torchvision()
    if torchvision is None:
        return {"checked": False, "why": f"torchvision {note}"}
    real = getattr(torchvision.models, PATTERN_OF[key])(num_classes=10).to(next(model.parameters()).dtype)
    same_keys = {k: tuple(v.shape) for k, v in real.state_dict().items()} == {
        k: tuple(v.shape) for k, v in model.state_dict().items()}
    copy_ = copy.deepcopy(model).eval()
    real.load_state_dict(copy_.state_dict())
    real.eval()
    with torch.no_grad():
        equal = torch.equal(real(**batch), copy_(**batch))
    return {"checked": True, "same_state_dict": same_keys, "equal_outputs": equal}


def build(key: str, models: dict | None = None) -> tuple[str, tuple | None, dict | None]:
    """(label, (model, batch, library) from seed 0, None) or (label, None, the result saying the library is
    missing); ``models`` defaults to MODELS."""
    label, make = (models or MODELS)[key]
    torch.manual_seed(0)
    try:
        return label, make(), None
    except ImportError as e:
        return label, None, {"model": label, "skipped": f"library missing: {e}"}


def cast(model: nn.Module, batch: dict, dtype: torch.dtype) -> tuple[nn.Module, dict]:
    """``model`` and the batch's floating tensors in ``dtype`` (ids and masks as they are)."""
    return model.to(dtype), {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}


def run(key: str, dtype: torch.dtype = torch.float32) -> dict:
    label, built, skipped = build(key)
    if built is None:
        return skipped or {}
    model, batch, library = built
    model, batch = cast(model, batch, dtype)
    result: dict = {"model": label, "library": library,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "batch": {k: list(v.shape) for k, v in batch.items()}}
    if hasattr(model, "config"):
        result["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    if key in PATTERN_OF:
        result["matches_torchvision"] = pattern_check(key, model, batch)
    reference = copy.deepcopy(model)
    before = held_activations(model, batch)
    result["batch_counted_as_activations_by_kwargs"] = before - held_activations(model, batch, positional=True)
    report, error, seconds = try_convert(model, batch)
    result["convert_with_dict"] = "ok" if error is None else error
    after = held_activations(model, batch)
    with as_if_capturing():
        capturing = held_activations(model, batch)
    fraction = (before - after) / before if before else 0.0
    result.update({
        "held_before": before, "held_after": after, "saved_fraction": fraction,
        # as a CUDA graph's capture would record the step: the norms that decide from their weights' values which
        # features keep their input run otherwise then (NOTE [ keep decisions while a CUDA graph is captured ], NOTE
        # [ an RMSNorm while a CUDA graph is captured ])
        "held_after_while_capturing": capturing,
        "saved_fraction_while_capturing": (before - capturing) / before if before else 0.0,
        "target": TARGETS.get(key), "meets_target": None if key not in TARGETS else fraction >= TARGETS[key],
        "report": str(report) if report is not None else None,
        "bytes_saved_by_rule": report.by_rule() if report is not None else {},
        "changes": len(report.changes) if report is not None else 0,
        "skipped_candidates": len(report.skipped) if report is not None else 0,
        "convert_seconds_indicative": round(seconds, 1),
        "differences_vs_unconverted": max_differences(reference, model, batch),
    })
    return result


def memtrim_source() -> dict:
    src = Path(memtrim.__file__).resolve().parents[1]
    info = {"path": str(src)}
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                                        check=True).stdout.strip()
        info["uncommitted_in_src"] = subprocess.run(["git", "status", "--porcelain", "."], cwd=src,
                                                    capture_output=True, text=True, check=True).stdout.split("\n")[:-1]
    except (OSError, subprocess.CalledProcessError):
        info["commit"] = None
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(1)
    _, tv_note = import_torchvision()
    environment = {"torch": torch.__version__, "transformers": version("transformers"), "timm": version("timm"),
                   "torchvision": version("torchvision"), "torchvision_import": tv_note,
                   "memtrim": memtrim_source()}
    results = {}
    for key in args.only or MODELS:
        try:
            results[key] = run(key, dtype)
        except Exception:
            results[key] = {"model": MODELS[key][0], "failed": traceback.format_exc()}
        r = results[key]
        if "held_before" in r:
            met = "met" if r["meets_target"] else "NOT met"
            target = "" if r["target"] is None else f"; target {r['target']:.0%}: {met}"
            print(f"{r['model']}: {r['held_before']:,} B -> {r['held_after']:,} B ({r['saved_fraction']:.1%} fewer"
                  f"{target}); by rule {r['bytes_saved_by_rule']}")
            print("  " + (r["report"] or "no report").replace("\n", "\n  "))
        else:
            print(f"{r['model']}: {r.get('skipped') or r.get('failed')}")
    name = "convert_zoo_cpu.json" if dtype == torch.float32 else f"convert_zoo_{args.dtype}_cpu.json"
    path = write(name, {"machine": machine(), "environment": environment, "dtype": args.dtype,
                        "what": "activation bytes autograd keeps after one training-mode forward "
                                "(memtrim.track live_by_category()['activations']), before and after memtrim.convert "
                                "on the same batch",
                        "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

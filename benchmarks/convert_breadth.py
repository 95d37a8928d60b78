"""memtrim.convert across many architectures of the model libraries people train (HF transformers, timm, torchvision),
beyond convert_zoo.py's rows: tiny configs, random weights, offline, float64. For each model: the activation bytes
autograd keeps after one training-mode forward (the tracker's "activations"), before and after ``memtrim.convert``;
then the unconverted and the converted copy train 3 AdamW steps on the same batches (dropout as configured, the same
seed before each forward) and every parameter is compared, as are the buffers, the eval outputs after training, and a
strict ``load_state_dict`` of the converted model into an unconverted one. No timings.

"bitwise" means every parameter, buffer and eval output equal after training; otherwise the row gives the largest
parameter difference relative to that parameter's largest value (convert promises float64 within 1e-9 where a norm's
input is rebuilt from its output).

Reproduce (about 15 minutes; the zoo venv of convert_zoo.py's docstring):
    OMP_NUM_THREADS=1 zoovenv/bin/python benchmarks/convert_breadth.py [--only NAME ...]
Writes benchmarks/results/convert_breadth_cpu.json.
"""

import argparse
import copy
import traceback
from collections.abc import Callable

import torch
from torch import nn

import memtrim
from _common import machine, write
from convert_zoo import first_tensor, import_torchvision, memtrim_source, version

VOCAB, SEQ, BATCH, IMAGE = 128, 16, 2, 64
STEPS = 3


def tokens() -> dict:
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}


def image(size: int = IMAGE) -> Callable[[], dict]:
    return lambda: {"x": torch.randn(BATCH, 3, size, size)}


def hf(model: str, config: str, batch: Callable[[], dict] = tokens, **settings) -> tuple[Callable, Callable]:
    """An HF model class from its config class's settings (the transformers names), and its batch."""

    def build() -> nn.Module:
        import transformers

        return getattr(transformers, model)(getattr(transformers, config)(**settings))

    return build, batch


DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
               max_position_embeddings=64, use_cache=False)


def timm_(name: str, **settings) -> tuple[Callable, Callable]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10, **settings)

    return build, image()


def tv(name: str, size: int = IMAGE, **settings) -> tuple[Callable, Callable]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(num_classes=10, **settings)

    return build, image(size)


MODELS: dict[str, tuple[Callable, Callable]] = {
    "HF Mistral": hf("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, **DECODER),
    "HF Qwen2": hf("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2, **DECODER),
    "HF Gemma2": hf("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=16, **DECODER),
    "HF Phi": hf("PhiForCausalLM", "PhiConfig", **DECODER),
    "HF Phi3": hf("Phi3ForCausalLM", "Phi3Config", pad_token_id=0, bos_token_id=1, eos_token_id=2, **DECODER),
    "HF GPT-NeoX": hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **DECODER),
    "HF Falcon": hf("FalconForCausalLM", "FalconConfig", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=VOCAB, use_cache=False),
    "HF DistilBERT": hf("DistilBertForMaskedLM", "DistilBertConfig", vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4,
                        hidden_dim=128, max_position_embeddings=64),
    "HF RoBERTa": hf("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1, **DECODER),
    "HF ALBERT": hf("AlbertForMaskedLM", "AlbertConfig", embedding_size=32, **DECODER),
    "HF DeBERTa-v2": hf("DebertaV2ForMaskedLM", "DebertaV2Config", **DECODER),
    "HF BART": hf("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=64, encoder_layers=2,
                  decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                  decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False),
    "HF Whisper": hf("WhisperForConditionalGeneration", "WhisperConfig",
                     lambda: {"input_features": torch.randn(BATCH, 16, 32),
                              "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, 8))},
                     vocab_size=VOCAB, num_mel_bins=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
                     max_source_positions=16, max_target_positions=32, use_cache=False, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
    "HF Swin": hf("SwinForImageClassification", "SwinConfig", lambda: {"pixel_values": torch.randn(BATCH, 3, 32, 32)},
                  image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                  num_labels=10),
    "HF ResNet": hf("ResNetForImageClassification", "ResNetConfig",
                    lambda: {"pixel_values": torch.randn(BATCH, 3, 32, 32)},
                    embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
    "timm densenet121": timm_("densenet121"),
    "timm dla34": timm_("dla34"),
    "timm rexnet_100": timm_("rexnet_100"),
    "timm ghostnet_100": timm_("ghostnet_100"),
    "timm resnest14d": timm_("resnest14d"),
    "timm mixnet_s": timm_("mixnet_s"),
    "timm regnety_002": timm_("regnety_002"),
    "timm poolformer_s12": timm_("poolformer_s12"),
    "timm edgenext_xx_small": timm_("edgenext_xx_small"),
    "timm deit_tiny": timm_("deit_tiny_patch16_224", img_size=IMAGE),
    "timm swin_tiny (depths 1,1,1,1)": timm_("swin_tiny_patch4_window7_224", img_size=IMAGE, window_size=4,
                                            depths=(1, 1, 1, 1)),
    "timm mobilevit_xxs": timm_("mobilevit_xxs"),
    "timm dm_nfnet_f0": timm_("dm_nfnet_f0"),
    "torchvision mobilenet_v2": tv("mobilenet_v2"),
    "torchvision mobilenet_v3_small": tv("mobilenet_v3_small"),
    "torchvision densenet121": tv("densenet121"),
    "torchvision shufflenet_v2_x0_5": tv("shufflenet_v2_x0_5"),
    "torchvision efficientnet_b0": tv("efficientnet_b0"),
    "torchvision regnet_y_400mf": tv("regnet_y_400mf"),
    "torchvision mnasnet0_5": tv("mnasnet0_5"),
    "torchvision googlenet": tv("googlenet", aux_logits=False, init_weights=True),
}


def call(model: nn.Module, batch: dict):
    return model(*batch.values()) if list(batch) == ["x"] else model(**batch)


def held(model: nn.Module, batch: dict) -> int:
    """Activation bytes autograd keeps after one training-mode forward (BatchNorm's statistics put back after)."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    model.train()
    torch.manual_seed(1)
    with memtrim.track(model) as t:
        out = call(model, batch)
        kept = t.live_by_category()["activations"]
    del out
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(buffers[k])
    return kept


def loss_of(out) -> torch.Tensor:
    """A loss touching every output element, with fixed weights (no labels needed)."""
    t = first_tensor(out)
    weights = torch.randn(t.shape, generator=torch.Generator().manual_seed(123), dtype=torch.float64).to(t.dtype)
    return (t * weights).mean() + 0.1 * t.square().mean()


def relative_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = a.abs().max().item() if a.numel() else 0.0
    gap = (a - b).abs().max().item() if a.numel() else 0.0
    return gap / scale if scale else gap


def run(name: str) -> dict:
    build, make_batch = MODELS[name]
    torch.manual_seed(0)
    model = build().double()
    torch.manual_seed(1)
    cast = lambda b: {k: v.double() if v.is_floating_point() else v for k, v in b.items()}  # noqa: E731
    batch = cast(make_batch())
    batches = [cast(make_batch()) for _ in range(STEPS)]
    plain = copy.deepcopy(model)
    before = held(model, batch)
    _, report = memtrim.convert(model, example_inputs=batch)
    after = held(model, batch)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01) for m in (plain, model)]
    for step, b in enumerate(batches):
        for m, opt in zip((plain, model), optimizers):
            m.train()
            torch.manual_seed(100 + step)
            opt.zero_grad(set_to_none=True)
            loss_of(call(m, b)).backward()
            opt.step()
    pairs = list(zip(plain.parameters(), model.parameters()))
    differing = [relative_gap(p, q) for p, q in pairs if not torch.equal(p, q)]
    buffers = sum(not torch.equal(u, v) for u, v in zip(plain.buffers(), model.buffers()))
    for m in (plain, model):
        m.eval()
    with torch.no_grad():
        outputs = [first_tensor(call(m, batch)) for m in (plain, model)]
    torch.manual_seed(0)
    fresh = build().double()
    fresh.load_state_dict(model.state_dict(), strict=True)
    fresh.eval()
    with torch.no_grad():
        reloaded = torch.equal(first_tensor(call(fresh, batch)), outputs[1])
    return {"held_before": before, "held_after": after, "saved_fraction": (before - after) / before if before else 0.0,
            "changes": len(report.changes), "left_alone": len(report.skipped), "report_bitwise": report.bitwise,
            "parameters": len(pairs), "parameters_differing": len(differing),
            "largest_relative_difference": max(differing, default=0.0), "buffers_differing": buffers,
            "eval_outputs_equal": torch.equal(*outputs), "state_dict_loads_into_unconverted": reloaded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", nargs="*", choices=sorted(MODELS), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _, tv_note = import_torchvision()
    results = {}
    for name in args.only or MODELS:
        try:
            r = results[name] = run(name)
        except Exception:  # recorded, not raised: one model's failure must not hide the others
            results[name] = {"failed": traceback.format_exc()}
            print(f"{name}: FAILED\n{results[name]['failed']}")
            continue
        trained = ("bitwise" if not r["parameters_differing"] and not r["buffers_differing"]
                   and r["eval_outputs_equal"] else
                   f"{r['parameters_differing']}/{r['parameters']} parameters differ, at most "
                   f"{r['largest_relative_difference']:.1e} relative")
        print(f"| {name} | {r['held_before']:,} | {r['held_after']:,} | {r['saved_fraction']:.1%} | "
              f"{r['changes']} / {r['left_alone']} | {trained} |", flush=True)
    path = write("convert_breadth_cpu.json", {
        "machine": machine(), "memtrim": memtrim_source(), "dtype": "float64", "batch": BATCH, "steps": STEPS,
        "environment": {"transformers": version("transformers"), "timm": version("timm"),
                        "torchvision": version("torchvision"), "torchvision_import": tv_note},
        "what": "activation bytes autograd keeps after one training-mode forward (memtrim.track "
                "live_by_category()['activations']) before and after memtrim.convert; then 3 AdamW steps of the "
                "unconverted and the converted copy compared parameter by parameter",
        "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

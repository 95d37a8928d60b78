"""Which blocks memtrim.plan checkpoints on timm models that hold their blocks as attributes (regnet, dla) or nest
containers (convnext), and on HF encoder-decoders (BART, T5): for each candidate (``memtrim.planner.
block_candidates``: a class, or the classes of both stacks) the predicted peak of a steady-state AdamW step with
``checkpoint`` and with ``selective`` (fake tensors), the blocks the plan chooses, and the chosen plan's peak measured
by memtrim's tracker on real CPU tensors. Random weights from timm's and transformers' configs, offline.

Reproduce:  zoovenv/bin/python benchmarks/plan_blocks.py
            (zoovenv: the venv of benchmarks/convert_zoo.py, with timm, transformers and the torchvision import shim)
Writes benchmarks/results/plan_blocks_cpu.json. Memory only: no timings.
"""

import argparse

import torch
import torch.nn.functional as F

import memtrim
from _common import machine, write
from convert_zoo import import_torchvision
from memtrim.planner import TECHNIQUES, block_candidates, blocks_name, trace_step

TIMM = ("regnetx_002", "dla34", "convnext_atto")
HF = ("bart", "t5")


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _hf_loss(out, _):
    return out.loss


def timm_model(timm, name: str, batch: int, size: int) -> tuple:
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10)
    return model, torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)), F.cross_entropy


def hf_model(transformers, kind: str) -> tuple:
    """An encoder-decoder from a small config, random weights (batch 4, 64 tokens), trained without its cache."""
    torch.manual_seed(0)
    shape = {"d_model": 64, "vocab_size": 128, "decoder_start_token_id": 0, "pad_token_id": 0}
    if kind == "bart":
        config = transformers.BartConfig(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                         decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                         max_position_embeddings=128, **shape)
        model = transformers.BartForConditionalGeneration(config)
    else:
        config = transformers.T5Config(d_ff=128, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=4, **shape)
        model = transformers.T5ForConditionalGeneration(config)
    ids = torch.randint(0, 128, (4, 64))
    return model, {"input_ids": ids, "labels": ids, "use_cache": False}, None, _hf_loss


def one(name: str, model, x, y, loss_fn) -> dict:
    candidates = block_candidates(model)
    plans = memtrim.plan(model, x, loss_fn, _adamw, targets=y, budget=1 << 50,
                         techniques=["checkpoint", "selective"], workers=1)
    row = {"model": name, "candidates": [blocks_name(c) for c in candidates],
           "plain": next(p.peak_bytes for p in plans.all if not p.techniques), "notes": plans.notes}
    for technique in ("checkpoint", "selective"):
        chosen = next((p for p in plans.all if p.techniques == (technique,)), None)
        if chosen is None:  # left out (the notes say why)
            continue
        predicted = {}
        for c in candidates:
            try:
                predicted[blocks_name(c)] = trace_step(model, x, y, loss_fn, _adamw, [TECHNIQUES[technique]],
                                                       blocks=c).report.peak_bytes
            except Exception as e:  # the plan's notes say it too
                predicted[blocks_name(c)] = f"{type(e).__name__}: {str(e)[:200]}"
        measured = trace_step(model, x, y, loss_fn, _adamw, [TECHNIQUES[technique]], fake=False,
                              blocks=chosen.blocks).report.peak_bytes
        row[technique] = {"chosen": blocks_name(chosen.blocks), "predicted": chosen.peak_bytes, "measured": measured,
                          "by_candidate": predicted}
    print({k: v for k, v in row.items() if k != "notes"})
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16, help="timm models' batch")
    parser.add_argument("--size", type=int, default=128, help="timm models' image size")
    args = parser.parse_args()
    import_torchvision()
    import timm
    import transformers

    transformers.logging.set_verbosity_error()
    rows = [one(name, *timm_model(timm, name, args.batch, args.size)) for name in TIMM]
    rows += [one(name, *hf_model(transformers, name)) for name in HF]
    print(write("plan_blocks_cpu.json", {"machine": machine(), "timm": timm.__version__,
                                         "transformers": transformers.__version__, "timm_batch": args.batch,
                                         "timm_size": args.size, "rows": rows}))


if __name__ == "__main__":
    main()

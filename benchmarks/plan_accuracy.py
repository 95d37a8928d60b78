"""memtrim.plan's predictions against measurements: for each model and each technique combination, the peak of a
steady-state AdamW step predicted on fake tensors vs measured by memtrim's tracker on real CPU tensors; then a budget
sweep (the chosen plan always fits when measured, and is never slower at a larger budget) and, for the HF Llama-7B
plan, the time it takes and the depth extrapolation's error against full traces.

Reproduce:  hfvenv/bin/python benchmarks/plan_accuracy.py --hf --parts accuracy,sweep
            hfvenv/bin/python benchmarks/plan_accuracy.py --parts llama      (Llama-7B, timed: on an idle machine)
            (hfvenv: CPU torch, transformers and memtrim, without torchvision, which transformers imports when it is
            installed and which does not import beside CPU torch 2.13:
                python3 -m venv hfvenv && hfvenv/bin/pip install torch==2.13.0 transformers && hfvenv/bin/pip
                install -e .
            without --hf and llama, .venv/bin/python runs the small GPT (also converted by memtrim.convert), the
            ResNet-style CNN and the MobileNet-like net)
Writes benchmarks/results/plan_accuracy_cpu.json. Memory only: no timings but the planner's own wall time.
"""

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F

import memtrim
from _common import RESULTS, machine, write
from memtrim.models import GPTConfig, MobileNetLike, ResNetCNN, SmallGPT
from memtrim.planner import TECHNIQUES, combinations, trace_step

NAMES = ["selective", "checkpoint", "in_backward", "in_backward_each"]


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def _gpt_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _hf_loss(out, _):
    return out.loss


def _small_gpt() -> SmallGPT:
    torch.manual_seed(0)
    return SmallGPT(GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=128))


def _converted_gpt(tokens: torch.Tensor) -> torch.nn.Module:
    """The small GPT after memtrim.convert (its LayerNorms stay torch's, their outputs rebuilt for the Linears)."""
    return memtrim.convert(_small_gpt(), example_inputs=(tokens,))[0]


def _keep_output_gpt(tokens: torch.Tensor) -> torch.nn.Module:
    """The small GPT built with memtrim.nn.LayerNorm (keeps its output), its norms trained-looking (4 features per
    LayerNorm with a tiny gamma and a large beta keep their input), then converted: a model passed itself, whose norm
    weights the trace knows (NOTE [ known values ])."""
    model = _small_gpt()
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if type(module) is torch.nn.LayerNorm:
                lean = memtrim.nn.LayerNorm(module.normalized_shape, eps=module.eps)
                lean.load_state_dict(module.state_dict())
                setattr(parent, name, lean)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight[:4] = 1e-4
                module.bias[:4] = 2.0
    return memtrim.convert(model, example_inputs=(tokens,))[0]


def workloads(hf: bool) -> dict:
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (8, 128))
    out = {
        "small GPT (4 layers, d=256, seq 128, batch 8)": (
            functools.partial(SmallGPT, GPTConfig(n_layer=4, d_model=256, n_head=4, seq_len=128)), tokens, tokens,
            _gpt_loss),
        "ResNet-style CNN (batch 32)": (ResNetCNN, torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,)),
                                        F.cross_entropy),
        "MobileNet-like conv net with BatchNorm (batch 8, 64x64)": (
            MobileNetLike, torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,)), F.cross_entropy),
    }
    out["small GPT converted by memtrim.convert (passed itself)"] = (_converted_gpt(tokens), tokens, tokens, _gpt_loss)
    out["small GPT with memtrim.nn.LayerNorm, trained-looking norms, converted (passed itself)"] = (
        _keep_output_gpt(tokens), tokens, tokens, _gpt_loss)
    if hf:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=4, vocab_size=1024, use_cache=False)
        ids = torch.randint(0, 1024, (4, 128))
        out["HF Llama-style decoder (4 layers, d=256, seq 128, batch 4)"] = (
            functools.partial(LlamaForCausalLM, config), {"input_ids": ids, "labels": ids}, None, _hf_loss)
    return out


def accuracy(hf: bool) -> list[dict]:
    rows = []
    for name, (factory, x, y, loss) in workloads(hf).items():
        for combo in combinations(NAMES):
            techniques = [TECHNIQUES[n] for n in combo]
            try:
                predicted = trace_step(factory, x, y, loss, _adamw, techniques).report
            except LookupError:
                continue
            measured = trace_step(factory, x, y, loss, _adamw, techniques, fake=False).report
            rows.append({"model": name, "plan": "+".join(combo) or "plain", "predicted": predicted.peak_bytes,
                         "measured": measured.peak_bytes, "equal": predicted.peak_bytes == measured.peak_bytes,
                         "categories_equal": dict(predicted.peak_by_category) == dict(measured.peak_by_category)})
            print(rows[-1])
    return rows


def sweep() -> dict:
    factory, x, y, loss = workloads(False)["small GPT (4 layers, d=256, seq 128, batch 8)"]
    everything = memtrim.plan(factory, x, loss, _adamw, targets=y, budget=1 << 40, techniques=NAMES)
    peaks = sorted({p.peak_bytes for p in everything.all}, reverse=True)
    steps, last_time = [], 0.0
    for budget in peaks:
        best = memtrim.plan(factory, x, loss, _adamw, targets=y, budget=budget, techniques=NAMES).best
        measured = trace_step(factory, x, y, loss, _adamw, [TECHNIQUES[n] for n in best.techniques],
                              fake=False, blocks=best.blocks).report.peak_bytes
        exhaustive = min(p.time_ratio for p in everything.all if p.peak_bytes <= budget)
        steps.append({"budget": budget, "plan": best.name, "predicted": best.peak_bytes, "measured": measured,
                      "fits": measured <= budget, "time_ratio": best.time_ratio,
                      "exhaustive_best_time_ratio": exhaustive, "slower_than_at_a_larger_budget":
                      best.time_ratio < last_time})
        last_time = best.time_ratio
        print(steps[-1])
    return {"budgets": steps}


def llama7b() -> dict:
    """`memtrim plan --model llama-7b --batch 1 --seq 2048 --dtype bf16 --optimizer adamw --budget 24GiB` as the CLI
    runs it (a CUDA target, torch's foreach AdamW there), timed; then the depth extrapolation against full traces."""
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaConfig(use_cache=False)

    def build(n):
        config = LlamaConfig(use_cache=False, num_hidden_layers=n)
        torch.set_default_dtype(torch.bfloat16)
        try:
            return LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(torch.float32)

    ids = torch.randint(0, 32000, (1, 2048))
    batch = {"input_ids": ids, "labels": ids}

    def adamw(m, foreach=True):
        return torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=foreach)

    start = time.perf_counter()
    plans = memtrim.plan(build, batch, _hf_loss, adamw, budget="24GiB", device="cuda", depth=base.num_hidden_layers)
    seconds = time.perf_counter() - start
    print(plans, f"\n{seconds:.1f} s")
    full = {}  # the extrapolation against a full 32-layer trace, for two plans (foreach=False: the smaller peak)
    sequential = functools.partial(adamw, foreach=False)
    small = memtrim.plan(build, batch, _hf_loss, sequential, budget=1 << 50, depth=base.num_hidden_layers,
                         techniques=["checkpoint", "in_backward"])
    for combo in [(), ("checkpoint", "in_backward")]:
        report = trace_step(functools.partial(build, base.num_hidden_layers), batch, None, _hf_loss, sequential,
                            [TECHNIQUES[n] for n in combo]).report
        predicted = next(p for p in small.all if p.techniques == combo).peak_bytes
        full["+".join(combo) or "plain"] = {"extrapolated": predicted, "full_trace": report.peak_bytes,
                                            "relative_error": (predicted - report.peak_bytes) / report.peak_bytes}
        print(full)
    return {"command": "memtrim plan --model llama-7b --batch 1 --seq 2048 --dtype bf16 --optimizer adamw "
                       "--budget 24GiB", "seconds_to_plan": seconds, "best": plans.best.name, "notes": plans.notes,
            "plans": [{"plan": p.name, "peak": p.peak_bytes, "fits": p.fits, "phase": p.peak_phase,
                       "numerics": p.numerics, "by_category": p.peak_by_category, "time_ratio": p.time_ratio}
                      for p in plans.all],
            "extrapolation_foreach_false": full}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hf", action="store_true", help="add the HF Llama-style decoder (needs transformers)")
    parser.add_argument("--parts", default="accuracy,sweep,llama",
                        help="comma-separated: accuracy, sweep, llama (Llama-7B, timed: run it on an idle machine); "
                        "parts not run keep their entries in the existing result file")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    path = os.path.join(RESULTS, "plan_accuracy_cpu.json")
    result = {}
    if os.path.exists(path):
        with open(path) as f:
            result = json.load(f)
    result["machine"] = machine()
    if "accuracy" in parts:
        result["accuracy"] = accuracy(args.hf)
    if "sweep" in parts:
        result["sweep"] = sweep()
    if "llama" in parts:
        import transformers

        result["transformers"] = transformers.__version__
        result["llama_7b"] = llama7b()
    print(write("plan_accuracy_cpu.json", result))


if __name__ == "__main__":
    main()

"""Eager activation checkpointing on the small GPT beside torch.compile's activation-memory budgets: activation bytes
kept at the start of backward against step time, measured side by side in one run, and the frontier plot.

Eager models are measured with memtrim's tracker; compiled graphs keep their tensors inside one compiled autograd
node, so their bytes are read off the autograd graph (memtrim.autograd_graph_bytes; equal to the tracker's figure on
eager models, tests/measure/test_tracker_independent.py). Step times: medians of interleaved rounds' ratios to the
plain eager step.

Reproduce:  .venv/bin/python benchmarks/checkpoint_frontier.py [--rounds 15] [--no-compile]
Writes benchmarks/results/checkpoint_frontier_cpu.json and checkpoint_frontier.png.
"""

import argparse
import copy
import os
import statistics
import time

import torch
import torch.nn.functional as F

import memtrim
from _common import RESULTS, machine, pin_malloc, quartiles, write
from memtrim.models import SmallGPT
from memtrim.models.gpt import Block, CausalSelfAttention

BUDGETS = (1.0, 0.5, 0.2, 0.0)


def lm_loss(out, t):
    return F.cross_entropy(out.flatten(0, 1), t.flatten())


def step(model, opt, x):
    opt.zero_grad()
    lm_loss(model(x), x).backward()
    opt.step()


def eager_variants(base):
    out = {"plain": copy.deepcopy(base)}
    for label, policy in (("selective (save_matmuls)", "save_matmuls"), ("selective (save_attention)",
                                                                         "save_attention"), ("per block", None)):
        model = copy.deepcopy(base)
        memtrim.checkpoint_modules(model, Block, policy=policy)
        out[label] = model
    # memtrim's other levers beside checkpointing: convert alone (norms keep their output, GELU rebuilt for its
    # consumer), then with each attention module checkpointed (keeping the fused attention's output, or nothing)
    x = torch.randint(0, base.config.vocab_size, (1, base.config.seq_len))
    for label, policy in (("convert", False), ("convert + attention (save_attention)", "save_attention"),
                          ("convert + attention (per module)", None)):
        model = copy.deepcopy(base)
        memtrim.convert(model, example_inputs=(x,))
        if policy is not False:
            memtrim.checkpoint_modules(model, CausalSelfAttention, policy=policy)
        out[label] = model
    # convert, then the MLPs of the first k blocks checkpointed (each recomputes its first Linear and GELU, 4 d wide),
    # or only their first Linears' outputs rebuilt for the GELU (recompute_modules: one matmul each, no checkpoint)
    for k in (2, 3):
        model = copy.deepcopy(base)
        memtrim.convert(model, example_inputs=(x,))
        memtrim.checkpoint_modules(model, [f"blocks.{i}.mlp" for i in range(k)])
        out[f"convert + MLPs of {k} blocks"] = model
        model = copy.deepcopy(base)
        memtrim.convert(model, example_inputs=(x,))
        memtrim.recompute_modules(model, [f"blocks.{i}.mlp.fc" for i in range(k)], example_inputs=(x,))
        out[f"convert + fc of {k} blocks recomputed"] = model
    return out


def held_eager(model, x):
    with memtrim.track(model) as tracker:
        loss = lm_loss(model(x), x)
        held = tracker.live_by_category()["activations"]
    del loss
    return held


def compiled(base, budget):
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()
    functorch_config.activation_memory_budget = budget
    return torch.compile(copy.deepcopy(base))


def main():
    pin_malloc()
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    base = SmallGPT(n_layer=4, d_model=256, n_head=4, seq_len=128, vocab_size=256)
    x = torch.randint(0, 256, (8, 128))
    models = eager_variants(base)
    held = {k: held_eager(m, x) for k, m in models.items()}
    if not args.no_compile:
        for budget in BUDGETS:
            label = f"compile, budget {budget}"
            models[label] = compiled(base, budget)
            step(models[label], torch.optim.AdamW(models[label].parameters()), x)  # compiles
            loss = lm_loss(models[label](x), x)
            held[label] = memtrim.autograd_graph_bytes(
                loss, exclude=[*models[label].parameters(), *models[label].buffers(), x])
            del loss
    opts = {k: torch.optim.AdamW(m.parameters()) for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    for k in models:
        step(models[k], opts[k], x)
    rerun = fc_rerun(base, x)
    fc_times: list[float] = []
    for _ in range(args.rounds):
        for k in models:
            start = time.perf_counter()
            for _ in range(3):
                step(models[k], opts[k], x)
            times[k].append((time.perf_counter() - start) / 3)
        start = time.perf_counter()
        for _ in range(3):
            rerun()
        fc_times.append((time.perf_counter() - start) / 3)
    rows = {}
    for k in models:
        r = sorted(a / b for a, b in zip(times[k], times["plain"]))
        rows[k] = {"activations": held[k], "fewer": 1 - held[k] / held["plain"],
                   "step_time_ratio_median": statistics.median(r), "step_time_ratio_quartiles": quartiles(r),
                   "step_ms": 1e3 * statistics.median(times[k])}
        print(f"{k}: {held[k]:,} B ({rows[k]['fewer']:.0%} fewer), {rows[k]['step_time_ratio_median']:.3f}x")
    plot(rows)
    fc_output_bytes = x.numel() * base.blocks[0].mlp.fc.out_features * 4  # float32 (B*T, 4 d)
    floor = rerun_floor(rows, held, fc_times, times["plain"], fc_output_bytes)
    print(f"the MLP's first matmul: {floor['fc_rerun_ratio_median']:.3f} of a plain step; a plan 50 % below plain "
          f"beyond convert reruns at least {floor['fc_matmuls_for_half']:.2f} of them: "
          f"{floor['convert_plus_reruns_for_half']:.3f}x")
    print("wrote", write("checkpoint_frontier_cpu.json", {"machine": machine(), "rounds": args.rounds,
                                                          "workload": "small GPT, 4 layers, d=256, seq 128, batch 8, "
                                                          "AdamW", "results": rows, "rerun_floor": floor}))


def fc_rerun(base, x):
    """The matmul a checkpointed MLP runs again in backward (its first Linear on ln2's output), on the benchmark's
    shapes: what each further 4 MiB dropped beyond convert costs."""
    fc = copy.deepcopy(base.blocks[0].mlp.fc)
    h = torch.randn(x.numel(), base.config.d_model)

    def rerun():
        with torch.no_grad():
            F.linear(h, fc.weight, fc.bias)

    return rerun


def rerun_floor(rows, held, fc_times, plain_times, fc_output_bytes):
    """The least a plan with half of plain's activations can cost beyond convert, measured in the same rounds.

    Past convert, every tensor a block keeps takes a matmul (or the attention) to make again: q/k/v, the attention's
    output, the MLP's first Linear's output, and the residual stream (a sum with a projection's output). Every matmul
    of this model reads d_model-wide rows, so whichever it is, it writes 4 bytes per 2 * d_model FLOPs: dropping B
    bytes means rerunning at least B / fc_output_bytes of the MLP's first matmul (4 MiB output here). The one
    exception, block 0's input (the embedding sum, 1 MiB, rebuilt by two lookups), convert drops already."""
    ratios = sorted(a / b for a, b in zip(fc_times, plain_times))
    fc_ratio = statistics.median(ratios)
    missing = held["convert"] - held["plain"] / 2
    reruns = max(0.0, missing / fc_output_bytes)
    return {"fc_rerun_ms": 1e3 * statistics.median(fc_times), "fc_rerun_ratio_median": fc_ratio,
            "bytes_beyond_convert_for_half": missing, "fc_matmuls_for_half": reruns,
            "convert_plus_reruns_for_half": rows["convert"]["step_time_ratio_median"] + reruns * fc_ratio}


def plot(rows):
    from memtrim.measure import pyplot

    plt = pyplot("checkpoint_frontier")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for k, row in rows.items():
        marker = "s" if k.startswith("compile") else "o"
        ax.scatter(row["step_time_ratio_median"], row["activations"] / 2**20, marker=marker)
        ax.annotate(k, (row["step_time_ratio_median"], row["activations"] / 2**20), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_xlabel("step time vs plain eager (median ratio)")
    ax.set_ylabel("activations kept at backward start (MiB)")
    ax.set_title("small GPT: eager checkpointing (o) vs torch.compile budgets (s)")
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "checkpoint_frontier.png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

"""memtrim.convert where each training step is one CUDA graph: the step (forward, backward, AdamW) captured once and
replayed, as PyTorch's CUDA Graphs notes do for a whole network. The host's work, memtrim's Python included, runs once
at the capture; a replay only launches the recorded kernels. This is what a step that waits on the host is given to
stop waiting (in convert_zoo_time.py's float32 GPU table, ConvNeXt at batch 16, 1.25x eagerly, and the CNNs at batch
32, 1.34-1.39x), so here convert's cost should be its kernels' alone: what it rebuilds in backward (the BatchNorm +
ReLU, ConvNeXt's LayerNorms and GELUs).

Per model (convert_zoo_time.py's wide models at ``--batch-mult 16``, float32 unless ``--dtype``), four copies from one
seed: plain and converted, each run eagerly (AdamW) and as a graph (AdamW with ``capturable=True``: its step counter
on the GPU), plus a second plain graph, replayed as often as the first, whose parameters give the floor of the
comparison (cuDNN's backward kernels need not be deterministic). A graph's model takes three eager steps on a side
stream first (the one-pass BatchNorm rebuild's probe runs there: none is made while a graph is being captured), then
its step is captured with a static batch. Times: interleaved rounds of the four (NOTE [ interleaved timing rounds ]),
medians of the per-round ratios to the plain graph and to the plain eager step, with quartiles. Memory, from the
caching allocator: the peak while the step was captured (a tensor freed during the capture is reused within the
graph's private pool), what stays allocated after it, and what the capture reserved (the pool keeps whole segments),
above the levels before, plain and converted, beside the eager step's peak. Gradients: the largest parameter
difference after the timed replays, converted graph against plain graph, and plain graph against the second plain
graph: meaningful for models without dropout (the ResNets; ``has_dropout`` says which), since each graph's replays
draw their own dropout masks from the CUDA generator in turn. A model whose capture fails (plain or converted) is
reported with the error and the rest go on.

Reproduce (a CUDA GPU; transformers, timm, torchvision as for convert_zoo_time.py):
    python benchmarks/convert_cuda_graph.py [--rounds 7] [--only timm_resnet18 ...] [--batch-mult 16]
Writes benchmarks/results/convert_cuda_graph_cuda.json.
"""

import argparse
import copy
import statistics

import torch

import memtrim
from _common import machine, quartiles, write
from convert_zoo import build, cast, import_torchvision, version
from convert_zoo_time import WIDE, cuda_memory, interleaved_times, loss_of, step

DEFAULT = ["timm_convnext_tiny", "timm_resnet18", "tv_resnet18", "tv_resnet50"]


def captured(model, opt, batch) -> tuple[torch.cuda.CUDAGraph, dict]:
    """Three eager steps on a side stream, then one step captured: the graph, and the allocator's bytes (the peak
    during the capture and what stays allocated after it, above the level before)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(model, opt, batch)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    opt.zero_grad(set_to_none=True)  # the gradients are then the graph's own, written at each replay
    base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_of(model, batch).backward()
        opt.step()
    torch.cuda.synchronize()
    return graph, {"capture_peak": torch.cuda.max_memory_allocated() - base,
                   "allocated_after_capture": torch.cuda.memory_allocated() - base,
                   # (the graph's private pool keeps whole segments: what it holds, at least the peak)
                   "reserved_by_capture": torch.cuda.memory_reserved() - reserved}


def largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def run(key: str, rounds: int, batch_mult: int, dtype: torch.dtype) -> dict:
    label, built, skipped = build(key, WIDE)
    if built is None:
        return skipped or {}
    plain, batch, library = built
    plain, batch = cast(plain, batch, dtype)
    plain.train().to("cuda")
    batch = {k: v.repeat(batch_mult, *[1] * (v.dim() - 1)).to("cuda") for k, v in batch.items()}
    converted = copy.deepcopy(plain)
    _, report = memtrim.convert(converted, example_inputs=batch)
    models = {"plain_graph": plain, "converted_graph": converted, "plain_graph_again": copy.deepcopy(plain),
              "plain_eager": copy.deepcopy(plain), "converted_eager": copy.deepcopy(converted)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4, capturable="graph" in k)
            for k, m in models.items()}
    head = {"model": label, "library": library, "changes": len(report.changes), "batch_mult": batch_mult,
            "dtype": str(dtype).removeprefix("torch."),
            # (dropout modules, and timm's DropPath by its rate; a dropout called as a function is not seen)
            "has_dropout": any((isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0)
                               or (getattr(m, "drop_prob", 0) or 0) > 0 for m in plain.modules())}
    graphs, memory = {}, {}
    for k in ("plain_graph", "converted_graph", "plain_graph_again"):
        try:
            graphs[k], memory[k] = captured(models[k], opts[k], batch)
        except Exception as e:  # (reported: which of the two does not capture, and why)
            return {**head, "capture_failed": k, "error": f"{type(e).__name__}: {str(e)[:500]}"}
    for k in ("plain_eager", "converted_eager"):
        step(models[k], opts[k], batch)
        memory[k] = cuda_memory(models[k], opts[k], batch)

    def take_step(k: str) -> None:
        if k in graphs:
            graphs[k].replay()
        else:
            step(models[k], opts[k], batch)

    timed = {k: models[k] for k in ("plain_graph", "converted_graph", "plain_eager", "converted_eager")}
    times, repeats = interleaved_times(timed, opts, batch, rounds, "cuda", take_step=take_step)
    # as many replays of each graph as the plain one had (its timed ones and the step that set the rounds' length)
    graphs["converted_graph"].replay()
    for _ in range(rounds * repeats + 1):
        graphs["plain_graph_again"].replay()
    torch.cuda.synchronize()

    def ratio(k: str, base: str) -> dict:
        found = sorted(a / b for a, b in zip(times[k], times[base]))
        return {"median": statistics.median(found), "quartiles": quartiles(found), "range": [found[0], found[-1]]}

    return {**head, "step_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
            "converted_graph_vs_plain_graph": ratio("converted_graph", "plain_graph"),
            "converted_eager_vs_plain_eager": ratio("converted_eager", "plain_eager"),
            "plain_graph_vs_plain_eager": ratio("plain_graph", "plain_eager"),
            "repeats_per_round": repeats, "cuda_allocator": memory,
            "parameter_max_difference_after_replays": {
                "converted_graph_vs_plain_graph": largest_difference(models["converted_graph"], plain),
                "plain_graph_again_vs_plain_graph": largest_difference(models["plain_graph_again"], plain)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--only", nargs="*", choices=sorted(WIDE), default=None)
    parser.add_argument("--batch-mult", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("convert_cuda_graph.py needs a CUDA GPU")
    _, tv_note = import_torchvision()
    results = {}
    for key in args.only or DEFAULT:
        results[key] = r = run(key, args.rounds, args.batch_mult, getattr(torch, args.dtype))
        if "step_ms" in r:
            g, e = r["converted_graph_vs_plain_graph"], r["converted_eager_vs_plain_eager"]
            print(f"{r['model']}: graphs {r['step_ms']['plain_graph']:.1f} ms, converted {g['median']:.3f}x "
                  f"({g['quartiles'][0]:.3f}-{g['quartiles'][1]:.3f}); eager {r['step_ms']['plain_eager']:.1f} ms, "
                  f"converted {e['median']:.3f}x; {r['cuda_allocator']}; "
                  f"{r['parameter_max_difference_after_replays']}", flush=True)
        else:
            print(f"{key}: {r}", flush=True)
    environment = {"torch": torch.__version__, "cudnn_benchmark": torch.backends.cudnn.benchmark,
                   "timm": version("timm"), "torchvision": version("torchvision"), "torchvision_import": tv_note,
                   "transformers": version("transformers")}
    precision = "" if args.dtype == "float32" else f"_{args.dtype}"
    print("wrote", write(f"convert_cuda_graph{precision}_cuda.json",
                         {"machine": machine(), "environment": environment, "rounds": args.rounds,
                          "results": results}))


if __name__ == "__main__":
    main()

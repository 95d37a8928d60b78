"""``memtrim demo``'s report.md, rendered from the typed results (one function per section)."""

from __future__ import annotations

import memtrim

from ._demo_results import (
    SEED_PER_PARAMETER_ADAM_SECONDS,
    SEED_PER_PARAMETER_ADAM_SLOWDOWN,
    DemoResults,
    InBackward,
    InplaceResult,
    Planned,
    Reversible,
)

REVERSIBLE_PLOT = "reversible_memory_vs_depth.png"


def markdown(results: DemoResults) -> str:
    """The whole report."""
    sections = (_header, _relu_op, _runs, _equivalence, _in_backward, _check_inplace, _convert, _reversible,
                _plan)
    return "\n".join(line for section in sections for line in section(results))


def _header(results: DemoResults) -> list[str]:
    m, s, relu = results.machine, results.settings, results.relu_op
    lines = [
        "# memtrim demo report", "",
        f"Machine: {m.platform} ({m.processor}), torch {m.torch}, memtrim {m.memtrim}, device {m.device}. Data: "
        f"{s.data}; {s.epochs} epoch(s), batch {s.batch_size}, seed {s.seed}.",
        "Every byte below was measured by memtrim's tracker (`memtrim.track`, `memtrim.op_memory`).", "",
    ]
    return lines + [
        f"## 1. ReLU vs in-place ReLU on one {relu.shape[0]}x{relu.shape[1]} float32 tensor "
        f"({memtrim.format_bytes(relu.input_bytes)})", "",
    ]


def _relu_op(results: DemoResults) -> list[str]:
    lines = ["| op | allocated | peak during the call |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {op.allocated_bytes:,} B | {op.peak_bytes:,} B |"
              for name, op in results.relu_op.ops.items()]
    return lines + ["", "The out-of-place op allocates a second tensor of the same size; the in-place op allocates "
                    "nothing. That is all in-place saves *on a lone op*. Inside a model, see below.", ""]


def _runs(results: DemoResults) -> list[str]:
    steps = min((run.tracked_steps for run in results.runs.values()), default=2)
    first = "the first training step (it creates Adam's state)" if steps == 1 else (
        f"the first {'two' if steps == 2 else steps} training steps (the first creates Adam's state)")
    lines = ["## 2. The seed MLP (784-256-128-64-10, Adam) with `nn.ReLU()` and `nn.ReLU(inplace=True)`", "",
             f"Memory of {first}, by category at the peak:", "",
             "| run | peak | phase of peak | module | op | parameters | gradients | optimizer state | activations "
             "| temporaries | inputs | activations kept at backward start | forward's transient peak |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, run in results.runs.items():
        mem, c = run.memory, run.memory["peak_by_category"]
        lines.append(
            f"| `{label}` | {mem['peak_bytes']:,} B | {mem['peak_phase']} | {mem['peak_module'] or '-'} "
            f"| {mem['peak_op'] or '-'} | {c['parameters']:,} | {c['gradients']:,} | {c['optimizer_state']:,} "
            f"| {c['activations']:,} | {c['temporaries']:,} | {c['inputs']:,} "
            f"| {run.activations_at_backward_start:,} B | {run.forward_new_bytes:,} B |"
        )
    a, b = results.runs.values()
    lines += ["", f"In-place ReLU changes the activations autograd keeps by **"
              f"{a.activations_at_backward_start - b.activations_at_backward_start:,} bytes**, the forward's "
              f"transient peak by {a.forward_new_bytes - b.forward_new_bytes:,} bytes and the step's peak by "
              f"{a.memory['peak_bytes'] - b.memory['peak_bytes']:,} bytes. ReLU keeps its output for backward, and "
              "the next Linear keeps that same tensor, so doing the ReLU in place removes only a short-lived buffer "
              "during the forward.", "",
              "Timelines: " + ", ".join(f"![{label}]({run.timeline_png})" for label, run in results.runs.items()),
              "", "Training (same seed, same batches):", "",
              "| run | loss per epoch | test accuracy per epoch | seconds per epoch |", "|---|---|---|---|"]
    for label, run in results.runs.items():
        accuracy = ", ".join("-" if v is None else f"{v:.3f}" for v in run.test_accuracy_per_epoch)
        lines.append(f"| `{label}` | {', '.join(f'{v:.4f}' for v in run.loss_per_epoch)} | {accuracy} | "
                     f"{', '.join(f'{v:.2f}' for v in run.seconds_per_epoch)} |")
    return lines


def _equivalence(results: DemoResults) -> list[str]:
    eq = results.equivalence
    return ["", "## 3. Do the two runs stay equal?", "",
            f"- Loss per epoch identical: **{eq.losses_equal}**; final parameters bitwise equal: "
            f"**{eq.final_parameters_bitwise_equal}**.",
            f"- `memtrim.verify` (loss, every gradient and parameter after each of {eq.verify_steps} steps): "
            f"**{eq.verify}**.", ""]


def _in_backward(results: DemoResults) -> list[str]:
    oib: InBackward = results.optimizer_in_backward
    slow, fast = SEED_PER_PARAMETER_ADAM_SECONDS
    lines = ["## 4. The optimizer step inside backward", "",
             "The seed steps each parameter's own Adam from a post-accumulate-grad hook, checks the parameters stay "
             f"equal to standard Adam, and finds it {SEED_PER_PARAMETER_ADAM_SLOWDOWN}x slower (the seed article's "
             f"figure, {slow} s vs {fast} s; measured again below). `memtrim.OptimizerInBackward` wraps one "
             "ordinary Adam and steps it bucket by bucket inside backward.", "",
             f"- Equality with standard Adam on the seed's Linear 50-50-50-1 network, batch 5 (`memtrim.verify`, "
             f"parameters and optimizer state after each of {oib.verify_steps} steps): **{oib.verify}**.", "",
             f"| method ({oib.steps_timed} training steps, interleaved rounds) | seconds | vs standard Adam |",
             "|---|---:|---:|"]
    lines += [f"| {name} | {t.seconds:.2f} | {t.ratio:.2f}x |" for name, t in oib.timing.items()]
    standard, in_backward = oib.memory["standard"], oib.memory["in backward"]
    return lines + [
        "", f"Memory on the seed MLP (batch 64, Adam, one parameter per bucket): the standard step peaks at "
        f"{standard.peak_bytes:,} B in the {standard.peak_phase} phase with {standard.peak_gradients:,} B of "
        f"gradients alive; stepping in backward peaks at {in_backward.peak_bytes:,} B ({in_backward.peak_phase}) "
        f"with {in_backward.peak_gradients:,} B of gradients alive: **"
        f"{standard.peak_bytes - in_backward.peak_bytes:,} B saved**. At most one bucket's gradients are alive "
        f"(here the largest, fc1.weight, {in_backward.largest_bucket_bytes:,} B), so the saving grows with the "
        "number of parameters.", ""]


def _check_row(name: str, r: InplaceResult) -> str:
    status = "ok" if r.ok else f"**fails**: {r.problems[0]}"
    kept = "not measured" if r.activation_bytes is None else f"{r.activation_bytes:,} B"
    peak = "not measured" if r.peak_bytes is None else f"{r.peak_bytes:,} B"
    return (f"| `{name}` | `{r.reference}` | {status} | {kept} (reference {r.reference_activation_bytes:,}) | "
            f"{peak} (reference {r.reference_peak_bytes:,}) | {r.verdict} |")


def _check_inplace(results: DemoResults) -> list[str]:
    checks = results.check_inplace
    lines = ["## 5. Check twice: in-place code against an out-of-place reference", "",
             "`memtrim.check_inplace(fn, reference, example)` on a 64x128 float32 input (values, gradients, what is "
             "written in place, the output of an earlier op that keeps it for backward, and memory):", "",
             "| function | reference | result | kept for backward | peak of new storages | verdict |",
             "|---|---|---|---:|---:|---|"]
    lines += [_check_row(name, r) for name, r in checks.items()]
    seed_2, corrected = checks["silu_inplace_2"], checks["silu_inplace_2, corrected"]
    found = (f"the checker reports: {seed_2.problems[0]}" if not seed_2.ok
             else "the checker found no problem (unexpected on this torch version).")
    return lines + [
        "", "The seed's first SiLU returns sigmoid(x)^2 and overwrites its caller's tensor; gradcheck alone passes it.",
        "", "The seed's second SiLU, quoted exactly (`result = input.clone(); torch.sigmoid_(input); input *= result; "
        f"return input`), computes the right values, but training with it fails: {found} Applying `sigmoid_` to the "
        f"copy instead (`silu_inplace_2, corrected`) {'passes' if corrected.ok else 'does not pass'}, but keeps "
        f"{corrected.activation_bytes or 0:,} B for backward where `F.silu` keeps "
        f"{corrected.reference_activation_bytes:,} B: in place saves nothing here.", "",
        "In-place ReLU saves only a transient buffer; keeping a 1-bit mask instead of the output is what saves "
        "activation memory when nothing else keeps the output.", ""]


def _convert(results: DemoResults) -> list[str]:
    lines = ["## 6. `memtrim.convert`: keep less, where provably the same function", "",
             "Activation bytes autograd keeps after a forward, measured by the tracker on the example batch:", "",
             "| model | before | after | fewer | changes | why the rest was left alone |",
             "|---|---:|---:|---:|---|---|"]
    for name, r in results.convert.items():
        share = 1 - r.after / r.before if r.before else 0.0
        lines.append(f"| {name} | {r.before:,} B | {r.after:,} B | {share:.0%} | {'<br>'.join(r.changes) or 'none'} "
                     f"| {'<br>'.join(r.skipped) or '-'} |")
    return lines + ["", "Training after `convert` is checked against the original with `memtrim.verify` in the test "
                    "suite (bitwise where only activation+Linear pairs change; within 1e-9 in float64 where a norm is "
                    "inverted).", ""]


def _reversible(results: DemoResults) -> list[str]:
    rev: Reversible = results.reversible
    lines = ["## 7. Reversible hidden layers", "",
             "The seed MLP's shape with its hidden layers as additive couplings (f, g = Linear(128)+ReLU on width "
             "256), plain and as a `memtrim.ReversibleSequential`:", "",
             f"- Training equality over {rev.steps} SGD step{'' if rev.steps == 1 else 's'} at depth {rev.depth} "
             "(`memtrim.verify`, float32; the inputs are rebuilt by subtraction, so within 1e-6 + 1e-4 x |value|): "
             f"**{rev.verify}**.",
             "", "| coupling blocks | " + " | ".join(str(d) for d in rev.depths) + " |",
             "|---|" + "---:|" * len(rev.depths)]
    lines += [f"| activations kept, {name} | " + " | ".join(f"{v:,} B" for v in values) + " |"
              for name, values in rev.curve.items()]
    lines += ["", f"![memory vs depth]({REVERSIBLE_PLOT})", "",
              "Drift report (`check_drift`): the largest relative error of a rebuilt block input, per stack:", "",
              "| stack | largest relative reconstruction error |", "|---|---:|"]
    lines += [f"| {name} | {value:.2e} |" for name, value in rev.drift.items()]
    return lines + ["", "Without normalisation inside f and g the residual stream grows block after block; rebuilding "
                    "an input by subtraction then loses its low bits, and at depth 64 in float32 the rebuilt inputs "
                    "are useless. `check_drift` finds such blocks and keeps their inputs from the next step on; exact "
                    "mode carries the stream in fixed point and rebuilds every input bit for bit.", ""]


def _plan(results: DemoResults) -> list[str]:
    plan: Planned = results.plan
    lines = ["## 8. Will it fit? `memtrim.plan`", "",
             f"The {plan.workload} training step, AdamW, for a budget of {plan.budget:,} B (80 % of the plain step's "
             "peak): each combination of techniques traced on fake tensors (nothing allocated), ranked by numerics, "
             "then by the time model:", "",
             "| plan | predicted peak | phase | time (model) | numerics | fits |", "|---|---:|---|---:|---|---|"]
    lines += [f"| {p['name']} | {p['peak']:,} B | {p['phase']} | {p['time_ratio']:.2f}x | {p['numerics']} | "
              f"{'yes' if p['fits'] else 'no'} |" for p in plan.plans]
    same = "the same bytes" if plan.measured == plan.predicted else f"{plan.measured - plan.predicted:+,} B off"
    return lines + ["", f"Chosen: **{plan.chosen}**, predicted {plan.predicted:,} B; run for real and measured by the "
                    f"tracker: {plan.measured:,} B ({same}).", ""]

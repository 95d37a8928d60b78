"""What the host's waits for the GPU cost a converted Llama step: each rebuilt RMSNorm decides which features keep
their input (NOTE [ when a norm keeps its input ]), and gathering them (``nonzero``) makes the host wait for the GPU.
A converted model's norms decide together, one wait a forward, and check the decisions taken at the forward's end,
whose flag a GPU reads when the backward reaches the model's output (NOTE [ keep decisions made together ] and NOTE [
the check read at the backward ]). Six variants train in interleaved rounds, as in convert_zoo_time.py: plain;
converted (one wait a forward); converted with the check's flag read at the forward's end (a second wait, as before
2026-11-30 19:30); converted with the check computed on the device and never read (timing only: a write the check
exists for would go unrefused); converted with each norm deciding alone at its call (the hooks that group them taken
off: one wait a norm, as before 2026-11-30 00:00); and converted with every norm's decision made once before timing
and reused (no wait). The reused decisions are only valid while the
weights' decisions do not change; the script checks that they did not, after timing. The gaps between the converted
variants are what the waits cost.

Reproduce (a CUDA GPU, transformers):  python benchmarks/convert_waits.py [--rounds 7] [--batch-mult 16]
Writes benchmarks/results/convert_waits_<device>.json. On the CPU nothing waits: the variants differ by the
decision's own ops only.
"""

import argparse
import contextlib
import copy
import statistics
from unittest import mock

import torch

import memtrim
from _common import machine, quartiles, write
from convert_zoo import build
from convert_zoo_time import WIDE, host_syncs, interleaved_times, step
from memtrim.techniques.norms import _kernels, keep_output


def decisions_reused(store: dict):
    """Every norm's keep decision, made at its first call in here and reused after (keyed by its gamma)."""
    decide = keep_output.keep_input_features

    def reused(gamma, beta, extra=None, floor=0.0, offset=0.0, node=None, read=None):
        key = id(gamma)
        if key not in store:
            store[key] = (gamma, beta, extra, floor, offset, decide(gamma, beta, extra, floor, offset))
        return store[key][-1]

    return mock.patch.object(keep_output, "keep_input_features", reused)


def end_check_read_at_end():
    """The check's flag read at the forward's end, as on the CPU."""
    return mock.patch.object(_kernels, "read_at_backward", lambda found: False)


@contextlib.contextmanager
def end_check_unread():
    """The check at the forward's end computed on the device, as converted models do, but its flag not read."""
    unread = mock.patch.object(_kernels._Check, "_refuse_if", lambda self, found, at_backward: None)
    with end_check_read_at_end(), unread:
        yield


def still_valid(store: dict) -> bool:
    """Whether every reused decision is the one the weights give now."""
    return all(torch.equal(kept, keep_output.keep_input_features(gamma, beta, extra, floor, offset))
               for gamma, beta, extra, floor, offset, kept in store.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch-mult", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    label, built, skipped = build("hf_llama", WIDE)
    if built is None:
        print(label, skipped)
        return
    plain, batch, _ = built
    plain.train().to(args.device)
    batch = {k: v.repeat(args.batch_mult, *[1] * (v.dim() - 1)).to(args.device) for k, v in batch.items()}
    converted = copy.deepcopy(plain)
    memtrim.convert(converted, example_inputs=batch)
    alone = copy.deepcopy(converted)
    alone._forward_pre_hooks.clear()
    alone._forward_hooks.clear()
    models = {"plain": plain, "converted": converted, "converted_end_check_read_at_end": copy.deepcopy(converted),
              "converted_end_check_unread": copy.deepcopy(converted), "converted_each_norm_alone": alone,
              "converted_decisions_reused": copy.deepcopy(converted)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    store: dict = {}
    cuda = args.device.startswith("cuda")

    def scope(k):
        if k == "converted_end_check_unread":
            return end_check_unread()
        if k == "converted_end_check_read_at_end":
            return end_check_read_at_end()
        return decisions_reused(store) if k == "converted_decisions_reused" else contextlib.nullcontext()

    for k in models:
        with scope(k):
            step(models[k], opts[k], batch)
    syncs = {}
    if cuda:
        for k in models:
            with scope(k):
                syncs[k] = host_syncs(models[k], opts[k], batch)
    times, repeats = interleaved_times(models, opts, batch, args.rounds, args.device, scope)
    ratios = {k: sorted(t / p for t, p in zip(times[k], times["plain"])) for k in models if k != "plain"}
    result = {
        "machine": machine(), "model": label, "batch_mult": args.batch_mult, "rounds": args.rounds,
        "repeats_per_round": repeats, "step_ms_plain": 1e3 * statistics.median(times["plain"]),
        "step_time_ratio_median": {k: statistics.median(r) for k, r in ratios.items()},
        "step_time_ratio_quartiles": {k: quartiles(r) for k, r in ratios.items()},
        "host_syncs_per_step": syncs, "norms": len(store),
        "reused_decisions_still_valid": still_valid(store),
    }
    print(write(f"convert_waits_{args.device.split(':')[0]}.json", result))
    print({k: result[k] for k in ("step_ms_plain", "step_time_ratio_median", "norms", "reused_decisions_still_valid")})


if __name__ == "__main__":
    main()

"""``memtrim plan`` and ``memtrim profile``: will a language model's training step fit a memory budget?

``memtrim plan --model llama-7b --batch 1 --seq 2048 --dtype bf16 --optimizer adamw --budget 24GiB`` builds the model
on fake tensors (``llama-7b``: transformers' ``LlamaConfig()`` defaults, which are Llama-2-7B's sizes; ``small-gpt``:
memtrim's own; or ``pkg.module:factory``, a function returning a causal LM that takes token ids), ranks the plans
(``memtrim.plan``), prints them as a table and writes a stacked-bar PNG of each plan's predicted peak (also when none
fits). ``memtrim profile`` predicts one configuration (``--techniques``) and writes its timeline plot. Exit status:
0 a plan fits, 1 none fits, 2 a usage error.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import memtrim

from .._signatures import accepts
from .check_inplace import _load, _working_directory_on_path

_PROFILE = """``memtrim profile --model small-gpt --layers 4 --seq 128 --techniques checkpoint``: the predicted memory
of one training step with the techniques named (none: the plain step), built on fake tensors as ``memtrim plan`` does
(see its --help for the models), by category at its peak, and its timeline plot. Exit status: 0 predicted, 2 a usage
error."""

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}
_OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD,
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="llama-7b, small-gpt, or pkg.module:factory (a function returning a "
                   "causal LM; the example token ids are drawn below 256, which fake tensors do not check against "
                   "its vocabulary: memory does not depend on them)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="parameter dtype (pure, no AMP)")
    p.add_argument("--optimizer", default="adamw", choices=sorted(_OPTIMIZERS))
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=None,
                   help="the optimizer's foreach kernels (default: torch's choice for the device: on for cuda)")
    p.add_argument("--device", default="cuda", help="the device the plan is for (default cuda)")
    p.add_argument("--layers", type=int, default=None, help="override the model's number of blocks")
    p.add_argument("--accumulation-steps", type=int, default=1,
                   help="micro-batches per optimizer step (--batch is one micro-batch; default 1)")
    p.add_argument("--clip-grad-norm", type=float, default=None,
                   help="the max_norm the loop clips the gradients' global norm to (default: no clipping)")


def add_parser(sub: Any) -> None:
    """Add the ``plan`` and ``profile`` subcommands to ``sub`` (argparse's subparsers)."""
    p = sub.add_parser("plan", help="which techniques make a training step fit a memory budget",
                       description=__doc__)
    _common(p)
    p.add_argument("--budget", required=True, help="e.g. 24GiB, 80GB, or bytes")
    p.add_argument("--plot", default="memtrim_plan.png", help="where the stacked-bar PNG goes ('' for none)")
    q = sub.add_parser("profile", help="the predicted memory timeline of one training step",
                       description=_PROFILE)
    _common(q)
    q.add_argument("--techniques", default="", help="comma-separated, e.g. checkpoint,in_backward (default none)")
    q.add_argument("--plot", default="memtrim_profile.png", help="where the timeline PNG goes ('' for none)")


def _hf_llama(layers: int | None, dtype: torch.dtype) -> tuple[Callable[[int], nn.Module], int]:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise memtrim.MissingDependencyError(
            "memtrim plan: --model llama-7b needs transformers (`pip install memtrim[models]`, or "
            "`pip install transformers`); or pass --model pkg.module:factory."
        ) from e
    config = LlamaConfig()
    config.use_cache = False
    return (lambda n: _in_dtype(dtype, lambda: LlamaForCausalLM(_with_layers(config, n)))), (
        layers or config.num_hidden_layers)


def _with_layers(config: Any, n: int) -> Any:
    import copy

    config = copy.deepcopy(config)
    config.num_hidden_layers = n
    return config


def _small_gpt(layers: int | None, dtype: torch.dtype, seq: int) -> tuple[Callable[[int], nn.Module], int]:
    def build(n: int) -> nn.Module:
        return _in_dtype(dtype, lambda: memtrim.models.SmallGPT(n_layer=n, seq_len=seq))

    return build, layers or 4


def _in_dtype(dtype: torch.dtype, build: Callable[[], nn.Module]) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(previous)


def _lm_loss(out: Any, tokens: torch.Tensor) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _setup(args: argparse.Namespace) -> dict[str, Any]:
    for name in ("batch", "seq", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise memtrim.InvalidInputError(f"memtrim {args.command}: --{name} must be >= 1, got {value}.")
    try:
        device = torch.device(args.device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise memtrim.InvalidInputError(
            f"memtrim {args.command}: cannot read --device {args.device!r}; write e.g. cuda, cuda:1 or cpu."
        ) from e
    if args.plot:
        args.plot = _plot_path(args.command, args.plot)
    dtype = _DTYPES[args.dtype]
    tokens = torch.randint(0, 256, (args.batch, args.seq))
    depth = None
    if args.model == "llama-7b":
        build, depth = _hf_llama(args.layers, dtype)
        inputs: Any = {"input_ids": tokens, "labels": tokens}
    elif args.model == "small-gpt":
        build, depth = _small_gpt(args.layers, dtype, args.seq)
        inputs = tokens
    else:
        _working_directory_on_path()
        try:
            factory = _load(args.model, "--model")
        except memtrim.InvalidInputError as e:  # check-inplace's loader names its own command: say ours
            raise memtrim.InvalidInputError(
                str(e).replace("memtrim check-inplace: ", f"memtrim {args.command}: ", 1)
            ) from e
        if isinstance(factory, nn.Module):  # (it was called as a forward with no input: HF's "specify input_ids")
            raise memtrim.InvalidInputError(
                f"memtrim {args.command}: --model {args.model!r} is a model ({type(factory).__name__}), not a function "
                "returning one: the model is built on fake tensors, so that no weight is allocated. Give a function, "
                f"e.g. def {args.model.rpartition(':')[2]}_factory(): return {type(factory).__name__}(...).")
        inputs = tokens
        if args.layers is None:
            build = lambda n: _in_dtype(dtype, factory)  # noqa: E731
        elif accepts(factory, 1):  # a factory of the number of blocks, as memtrim.plan's depth= takes
            build, depth = (lambda n: _in_dtype(dtype, lambda: factory(n))), args.layers
        else:  # (it was ignored: the same plan with and without it, found by an adversarial pass on 2026-12-02)
            raise memtrim.InvalidInputError(
                f"memtrim {args.command}: --layers {args.layers} needs a model factory taking the number of blocks "
                f"(def {args.model.rpartition(':')[2]}(layers): ...); {args.model} takes no argument. Drop --layers, "
                "or give the factory that parameter.")
    foreach = args.foreach if args.foreach is not None else device.type == "cuda"
    make_optimizer = functools.partial(_optimizer, _OPTIMIZERS[args.optimizer], foreach)
    if depth is not None and depth >= 3:
        model: Any = build
    else:
        model, depth = functools.partial(build, depth or 0), None
    return {"model_or_factory": model, "example_inputs": inputs, "loss_fn": _lm_loss,
            "optimizer_factory": make_optimizer, "targets": tokens, "device": args.device, "depth": depth,
            "accumulation_steps": args.accumulation_steps, "clip_grad_norm": args.clip_grad_norm}


def _plot_path(command: str, path: str) -> str:
    """``--plot`` checked before any tracing (a folder that cannot be written, or a format matplotlib cannot write,
    failed with matplotlib's traceback after all the planning: an adversarial pass on 2026-12-02); without an
    extension, the PNG matplotlib writes (``name.png``)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise memtrim.InvalidInputError(f"memtrim {command}: --plot {path!r}: no folder {folder!r}.")
    try:  # (os.access says yes for root where a file cannot be made: /proc)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise memtrim.InvalidInputError(f"memtrim {command}: --plot {path!r}: the folder {folder!r} cannot be "
                                        "written; give a path in a folder you can write, or --plot '' for none.") from e
    extension = os.path.splitext(path)[1].lower().lstrip(".")
    if not extension:
        return path + ".png"
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return path  # the plot itself says matplotlib is missing
    formats = Figure().canvas.get_supported_filetypes()
    if extension not in formats:
        raise memtrim.InvalidInputError(f"memtrim {command}: --plot {path!r}: matplotlib cannot write .{extension}; "
                                        f"use one of {', '.join('.' + f for f in sorted(formats))}.")
    return path


def _optimizer(kind: Callable[..., torch.optim.Optimizer], foreach: bool, model: nn.Module) -> torch.optim.Optimizer:
    extra = {"momentum": 0.9} if kind is torch.optim.SGD else {}
    return kind(model.parameters(), lr=1e-4, foreach=foreach, **extra)


class _Progress:
    """A progress bar on stderr (a line per plan without tqdm), made at the first traced plan and closed by
    ``close()``, so that an error message never lands on the bar's line."""

    def __init__(self) -> None:
        self.bar: Any = None

    def __call__(self, line: str) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            print(f"  traced {line}", file=sys.stderr)
            return
        if self.bar is None:
            self.bar = tqdm(desc="tracing plans", unit="plan", file=sys.stderr)
        self.bar.set_postfix_str(line)
        self.bar.update()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run(args: argparse.Namespace) -> int:
    """Run ``plan`` or ``profile``; see the module docstring for the exit status."""
    progress = _Progress()
    try:
        return _run(args, progress)
    finally:
        progress.close()


def _profiled(setup: dict[str, Any], techniques: str, progress: _Progress) -> memtrim.planner.Plan:
    """The one plan ``--techniques`` names, traced (low-bit state included: nothing fits 1 B, so every
    combination of the names is traced)."""
    names = [n.strip() for n in techniques.split(",") if n.strip()]
    unknown = [n for n in names if n not in memtrim.planner.TECHNIQUES]
    if unknown:
        raise memtrim.InvalidInputError(
            f"memtrim profile: unknown techniques {unknown}; choose from {sorted(memtrim.planner.TECHNIQUES)}."
        )
    combo = tuple(n for n in memtrim.planner.TECHNIQUES if n in names)
    if combo not in memtrim.planner.combinations(combo):
        raise memtrim.InvalidInputError(
            f"memtrim profile: --techniques {','.join(combo)} do not combine (one checkpointing policy, one way of "
            "stepping the optimizer, one state precision)."
        )
    try:
        plans = memtrim.plan(**setup, budget=1, techniques=names, progress=progress)
    except memtrim.PlanError as e:
        if not isinstance(e.plans, memtrim.planner.Plans):  # plan() always attaches them
            raise
        plans = e.plans
    chosen = next((p for p in plans.all if p.techniques == combo), None)
    if chosen is None:
        why = [n for n in plans.notes if any(n.startswith(f"{t}:") or n.startswith(f"{'+'.join(combo)}:")
                                             for t in combo)]
        raise memtrim.InvalidInputError(
            f"memtrim profile: {'+'.join(combo)} was not traced: {'; '.join(why) or 'see memtrim plan'}."
        )
    return chosen


def _run(args: argparse.Namespace, progress: _Progress) -> int:
    setup = _setup(args)
    if args.command == "profile":
        chosen = _profiled(setup, args.techniques, progress)
        progress.close()
        print(f"{chosen.name}: predicted peak {memtrim.format_bytes(chosen.peak_bytes)} ({chosen.peak_phase})")
        for category, value in chosen.peak_by_category.items():
            print(f"  {category:16s} {memtrim.format_bytes(value)}")
        if args.plot:
            model = setup["model_or_factory"]
            if setup["depth"] is not None:  # the peak was extrapolated; the timeline is one trace at full depth
                model = functools.partial(model, setup["depth"])
            trace = memtrim.planner.trace_step(model, setup["example_inputs"], setup["targets"],
                                               _lm_loss, setup["optimizer_factory"],
                                               [memtrim.planner.TECHNIQUES[n] for n in chosen.techniques],
                                               loop=memtrim.planner.Loop(setup["accumulation_steps"],
                                                                         setup["clip_grad_norm"]),
                                               blocks=chosen.blocks)
            trace.report.plot(args.plot)
            print(f"timeline: {args.plot}")
        return 0
    budget = memtrim.planner.parse_bytes(args.budget)  # a usage error before any progress bar
    try:
        plans = memtrim.plan(**setup, budget=budget, progress=progress)
    except memtrim.PlanError as e:
        progress.close()
        print(e.plans if e.plans is not None else "", file=sys.stdout)
        if args.plot and isinstance(e.plans, memtrim.planner.Plans):  # how far each plan is from the budget
            e.plans.plot(args.plot)
            print(f"plot: {args.plot}")
        print(f"error: {e}", file=sys.stderr)
        return 1
    progress.close()
    print(plans)
    if args.plot:
        plans.plot(args.plot)
        print(f"plot: {args.plot}")
    return 0

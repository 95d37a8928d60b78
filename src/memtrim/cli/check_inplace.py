"""``memtrim check-inplace pkg.module:fn --reference pkg.module:fn [--shape 64,128]``."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import torch

import memtrim


def add_parser(sub: Any) -> None:
    p = sub.add_parser("check-inplace", help="check an in-place function against an out-of-place reference",
                       description="Compare values, gradients, what is written in place, and memory of FN against "
                       "REFERENCE on random inputs (see memtrim.check_inplace).")
    p.add_argument("fn", help="the function under test, as pkg.module:name")
    p.add_argument("--reference", required=True, help="the trusted out-of-place function, as pkg.module:name")
    p.add_argument("--shape", action="append", default=None,
                   help="an input shape such as 64,128 (repeat for several inputs; default 64,128)")
    p.add_argument("--dtype", default="float32", help="dtype of the example inputs (float64 is always tried too)")
    p.add_argument("--draws", type=int, default=3)


def _load(spec: str) -> Any:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise memtrim.InvalidInputError(f"memtrim check-inplace: {spec!r} is not of the form pkg.module:name.")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise memtrim.InvalidInputError(f"memtrim check-inplace: cannot import {module_name!r}: {e}.") from e
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise memtrim.InvalidInputError(f"memtrim check-inplace: {module_name!r} has no attribute {attribute!r}.")
        obj = getattr(obj, part)
    if not callable(obj):
        raise memtrim.InvalidInputError(f"memtrim check-inplace: {spec} is not callable.")
    return obj


def run(args: argparse.Namespace) -> int:
    fn, reference = _load(args.fn), _load(args.reference)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise memtrim.InvalidInputError(f"memtrim check-inplace: unknown dtype {args.dtype!r}.")
    try:
        shapes = [tuple(int(n) for n in s.split(",")) for s in (args.shape or ["64,128"])]
    except ValueError as e:
        raise memtrim.InvalidInputError(
            f"memtrim check-inplace: a shape is a comma-separated list of ints ({e})."
        ) from e
    examples = [torch.randn(shape, dtype=dtype) for shape in shapes]
    result = memtrim.check_inplace(fn, reference, *examples, draws=args.draws)
    print(f"{args.fn} vs {args.reference}")
    print(result)
    return 0 if result.ok else 1

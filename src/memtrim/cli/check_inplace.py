"""``memtrim check-inplace pkg.module:fn --reference pkg.module:fn [--shape 64,128]``.

Exit status: 0 when the check passes, 1 when it finds a problem, 2 for a usage error (a name that does not
resolve, a bad ``--shape``/``--dtype``/``--draws``), which prints one line to stderr.
"""

from __future__ import annotations

import argparse
import math
import os
import pkgutil
import sys
from typing import Any

import torch

import memtrim

_API = "memtrim check-inplace"


def add_parser(sub: Any) -> None:
    """Add the ``check-inplace`` subcommand and its options to ``sub`` (argparse's subparsers)."""
    p = sub.add_parser("check-inplace", help="check an in-place function against an out-of-place reference",
                       description="Compare values, gradients, what is written in place, and memory of FN against "
                       "REFERENCE on random inputs (see memtrim.check_inplace). Names are resolved like "
                       "`python -m` does: modules in the current directory are found. Exit status: 0 ok, "
                       "1 a problem found, 2 a usage error.")
    p.add_argument("fn", help="the function under test, as pkg.module:name")
    p.add_argument("--reference", required=True, help="the trusted out-of-place function, as pkg.module:name")
    p.add_argument("--shape", action="append", default=None,
                   help="an input shape such as 64,128 (repeat for several inputs; default 64,128)")
    p.add_argument("--dtype", default="float32", help="dtype of the example inputs (float64 is always tried too)")
    p.add_argument("--draws", type=int, default=3)


def _working_directory_on_path() -> None:
    """What ``python -m`` does (a console script does not): the current directory comes first on sys.path."""
    cwd = os.getcwd()
    if not any(entry in ("", cwd) for entry in sys.path):
        sys.path.insert(0, cwd)


def _load(spec: str, option: str) -> Any:
    """The callable named ``spec`` (``pkg.module:name``, ``pkg.module:Class.method`` or ``pkg.module.name``)."""
    if not spec or spec.startswith(":"):
        raise memtrim.InvalidInputError(f"{_API}: {option} {spec!r} is not of the form pkg.module:name.")
    try:
        obj = pkgutil.resolve_name(spec)
    except (ImportError, AttributeError, ValueError) as e:
        raise memtrim.InvalidInputError(
            f"{_API}: {option} {spec!r} does not resolve ({type(e).__name__}: {e}). Give pkg.module:name, with "
            "the module in the current directory or an installed package."
        ) from e
    except Exception as e:  # the user's module raised while being imported
        raise memtrim.InvalidInputError(
            f"{_API}: {option} {spec!r}: importing it raised {type(e).__name__}: {e}."
        ) from e
    if not callable(obj):
        raise memtrim.InvalidInputError(
            f"{_API}: {option} {spec!r} is a {type(obj).__name__}, not callable; name a function."
        )
    return obj


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise memtrim.InvalidInputError(
            f"{_API}: --dtype {name!r} is not a floating-point torch dtype; use e.g. float32, float16 or bfloat16."
        )
    return dtype


def _shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(n) for n in text.split(","))
    except ValueError:
        shape = ()
    if not shape or any(n < 0 for n in shape):
        raise memtrim.InvalidInputError(
            f"{_API}: --shape {text!r} is not a comma-separated list of non-negative ints, e.g. 64,128."
        )
    return shape


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _examples(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    # every trial also runs in float64, on copies: refuse what could never fit rather than swap or be killed
    needed = sum(math.prod(shape) for shape in shapes) * 8
    memory = _physical_memory()
    if memory is not None and needed > memory // 4:
        raise memtrim.InvalidInputError(
            f"{_API}: --shape {','.join(map(str, shapes[0]))}...: the inputs need {needed / 2**30:.3g} GiB in "
            f"float64, too much for this machine ({memory / 2**30:.3g} GiB); use smaller shapes."
        )
    try:
        return [torch.randn(shape, dtype=dtype) for shape in shapes]
    except (RuntimeError, MemoryError) as e:
        raise memtrim.InvalidInputError(
            f"{_API}: --shape: cannot allocate inputs of shapes {shapes} ({' '.join(str(e).split())[:200]})."
        ) from e


def run(args: argparse.Namespace) -> int:
    """Run :func:`memtrim.check_inplace` with the parsed ``args``; 0 when it passes, 1 when it finds a problem."""
    _working_directory_on_path()
    fn, reference = _load(args.fn, "FN"), _load(args.reference, "--reference")
    dtype = _dtype(args.dtype)
    shapes = [_shape(s) for s in (args.shape or ["64,128"])]
    if args.draws < 1:
        raise memtrim.InvalidInputError(f"{_API}: --draws must be at least 1, got {args.draws}.")
    examples = _examples(shapes, dtype)
    result = memtrim.check_inplace(fn, reference, *examples, draws=args.draws)
    print(f"{args.fn} vs {args.reference}")
    print(result)
    return 0 if result.ok else 1

"""The ``memtrim`` command line: one file per subcommand, each calling only the public API."""

from __future__ import annotations

import argparse
import sys

from ..errors import MemtrimError
from . import check_inplace, demo, plan

__all__ = ["main"]

_SUBCOMMANDS = {"demo": demo, "check-inplace": check_inplace, "plan": plan, "profile": plan}


def main(argv: list[str] | None = None) -> int:
    """Run ``memtrim <subcommand>`` with ``argv`` (default ``sys.argv[1:]``); the exit status: 0 fine, 1 a problem
    found, 2 a usage error (printed as one line on stderr)."""
    parser = argparse.ArgumentParser(prog="memtrim", description="Train neural networks in less memory, measured.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in dict.fromkeys(_SUBCOMMANDS.values()):  # plan.py adds both plan and profile
        module.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(_SUBCOMMANDS[args.command].run(args) or 0)
    except MemtrimError as e:  # a usage error: one line, exit status 2 (1 means "a problem was found")
        message = " ".join(str(e).split())
        prefix = f"memtrim {args.command}"
        api = f"memtrim.{args.command}: "  # the API's own name for the same thing ("memtrim plan: memtrim.plan: ...")
        if message.startswith(api):
            message = message[len(api):]
        if not message.startswith(prefix):
            message = f"{prefix}: {message}"
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

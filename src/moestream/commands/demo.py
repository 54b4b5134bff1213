"""`moestream demo`: its options and what it runs (the work itself: moestream.tools.demo)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..options import add_threads_argument, positive

DESCRIPTION = (
    "Build a synthetic Qwen3-MoE checkpoint (random weights), convert it, stream it under a sweep of expert "
    "cache budgets and print hit rate, MB read, peak RSS and tokens/s for each."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", default=None, help="where to build the demo model (default: a temporary directory)")
    add_threads_argument(parser)
    parser.add_argument("--tokens", type=int, default=24, metavar="N", help="tokens generated per budget (default 24)")
    parser.add_argument("--quick", action="store_true", help="a smaller model, for a fast check")


def run(args: argparse.Namespace) -> int:
    from ..tools.demo import run_demo

    positive(args.tokens, "--tokens")
    if args.workdir and Path(args.workdir).exists() and not Path(args.workdir).is_dir():
        raise UsageError(f"--workdir {args.workdir} is a file; pass a directory to build the demo model in")
    run_demo(workdir=args.workdir, tokens=args.tokens, quick=args.quick)
    return 0

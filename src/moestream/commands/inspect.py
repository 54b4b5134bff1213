"""`moestream inspect`: its options and what it runs (the work itself: moestream.conversion.inspect_store)."""

from __future__ import annotations

import argparse

from ..units import parse_bytes

DESCRIPTION = (
    "Print a store's resident and expert bytes, bytes per expert and per token, the smallest --memory it "
    "runs under, and how many experts a few budgets (or the one given) cache; with --gpu-memory, the split "
    "of a --device cuda run between VRAM and RAM."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store directory made by `moestream convert`")
    parser.add_argument("--memory", default=None, metavar="SIZE", help="show what this expert cache budget holds")
    parser.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="show the VRAM and RAM split of a --device cuda run with this VRAM expert budget (and --memory in RAM)",
    )


def run(args: argparse.Namespace) -> int:
    from ..conversion.inspect_store import print_inspect
    from ..options import positive

    budget = positive(parse_bytes(args.memory), "--memory") if args.memory is not None else None
    gpu_budget = positive(parse_bytes(args.gpu_memory), "--gpu-memory") if args.gpu_memory is not None else None
    return print_inspect(args.store, budget, gpu_budget)

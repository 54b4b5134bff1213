"""`moestream upgrade`: its options and what it runs (the work itself: moestream.conversion.upgrade)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError

DESCRIPTION = (
    "Rewrite a store written by an earlier moestream in the current store format, in place and without the "
    "source checkpoint: format 3 stores kept int4/int3/int2 weights in the layout of torch's kernels on the "
    "converting CPU, and run only on CPUs with the same kernels; the upgraded store runs on every machine and "
    "computes the same numbers. Only the files that change are written; the others are linked."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store directory written by an earlier moestream")


def run(args: argparse.Namespace) -> int:
    from ..conversion.store import MANIFEST
    from ..conversion.upgrade import upgrade

    if not (Path(args.store) / MANIFEST).is_file():
        raise UsageError(f"{args.store} is not a store directory (no {MANIFEST}); pass the directory `moestream convert` wrote")
    if upgrade(args.store):
        print(f"{args.store}: upgraded to the current store format; it now runs on any machine")
    else:
        print(f"{args.store}: nothing in it depends on the machine; nothing to do")
    return 0

"""`moestream verify`: its options and what it runs (the work itself: moestream.conversion.verify)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import StoreError

DESCRIPTION = (
    "Check the manifest against the files (sizes, offsets, alignment), every expert record's "
    "checksum and the resident safetensors files. Exits 0 when the store is intact, 1 with a list of "
    "problems (file, layer, expert, offset) when it is not."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store directory made by `moestream convert`")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="check a sample of records per layer (first, last and random ones) and resident headers only",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..conversion.verify import verify_store

    if not Path(args.store).is_dir():
        what = "does not exist" if not Path(args.store).exists() else "is not a directory"
        raise StoreError(f"{args.store} {what}; pass a store directory made by `moestream convert`")
    report = verify_store(args.store, quick=args.quick, progress=not args.json)
    print(json.dumps(report.to_json()) if args.json else report.summary())
    return 0 if report.ok else 1

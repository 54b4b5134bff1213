"""What each expert format costs in quality: the trained fixture converted into every format, each store
against the checkpoint on its held-out text (perplexity and its change, KL mean and 99th percentile, top-1
agreement; float activations, so that only the weights' format is priced).

    python benchmarks/format_quality.py ../shared/models/tiny-code-moe ../scratch-bench/formats [--record]

For each format this runs, with the repo's `moestream` CLI,

    moestream convert CHECKPOINT SCRATCH/NAME.moe --experts-dtype ... --overwrite
    moestream eval SCRATCH/NAME.moe --reference CHECKPOINT --text CHECKPOINT/heldout.txt --max-tokens 4096 \\
        --activations float --json

and prints one row per store; --record writes the table as this machine's record of quality-expert-formats
(benchmarks/machine.py). The stores stay in SCRATCH (about 300 MB in all).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import machine

# (name, label in the table, `moestream convert` options)
FORMATS = [
    ("bf16", "bf16", ["--experts-dtype", "bf16"]),
    ("int8", "int8", ["--experts-dtype", "int8"]),
    ("int4-g32", "int4, group 32", ["--experts-dtype", "int4", "--group-size", "32"]),
    ("int4-g64", "int4, group 64", ["--experts-dtype", "int4", "--group-size", "64"]),
    ("int4-g128", "int4, group 128", ["--experts-dtype", "int4", "--group-size", "128"]),
    ("int3-g32", "int3, group 32", ["--experts-dtype", "int3", "--group-size", "32"]),
    ("int2-g32", "int2, group 32", ["--experts-dtype", "int2", "--group-size", "32"]),
    (
        "mixed",
        "mixed: int3, first and last layer int4",
        ["--experts-dtype", "int3", "--layer-dtype", "0=int4", "--layer-dtype", "-1=int4"],
    ),
]


def moestream(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "moestream.cli", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"moestream {' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def expert_bytes(store: Path) -> int:
    """The expert records' bytes as stored (each record 4 KiB aligned: what the store's files hold and a read
    fetches), from the store's manifest."""
    layers = json.loads((store / "manifest.json").read_text())["experts"]["layers"]
    return sum(layer["record_stride"] * len(layer["offsets"]) for layer in layers)


def sci(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}".replace("e-0", "e-").replace("e+0", "e+")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="the Hugging Face checkpoint (the trained fixture)")
    parser.add_argument("scratch", help="a directory for the converted stores")
    parser.add_argument("--text", help="held-out text (default: CHECKPOINT/heldout.txt)")
    parser.add_argument("--max-tokens", type=int, default=4096)
    machine.add_record_argument(parser, "quality-expert-formats")
    args = parser.parse_args()
    text = args.text or str(Path(args.checkpoint) / "heldout.txt")
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)

    print(f"machine: {machine.line()}", flush=True)
    reports = []
    for name, label, options in FORMATS:
        store = scratch / f"{name}.moe"
        moestream("convert", args.checkpoint, str(store), *options, "--overwrite")
        out = moestream(
            "eval", str(store), "--reference", args.checkpoint, "--text", text,
            "--max-tokens", str(args.max_tokens), "--activations", "float", "--json",
        )  # fmt: skip
        report = json.loads(out[out.index("{") :])
        reports.append((label, expert_bytes(store), report))
        print(f"  {label}: perplexity {report['store_perplexity']:.3f}, top-1 {report['top1_agreement']:.2%}", flush=True)

    ref = ", ".join(sorted({f"{r['reference_perplexity']:.3f}" for _, _, r in reports}))
    columns = ["store", "expert bytes", f"perplexity (ref {ref})", "change", "KL mean", "KL p99", "top-1 agreement"]
    rows = [
        [
            label,
            f"{nbytes / 1e6:.1f} MB",
            f"{r['store_perplexity']:.3f}",
            f"{r['perplexity_change_percent']:+.3f}%",
            sci(r["kl_mean"]),
            sci(r["kl_p99"]),
            f"{r['top1_agreement']:.2%}",
        ]
        for label, nbytes, r in reports
    ]
    first = reports[0][2]
    caption = (
        f"Against the {first['reference_dtype']} checkpoint, {first['tokens']:,} predicted positions of the held-out text "
        f"({first['windows']} windows of {first['context']} tokens), float activations:"
    )
    print(caption)
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(row))
    if args.record:
        title = "Quality of each expert format (trained fixture)"
        notes = "KL is KL(reference || store) per position; change is the store's perplexity against the reference's."
        path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, rows)], notes)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

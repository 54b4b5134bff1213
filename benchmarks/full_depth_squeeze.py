"""Decode from SSD at full depth, from nothing, in one command: a 48-layer model of Qwen3-30B-A3B's shape (16.9 GB
as Q4_0) on a machine left with less memory than that, moestream against llama.cpp on the same file and text.

    python benchmarks/full_depth_squeeze.py WORK --llama-cpp SRC --text heldout.txt \\
        [--budgets 8GiB:5GiB 4GiB:1.5GiB] [--tokens 64] [--rounds 2]

Each step is skipped when its output exists in WORK (keep WORK outside the repository; it needs about 50 GB
while the 8-layer GGUF is made, 36 GB after):

1. `checkpoint/`: `make_synthetic_checkpoint.py --shape qwen3-30b-a3b --calibrated` (8 layers, routers
   calibrated to a trained model's routing, so that text routes as it would through a trained model).
2. `model-q4_0.gguf`: `real_shape.py WORK --rounds 0 --no-bench --delete-bf16-gguf` (llama.cpp's own converter
   and quantizer; `--llama-cpp` is their source tree, as real_shape.py says).
3. `deep/model-q4_0.gguf`: `gguf_more_layers.py --times 6`, each layer six times: 48 layers.
4. `deep/store-g64`: `moestream convert` of that file with `--group-size 64`, 4.5 bits a weight as Q4_0's.
5. For each `--budgets AVAILABLE:MEMORY`:
   - `squeeze_text.py`: both engines decode `--tokens` tokens of the text one by one (teacher forced) with
     only AVAILABLE of the machine's memory left, moestream with a MEMORY expert cache (results/squeeze-*.json);
   - `moestream bench --text` under the same squeeze: hit rate, bytes missed per token, the disk's bandwidth on
     those reads, all-hits compute and the floors they allow (results/bench-*.json).

`--record` hands `squeeze_text.py` its `--record ssd-full-depth`: each budget's table of both engines goes
into this machine's record (benchmarks/machine.py); bench's figures are in results/bench-*.json.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

import machine
from squeeze_text import memory_available

HERE = Path(__file__).resolve().parent


def step(output: Path, command: list[str]) -> None:
    """Run `command` unless `output` exists (the step was done before)."""
    if output.exists():
        print(f"have {output}", flush=True)
        return
    print("$ " + " ".join(shlex.quote(part) for part in command), flush=True)
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path, help="where the checkpoint, GGUFs, store and results live (outside the repo)")
    parser.add_argument("--llama-cpp", help="llama.cpp source tree (needed to make the 8-layer GGUF)")
    parser.add_argument("--text", required=True, help="the text both engines decode (teacher forced)")
    parser.add_argument(
        "--budgets", nargs="+", default=["8GiB:5GiB", "4GiB:1.5GiB"], help="AVAILABLE:MEMORY pairs: memory left, expert cache"
    )
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per run")
    parser.add_argument("--rounds", type=int, default=2, help="squeeze_text.py rounds (the engines alternate)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefetch", default="auto", help="moestream's --prefetch (auto, the default, probes it after 16 steps)")
    machine.add_record_argument(parser, "ssd-full-depth")
    args = parser.parse_args()

    from moestream.units import format_bytes, parse_bytes

    python, work = sys.executable, args.work
    deep, results = work / "deep", work / "results"
    deep.mkdir(parents=True, exist_ok=True)
    results.mkdir(exist_ok=True)
    print(f"machine: {machine.line()}", flush=True)
    make = [
        python,
        str(HERE / "make_synthetic_checkpoint.py"),
        str(work / "checkpoint"),
        "--shape",
        "qwen3-30b-a3b",
        "--calibrated",
    ]
    step(work / "checkpoint", make)
    if not (work / "model-q4_0.gguf").exists() and not args.llama_cpp:
        sys.exit("full_depth_squeeze: pass --llama-cpp SRC to make the GGUF (a llama.cpp source tree)")
    quantize = [python, str(HERE / "real_shape.py"), str(work), "--llama-cpp", str(args.llama_cpp), "--rounds", "0", "--no-bench"]
    step(work / "model-q4_0.gguf", quantize + ["--delete-bf16-gguf"])
    gguf = deep / "model-q4_0.gguf"
    step(gguf, [python, str(HERE / "gguf_more_layers.py"), str(work / "model-q4_0.gguf"), str(gguf), "--times", "6"])
    store = deep / "store-g64"
    convert = ["moestream", "convert", str(gguf), str(store), "--group-size", "64", "--tokenizer", str(work / "checkpoint")]
    step(store, convert)

    threads = ["--threads", str(args.threads)] if args.threads else []
    for budget in args.budgets:
        available, _, memory = budget.partition(":")
        if not memory:
            sys.exit(f"full_depth_squeeze: --budgets takes AVAILABLE:MEMORY pairs, not {budget!r}")
        name = f"{available}-{memory}".lower()
        squeeze_text = [
            python, str(HERE / "squeeze_text.py"), "--store", str(store), "--gguf", str(gguf), "--text", args.text,
            "--available", available, "--memory", memory, "--tokens", str(args.tokens), "--prefill", "32",
            "--rounds", str(args.rounds), "--prefetch", args.prefetch, "--json", str(results / f"squeeze-{name}.json"), *threads,
        ]  # fmt: skip
        if args.record:
            squeeze_text += ["--record", args.record]
        print("$ " + " ".join(shlex.quote(part) for part in squeeze_text), flush=True)
        subprocess.run(squeeze_text, check=True)
        squeeze = max(0, memory_available() - parse_bytes(available))
        bench = [
            "moestream", "bench", str(store), "--memory", memory, "--squeeze", str(squeeze), "--text", args.text,
            "--prompt-tokens", "32", "--new-tokens", str(args.tokens), "--prefetch", args.prefetch, "--json", str(results / f"bench-{name}.json"), *threads,
        ]  # fmt: skip
        print(f"$ {' '.join(shlex.quote(part) for part in bench)}   # squeeze {format_bytes(squeeze)}", flush=True)
        subprocess.run(bench, check=True)


if __name__ == "__main__":
    main()

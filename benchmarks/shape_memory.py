"""Memory and prefill time over many prompt lengths: source trees side by side, in alternating fresh processes.

    git worktree add /tmp/moestream-old <old commit>
    python benchmarks/shape_memory.py --tree old=/tmp/moestream-old --tree new=. --store tiny-code.moe \\
        --text ../shared/models/tiny-code-moe/heldout.txt --lengths 16:1024:4 --rounds 2 --repeats 2

A server meets a new prompt length with nearly every request, so every matmul shape it runs may be new; a
library that keeps something per shape (oneDNN does, for bf16 and fp16 matmuls on the CPU) grows the process
for as long as it serves. Each process imports moestream from its tree's src/, loads --store through the
public API, and prefills (one forward pass over the prompt, as the scheduler's first step does) every length
of --lengths START:STOP:STEP in turn, the prompt being that many tokens of --text from a running offset, for
--rounds rounds. After each round it collects garbage, hands the freed C heap back (malloc_trim) and reads
its RSS: the rounds after the first repeat the first's shapes, so a flat RSS from round to round is a bounded
set of shapes, and one that keeps growing is not. It prints each round's RSS and prefill tokens/s; processes
alternate the trees (A B, B A, ...) --repeats times. --record writes this machine's record (benchmarks/machine.py).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

import machine

CHILD = r"""
import gc, json, sys, time
import torch
import moestream
from moestream.core.memory import current_rss_bytes, release_freed_heap

store, memory, text, lengths, rounds, compute_dtype = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6]
start, stop, step = (int(v) for v in lengths.split(":"))
model, tokenizer = moestream.load(store, memory, compute_dtype=compute_dtype)
tokens = tokenizer(open(text).read(), return_tensors="pt").input_ids[0]

def rss():
    gc.collect()
    release_freed_heap()
    return current_rss_bytes()

report = {"loaded_rss": rss(), "rounds": []}
offset = 0
for _ in range(rounds):
    seconds = prefilled = 0
    for n in range(start, stop, step):
        if offset + n > len(tokens):
            offset = 0
        ids = tokens[offset : offset + n][None]
        offset += n
        began = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=False)
        seconds += time.perf_counter() - began
        prefilled += n
    report["rounds"].append({"rss": rss(), "seconds": seconds, "tokens": prefilled})
moestream.close(model)
print(json.dumps(report))
"""


def measure(tree: str, args) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(os.path.abspath(tree), "src"))
    cmd = [sys.executable, "-c", CHILD, args.store, args.memory, args.text, args.lengths, str(args.rounds), args.compute_dtype]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{tree}: the run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="NAME=PATH of a moestream source tree (twice or more)")
    parser.add_argument("--store", required=True)
    parser.add_argument("--text", required=True, help="the text the prompts are cut from")
    parser.add_argument("--memory", default="8MiB", help="the expert cache budget (default 8MiB)")
    parser.add_argument("--compute-dtype", default="auto", help="as `moestream run --compute-dtype` (default auto)")
    parser.add_argument("--lengths", default="16:1024:4", help="prompt lengths START:STOP:STEP (default 16:1024:4)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the lengths in one process (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="processes per tree, alternating (default 2)")
    parser.add_argument("--json", help="write every run's figures here")
    machine.add_record_argument(parser, "shape-memory")
    args = parser.parse_args()
    trees = [spec.split("=", 1) for spec in args.tree]
    print(machine.line(), flush=True)
    runs = {name: [] for name, _ in trees}
    for repeat in range(args.repeats):
        for name, path in trees if repeat % 2 == 0 else trees[::-1]:
            run = measure(path, args)
            runs[name].append(run)
            rounds = "  ".join(
                f"round {i + 1}: {r['rss'] / 2**20:.0f} MiB, {r['tokens'] / r['seconds']:.0f} tok/s"
                for i, r in enumerate(run["rounds"])
            )
            print(f"{name:>8}: loaded {run['loaded_rss'] / 2**20:.0f} MiB  {rounds}", flush=True)
    rows = []
    first = trees[0][0]
    for name, _ in trees:
        rates = [r["tokens"] / r["seconds"] for run in runs[name] for r in run["rounds"]]
        last = [run["rounds"][-1]["rss"] / 2**20 for run in runs[name]]
        growth = [(run["rounds"][-1]["rss"] - run["rounds"][0]["rss"]) / 2**20 for run in runs[name]]
        loaded = [run["loaded_rss"] / 2**20 for run in runs[name]]
        ratio = ""
        if name != first:
            base = [r["tokens"] / r["seconds"] for run in runs[first] for r in run["rounds"]]
            ratio = f"{statistics.median(rates) / statistics.median(base):.3f}"
        rows.append(
            [
                name,
                f"{statistics.median(loaded):.0f}",
                f"{statistics.median(last):.0f}",
                " ".join(f"{g:+.0f}" for g in growth),
                f"{statistics.median(rates):.0f}",
                ratio,
            ]
        )
    columns = [
        "tree",
        "RSS loaded (MiB)",
        "RSS after the last round (MiB)",
        "last round less first (MiB, per process)",
        "prefill tok/s (median)",
        f"tok/s against {first}",
    ]
    caption = (
        f"`{os.path.basename(os.path.normpath(args.store))}` at `--memory {args.memory}`, `--compute-dtype {args.compute_dtype}`, "
        f"prompt lengths {args.lengths} (START:STOP:STEP), {args.rounds} rounds per process, {args.repeats} alternating processes per tree:"
    )
    table = machine.table(caption, columns, rows)
    print(caption)
    for row in [columns, *rows]:
        print(" | ".join(row))
    if args.json:
        machine.write_json(args.json, {"trees": dict(trees), "options": vars(args), "runs": runs})
    if args.record:
        path = machine.write_result(args.record, "Memory over many prompt lengths", machine.invocation(), [table])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

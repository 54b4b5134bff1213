"""moestream against llama.cpp's mmap on a machine squeezed below the model's size, decoding real text.

    python benchmarks/squeeze_text.py --store STORE --gguf MODEL-Q4_0.gguf --text heldout.txt \
        --available 2.5GiB --memory 1GiB [--tokens 128] [--prefill 32] [--threads 2] [--rounds 2] [--json OUT]

A helper process holds touched anonymous memory (moestream.tools.bench.Squeeze) so that only
`--available` of the machine's memory is left for the run, less than the model's file: llama.cpp then
pages its mmap'd GGUF in and out through the page cache (weights used from the mapping, no repacked
copy, which would not fit), moestream keeps its resident weights plus a `--memory` expert cache and
reads misses with O_DIRECT.

Both engines decode the same real text one token at a time (teacher forcing: the first `--prefill`
tokens as a prompt, untimed, then each of `--tokens` alone with the KV cache, timed), so routing follows text rather than a
random model's own output, which loops. With a calibrated synthetic router
(`make_synthetic_checkpoint.py --shape qwen3-30b-a3b --calibrated`) that routing resembles a trained
model's. Each run is a fresh process; for each: decode tokens/s, bytes read from the disk per token
(/proc/self/io read_bytes: O_DIRECT reads and mmap page-ins alike), moestream's hit rate, peak RSS.
Rounds alternate the engines. Prints a line per run and the ratio of the medians of the runs whose peak
RSS stayed within --available (one above it was not squeezed, and is left out); --json writes the runs;
--record writes the table as this machine's record of squeeze (benchmarks/machine.py; `--record
ssd-full-depth` for the 48-layer model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import machine


def memory_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def read_bytes() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def text_ids(store: str, text: str, n: int) -> list[int]:
    from moestream.core.loading import load_tokenizer

    ids = load_tokenizer(store)(open(text).read()).input_ids[:n]
    if len(ids) < n:
        sys.exit(f"squeeze_text: {text} has only {len(ids)} tokens, fewer than --prefill + --tokens")
    return ids


def run_moestream(args) -> dict:
    import torch

    import moestream
    from moestream.generation.serving import timed

    torch.set_num_threads(args.threads)
    ids = text_ids(args.store, args.text, args.prefill + args.tokens)
    model, _ = moestream.load(args.store, args.memory, prefetch=args.prefetch)
    # Teacher-forced through the loop users run: the prompt, then each text token alone (the last chosen
    # token is never fed); the decode is timed from the first new token to the last (generate.Timing).
    at_first: dict = {}

    def first_token() -> None:
        at_first.update(bytes=read_bytes(), stats=moestream.stats(model))

    forced = ids[args.prefill :] + [0]
    seconds = timed(model, ids[: args.prefill], len(forced), forced=forced, on_first_token=first_token).timing.decode_seconds
    before, before_stats = at_first["bytes"], at_first["stats"]
    stats = moestream.stats(model)
    hits, misses = stats["hits"] - before_stats["hits"], stats["misses"] - before_stats["misses"]
    return dict(
        seconds=seconds,
        read_bytes=read_bytes() - before,
        hit_rate=hits / max(1, hits + misses),
        expert_bytes_read=stats["bytes_read"] - before_stats["bytes_read"],
        peak_rss_bytes=peak_rss(),
    )


def run_llama_cpp(args) -> dict:
    import llama_cpp.llama_cpp as low
    from llama_cpp import Llama

    defaults = low.llama_model_default_params

    def no_repack():
        # Weights used where the mmap puts them: a repacked copy is anonymous memory the squeeze leaves no room for.
        params = defaults()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = no_repack
    ids = text_ids(args.store, args.text, args.prefill + args.tokens)
    llm = Llama(
        model_path=args.gguf,
        n_ctx=len(ids) + 8,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        use_mmap=True,
        verbose=False,
    )
    llm.eval(ids[: args.prefill])
    before = read_bytes()
    start = time.perf_counter()
    for token in ids[args.prefill :]:
        llm.eval([token])
    return dict(seconds=time.perf_counter() - start, read_bytes=read_bytes() - before, peak_rss_bytes=peak_rss())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--text", required=True)
    parser.add_argument("--available", default="2.5GiB", help="memory left to the run by the squeeze")
    parser.add_argument("--memory", default="1GiB", help="moestream's expert cache budget")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--prefetch", default="off")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="write the runs here too")
    parser.add_argument("--child", choices=["moestream", "llama.cpp"], help=argparse.SUPPRESS)
    machine.add_record_argument(parser, "squeeze")
    args = parser.parse_args()
    if args.child:
        result = run_moestream(args) if args.child == "moestream" else run_llama_cpp(args)
        print(json.dumps(result))
        return

    from moestream.tools.bench import Squeeze
    from moestream.units import format_bytes, parse_bytes

    print(f"machine: {machine.line()}", flush=True)
    squeeze = max(0, memory_available() - parse_bytes(args.available))
    print(f"squeeze: holding {format_bytes(squeeze)}, leaving {format_bytes(memory_available() - squeeze)} available", flush=True)
    rows = {"moestream": [], "llama.cpp": []}
    with Squeeze(squeeze):
        for r in range(args.rounds):
            for kind in ("moestream", "llama.cpp"):
                command = [sys.executable, __file__, *sys.argv[1:], "--child", kind]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode != 0:
                    print(f"{kind} failed (exit {done.returncode}): {done.stderr.strip()[-800:]}", flush=True)
                    continue
                result = json.loads(done.stdout.strip().splitlines()[-1])
                result["tokens_per_second"] = args.tokens / result["seconds"]
                result["read_per_token"] = result["read_bytes"] / args.tokens
                # A run whose peak RSS passed what the squeeze leaves was not squeezed (the helper's memory was
                # not held, or the kernel found other room): it says nothing about a small machine.
                result["squeezed"] = result["peak_rss_bytes"] <= parse_bytes(args.available)
                rows[kind].append(result)
                extra = f", hit rate {result['hit_rate']:.1%}" if "hit_rate" in result else ""
                print(
                    f"round {r + 1} {kind:<9}: {result['tokens_per_second']:.2f} tok/s, "
                    f"{format_bytes(result['read_per_token'])} read per token{extra}, "
                    f"peak RSS {format_bytes(result['peak_rss_bytes'])}"
                    + ("" if result["squeezed"] else f" -- above --available {args.available}: NOT squeezed, left out"),
                    flush=True,
                )
    ratio = None
    squeezed = {kind: [r["tokens_per_second"] for r in runs if r["squeezed"]] for kind, runs in rows.items()}
    if squeezed["moestream"] and squeezed["llama.cpp"]:
        ratio = statistics.median(squeezed["moestream"]) / statistics.median(squeezed["llama.cpp"])
        print(f"moestream / llama.cpp (medians of the squeezed runs): {ratio:.2f}x tokens/s")
    else:
        print("no ratio: one engine has no run that stayed within --available")
    if args.json:
        options = {k: v for k, v in vars(args).items() if k not in ("child", "json")}
        machine.write_json(args.json, {"options": options, "squeeze_bytes": squeeze, "runs": rows, "ratio_of_medians": ratio})
    if args.record:
        table = []
        for r in range(args.rounds):
            for kind, runs in rows.items():
                if r < len(runs):
                    x = runs[r]
                    hit = f"{x['hit_rate']:.1%}" if "hit_rate" in x else ""
                    left_out = "" if x["squeezed"] else " (not squeezed: left out)"
                    table.append(
                        [
                            r + 1,
                            kind,
                            f"{x['tokens_per_second']:.2f}",
                            format_bytes(x["read_per_token"]),
                            hit,
                            format_bytes(x["peak_rss_bytes"]) + left_out,
                        ]
                    )
        caption = (
            f"{args.available} left for the run (`--available`), moestream's cache `--memory {args.memory}`, `--prefetch {args.prefetch}`, "
            f"{args.tokens} tokens of real text teacher-forced after a {args.prefill}-token prompt, {args.threads} threads, fresh processes:"
        )
        columns = ["round", "engine", "decode tok/s", "read per token", "hit rate", "peak RSS"]
        notes = (
            f"moestream / llama.cpp (medians of the squeezed runs): **{ratio:.2f}x**."
            if ratio
            else "No ratio: one engine has no run that stayed within `--available`."
        )
        title = "Budgets far below the model: the squeeze"
        path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, table)], notes)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

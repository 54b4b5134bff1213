"""`moestream bench`: its options and what it runs (the work itself: moestream.tools.bench)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..options import add_store_arguments, engine_options, existing_file, positive, read_text_file, trace_output, writable_file

DESCRIPTION = (
    "Measure decode tokens/s, time to first token, hit rate and expert bytes read per token, "
    "the disk bandwidth on this run's own decode reads (replayed with O_DIRECT through the engine's reader, in "
    "the engine's batches), all-hits compute per token, two floors (reads then compute: bytes missed per token / "
    "bandwidth + all-hits compute; reads hidden behind compute: the larger of the two) and efficiency = floor / "
    "measured time against each. With --text the decode follows the text (teacher forcing), so routing is a "
    "text's and not a random model's looping output."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=32,
        metavar="N",
        help="prompt length in tokens (default 32); its prefill is reported in tokens/s and as a share of this "
        "CPU's int8 matmul peak, measured beside it",
    )
    parser.add_argument("--new-tokens", type=int, default=32, metavar="N", help="tokens to decode, at least 2 (default 32)")
    parser.add_argument(
        "--text",
        default=None,
        metavar="FILE",
        help="take the prompt from this text and decode through the tokens after it, whatever the model says "
        "(teacher forcing; the peers too); default: random prompt ids, greedy decoding",
    )
    parser.add_argument(
        "--squeeze",
        default="0",
        metavar="SIZE",
        help="hold this much anonymous memory in a helper process during the run, so the machine behaves like "
        "a smaller one (there is no swap: it stays resident)",
    )
    parser.add_argument(
        "--compare",
        default=None,
        metavar="CHECKPOINT",
        help="also run the peers on this Hugging Face checkpoint (the store's source): transformers fully "
        "loaded (if it fits) and transformers + accelerate disk offload at the same --memory",
    )
    parser.add_argument(
        "--compare-gguf",
        default=None,
        metavar="FILE.gguf",
        help="also run llama.cpp (pip install llama-cpp-python) on this GGUF conversion of the same checkpoint, "
        "mmap'd; it caches in the page cache, so give it the same memory with --squeeze",
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="instead of decoding: time each expert matmul of the store's shapes (every kernel the engine may run it "
        "with, one token, random weights of its layout, from memory) against this machine's memory bandwidth",
    )
    parser.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE.npz",
        help="record the measured run's routing for `moestream simulate` / `plan --trace`",
    )


def run(args: argparse.Namespace) -> int:
    from ..tools.bench import bench, write_json

    if args.kernels:
        return _kernels(args)
    positive(args.prompt_tokens, "--prompt-tokens")
    if args.new_tokens < 2:
        raise UsageError(
            f"--new-tokens must be at least 2, not {args.new_tokens}: decode speed is measured after the first token"
        )
    text = read_text_file(args.text, "--text") if args.text else None
    if args.compare and not Path(args.compare).is_dir():
        raise UsageError(
            f"--compare {args.compare} is not a directory; pass the Hugging Face checkpoint the store was converted from"
        )
    if args.compare_gguf:
        existing_file(args.compare_gguf, "--compare-gguf", "GGUF file")
    if args.json:
        writable_file(args.json, "--json")
    if args.trace_out:
        trace_output(args.trace_out, "--trace-out")
    report = bench(
        args.store,
        args.memory,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        squeeze=args.squeeze,
        compare=args.compare,
        compare_gguf=args.compare_gguf,
        text=text,
        trace_out=args.trace_out,
        **engine_options(args),
    )
    print(report.table())
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from ..core.kernel_timing import time_kernels
    from ..tools.bench import write_json

    if args.json:
        writable_file(args.json, "--json")
    report = time_kernels(args.store)
    print(report.table())
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0

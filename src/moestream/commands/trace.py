"""`moestream trace`: its options and what it runs (the work itself: moestream.tools.trace)."""

from __future__ import annotations

import argparse

from ..options import add_memory_argument, add_threads_argument, non_negative, positive, read_text_file, trace_output

DESCRIPTION = (
    "Feed a text through the model as decoding would (the first --prefill tokens as one prompt, "
    "then one token at a time with the KV cache) and record, for every token and MoE layer, the chosen "
    "expert ids and weights, with the store's identity and shape. Replay it with `moestream simulate` "
    "or `moestream plan --trace` to choose a budget and a policy without running the model again."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="store directory made by `moestream convert`")
    add_threads_argument(parser)
    parser.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to route, ideally like what you will run")
    parser.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="record the first N tokens (default 1024)")
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        metavar="N",
        help="feed the first N tokens as one prompt call (default 0: every token decoded alone)",
    )
    parser.add_argument("-o", "--output", required=True, metavar="FILE.npz", help="trace file to write")
    add_memory_argument(parser)


def run(args: argparse.Namespace) -> int:
    from ..tools.trace import record_text

    positive(args.max_tokens, "--max-tokens")
    non_negative(args.prefill, "--prefill")
    trace_output(args.output, "--output")
    text = read_text_file(args.text, "--text")
    trace = record_text(args.store, text, max_tokens=args.max_tokens, prefill=args.prefill, memory=args.memory)
    trace.meta["text"] = str(args.text)
    path = trace.save(args.output)
    print(f"{trace.describe()}\nwrote {path}")
    return 0

"""`moestream plan`: its options and what it runs (the work itself: moestream.tools.plan)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..choices import DEFAULT_GROUP_SIZE, DENSE_FORMATS, GPU_HEADROOM, GROUP_SIZES, PLAN_OVERHEAD
from ..errors import UsageError
from ..options import add_io_threads_argument, add_policy_argument, add_threads_argument, existing_file, positive
from ..units import format_bytes, parse_bytes

DESCRIPTION = (
    "From a config.json (or a checkpoint or store directory) alone, no weights: the exact resident "
    "and expert bytes moestream would store (the model is built on the meta device), bytes per expert and "
    "per token, the expert cache that --memory leaves, the expected hit rate (replayed from --trace, else a "
    "stated prior) and a tokens/s forecast, or that the model does not fit and the minimum --memory. "
    "Example configs are in examples/configs/."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="config.json, or a Hugging Face checkpoint directory, or a store")
    parser.add_argument(
        "--memory",
        default="16GiB",
        help="all the memory moestream may use: resident weights + runtime + expert cache (default 16GiB)",
    )
    parser.add_argument(
        "--cache",
        default=None,
        metavar="SIZE",
        help="give the expert cache budget itself (what generate/bench call --memory) instead of deriving it from --memory",
    )
    parser.add_argument(
        "--bits",
        type=int,
        default=16,
        choices=[16, 8, 6, 4, 3, 2],
        help="expert format: 16 = bf16, 8 = int8, 6/4/3/2 = int6/int4/int3/int2 (default 16)",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        choices=GROUP_SIZES,
        help=f"weights per scale for 6/4/3/2 bits (default {DEFAULT_GROUP_SIZE}, 6 bits 64: as `convert`)",
    )
    parser.add_argument(
        "--dense-dtype",
        choices=DENSE_FORMATS,
        default="float",
        help="resident linear layers as `convert --dense-dtype` stores them: float (default), int8, int6 or int4; "
        "fewer resident bytes leave more of --memory to the expert cache",
    )
    parser.add_argument(
        "--overhead",
        default=PLAN_OVERHEAD,
        help=f"memory for the Python/torch runtime, activations and KV cache (default {PLAN_OVERHEAD})",
    )
    parser.add_argument(
        "--trace", default=None, metavar="FILE.npz", help="a routing trace of this model: hit rate replayed through the cache"
    )
    add_policy_argument(parser)
    parser.add_argument(
        "--disk-bandwidth",
        default=None,
        metavar="BW",
        help="the disk's read speed, e.g. 3GB/s (reads then cost bytes / speed, no latency), or auto: time 1..top_k random "
        "records read at once, as a decode step's misses are, O_DIRECT, from a temporary file in --disk-dir (writes "
        "and deletes about 256 MiB). Without it, no tokens/s forecast",
    )
    parser.add_argument("--disk-dir", default=".", help="where --disk-bandwidth auto probes (default: the current directory)")
    add_io_threads_argument(parser)
    parser.add_argument(
        "--compute",
        default="bandwidth",
        metavar="HOW",
        help="per-token compute with every expert cached: measure (build the model cut to 1 and 4 MoE layers with "
        "random weights, convert and time it here; takes memory and time for big models), bandwidth (default: the "
        "active weights at this machine's memory bandwidth, a lower bound), none, or milliseconds per token",
    )
    add_threads_argument(parser)  # for --compute measure
    parser.add_argument(
        "--gpu",
        default=None,
        metavar="SIZE",
        help="the VRAM of a GPU to run on (--device cuda): prints what goes to VRAM (resident weights, "
        f"{format_bytes(GPU_HEADROOM)} for KV cache and activations, the VRAM expert cache) and to RAM (--memory: "
        "runtime and the page-locked host expert cache), or the minimum VRAM",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..tools.plan import gpu_split, gpu_text, plan_from_args

    positive(args.io_threads, "--io-threads")
    if args.disk_bandwidth == "auto" and not Path(args.disk_dir).is_dir():
        raise UsageError(f"--disk-dir {args.disk_dir} is not a directory; pass the directory on the disk to measure")
    if args.trace:
        existing_file(args.trace, "--trace", "trace file (.npz) from `moestream trace`")
    try:
        milliseconds = float(args.compute)
    except ValueError:
        milliseconds = None  # a word (measure, bandwidth, none): plan_from_args checks it
    if milliseconds is not None:
        positive(milliseconds, "--compute (milliseconds per token)")
    plan, title = plan_from_args(
        args.config,
        args.memory,
        cache=args.cache,
        bits=args.bits,
        group_size=args.group_size,
        dense_dtype=args.dense_dtype,
        overhead=args.overhead,
        trace_path=args.trace,
        policy=args.policy,
        disk_bandwidth=args.disk_bandwidth,
        disk_dir=args.disk_dir,
        compute=args.compute,
        io_threads=args.io_threads,
    )
    split = None
    if args.gpu is not None:
        split = gpu_split(plan.sizes, positive(parse_bytes(args.gpu), "--gpu"), plan.memory_bytes, plan.overhead_bytes)
    if args.json:
        print(json.dumps({**plan.to_json(), **({"gpu": split} if split else {})}))
    else:
        print(plan.table(title))
        if split is not None:
            print(gpu_text(split, plan.sizes))
    return 0

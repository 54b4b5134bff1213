"""The `moestream` command: convert, generate, inspect, verify, eval, bench, trace, simulate, plan, demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import __version__
from .convert import EXPERT_FORMATS
from .errors import MoestreamError
from .units import format_bytes, parse_bytes

EPILOG = """examples:
  moestream demo
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b.moe
  moestream convert ./Qwen3-30B-A3B ./qwen3-30b-int4.moe --experts-dtype int4
  moestream inspect ./qwen3-30b.moe --memory 4GiB
  moestream verify ./qwen3-30b.moe
  moestream generate ./qwen3-30b.moe --memory 4GiB --prompt "def fibonacci(n):" --max-new-tokens 64
  moestream chat ./qwen3-30b.moe --memory 4GiB
  moestream serve ./qwen3-30b.moe --memory 4GiB --port 8000
  moestream eval ./qwen3-30b.moe --reference ./Qwen3-30B-A3B --text heldout.txt

--memory is the byte budget of the expert cache; the resident weights (embeddings, attention, routers,
norms, shared experts, LM head) come on top of it. `moestream inspect` prints both.
"""


def _add_memory(p: argparse.ArgumentParser, default: str = "4GiB") -> None:
    p.add_argument(
        "--memory",
        default=default,
        help=f"expert cache budget, e.g. 512MiB, 4GiB (default {default}); resident weights come on top",
    )


def _add_policy(p: argparse.ArgumentParser) -> None:
    from .policies import DEFAULT_POLICY, POLICIES

    p.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=DEFAULT_POLICY,
        help="expert cache eviction policy: lfu (decayed use counts: keeps popular experts; default, best on real "
        "routing and when the budget holds less than one token's experts), lru (least recently used), arc "
        "(adaptive recency/frequency). "
        "`moestream simulate` compares them on a recorded trace",
    )


def _add_prefetch_and_io(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefetch",
        choices=["off", "on", "auto"],
        default="auto",
        help="speculative reads of the next layer's likely experts (its router applied to this layer's hidden "
        "state), and exact reads of hash-routed layers' experts: auto (default; times decode steps with it on "
        "and off, keeps it on only if that is at least 3% faster, re-checks every 256 steps), on, or off (no "
        "reads ahead of need)",
    )
    p.add_argument(
        "--io",
        choices=["direct", "buffered"],
        default="direct",
        help="direct (default): O_DIRECT, expert bytes live only in the cache; buffered: reads go through the "
        "page cache and stay there, a second cache the OS owns",
    )


def _engine_options(args) -> dict:
    """The load() options shared by generate, bench, chat and serve."""
    return dict(
        io_threads=args.io_threads,
        direct_io=args.io == "direct" and not getattr(args, "buffered_io", False),
        verify=getattr(args, "verify", "first"),
        policy=args.policy,
        prefetch=args.prefetch,
    )


def cmd_convert(args) -> int:
    from .convert import convert

    dst = convert(
        args.src,
        args.dst,
        args.experts_dtype,
        layer_dtypes=args.layer_dtype,
        group_size=args.group_size,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
    )
    return _print_inspect(dst, None)


def cmd_generate(args) -> int:
    from .generate import generate
    from .loading import load
    from .trace import start_recording, stop_recording

    model, tokenizer = load(args.store, args.memory, **_engine_options(args))
    if tokenizer is None:
        raise MoestreamError(f"{args.store} has no tokenizer files; convert from a checkpoint that includes them")
    recorder = start_recording(model) if args.trace_out else None  # routing recorded through the engine
    result = generate(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        echo=not args.json,
    )
    if args.json:
        out = {
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens,
            "seconds": result.seconds,
            "time_to_first_token": result.time_to_first_token,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "stats": result.stats,
        }
        print(json.dumps(out))
    else:
        print(result.summary(), file=sys.stderr)
    if recorder is not None:
        stop_recording(model)
        print(f"wrote {recorder.trace(prompt=args.prompt).save(args.trace_out)}", file=sys.stderr)
    return 0


def cmd_trace(args) -> int:
    from .quality import read_text
    from .trace import record_text

    trace = record_text(
        args.store, read_text(args.text), max_tokens=args.max_tokens, prefill=args.prefill, memory=args.memory
    )
    trace.meta["text"] = str(args.text)
    path = trace.save(args.output)
    print(f"{trace.describe()}\nwrote {path}")
    return 0


def cmd_simulate(args) -> int:
    from .simulate import parse_budgets, sweep, table
    from .trace import Trace

    trace = Trace.load(args.trace)
    budgets, policies = parse_budgets(args.memory, trace), [p.strip() for p in args.policy.split(",") if p.strip()]
    rows = sweep(trace, budgets, policies)
    if args.json:
        print(json.dumps({"trace": trace.meta, "results": [[r.to_json() for r in row] for row in rows]}))
    else:
        print(table(trace, rows))
    if args.plot:
        from .plots import plot_sweep

        for path in plot_sweep(trace, budgets, policies, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    from .plan import plan_from_args

    plan, title = plan_from_args(
        args.config, args.memory, cache=args.cache, bits=args.bits, group_size=args.group_size, overhead=args.overhead,
        trace_path=args.trace, policy=args.policy, disk_bandwidth=args.disk_bandwidth, disk_dir=args.disk_dir,
        compute=args.compute, io_threads=args.io_threads,
    )
    print(json.dumps(plan.to_json()) if args.json else plan.table(title))
    return 0


def _print_inspect(store, budget: int | None) -> int:
    from .sizes import StoreSizes
    from .store import Store

    s = Store(store)
    sizes = StoreSizes.of(s.manifest)
    cfg = s.manifest.model_config
    rows = [
        ("model type", cfg.get("model_type")),
        ("experts dtype", s.manifest.experts_dtype),
        ("resident bytes", format_bytes(sizes.resident_bytes)),
        ("expert bytes", f"{format_bytes(sizes.expert_bytes)} in {sizes.experts} records ({sizes.moe_layers} layers x {sizes.experts_per_layer})"),
        ("bytes per expert", f"{format_bytes(sizes.record_bytes)} (as stored, 4 KiB aligned)"),
        ("experts per token", f"{sizes.experts_per_token} ({sizes.top_k} per layer)"),
        ("worst-case read per token", format_bytes(sizes.worst_case_bytes_per_token)),
        ("minimum --memory", format_bytes(sizes.minimum_budget)),
    ]
    budgets = [budget] if budget else [b for b in (2**28, 2**30, 2**32, 2**34) if b >= sizes.minimum_budget]
    for b in budgets:
        rows.append(
            (
                f"--memory {format_bytes(b)}",
                f"caches {sizes.cache_slots(b)} experts ({sizes.cached_fraction(b):.1%}); "
                f"process holds ~{format_bytes(sizes.resident_bytes + min(b, sizes.experts * sizes.record_bytes))} of weights",
            )
        )
    width = max(len(r[0]) for r in rows)
    print(f"{s.directory}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    return 0


def cmd_inspect(args) -> int:
    return _print_inspect(args.store, parse_bytes(args.memory) if args.memory else None)


def cmd_verify(args) -> int:
    from .verify import verify_store

    report = verify_store(args.store, quick=args.quick, progress=not args.json)
    print(json.dumps(report.to_json()) if args.json else report.summary())
    return 0 if report.ok else 1


def cmd_eval(args) -> int:
    from .quality import compare, read_text

    report = compare(
        args.store,
        args.reference,
        read_text(args.text),
        max_tokens=args.max_tokens,
        context=args.context,
        memory=args.memory,
        reference_dtype=args.reference_dtype,
        progress=not args.json,
    )
    print(json.dumps(report.to_json()) if args.json else report.table())
    return 0


def cmd_bench(args) -> int:
    from .bench import bench
    from .quality import read_text

    report = bench(
        args.store,
        args.memory,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        squeeze=args.squeeze,
        compare=args.compare,
        compare_gguf=args.compare_gguf,
        text=read_text(args.text) if args.text else None,
        trace_out=args.trace_out,
        **_engine_options(args),
    )
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(workdir=args.workdir, tokens=args.tokens, quick=args.quick)
    return 0


def _load_for_text(args):
    """Load a store for chat/serve; both need its tokenizer."""
    from .loading import load

    model, tokenizer = load(args.store, args.memory, **_engine_options(args))
    if tokenizer is None:
        raise MoestreamError(f"{args.store} has no tokenizer files; convert from a checkpoint that includes them")
    return model, tokenizer


def cmd_chat(args) -> int:
    from pathlib import Path

    from .chat import ChatSession, banner, run_chat

    model, tokenizer = _load_for_text(args)
    session = ChatSession(
        model,
        tokenizer,
        system=args.system,
        max_new_tokens=args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
    )
    print(banner(session, Path(args.store).name), flush=True)
    return run_chat(session)


def cmd_serve(args) -> int:
    from pathlib import Path

    try:
        from .server import ServerConfig, create_app, serve
    except ImportError as e:
        raise MoestreamError(f"the server needs FastAPI and uvicorn ({e}); install them with: pip install 'moestream[server]'") from None

    for name in ("max_queue", "request_timeout", "default_max_tokens"):
        if getattr(args, name) <= 0:
            raise MoestreamError(f"--{name.replace('_', '-')} must be positive, not {getattr(args, name)}")
    model, tokenizer = _load_for_text(args)
    name = args.model_name or Path(args.store).resolve().name
    config = ServerConfig(name, args.max_queue, args.request_timeout, args.default_max_tokens)
    app = create_app(model, tokenizer, config)

    def ready(port: int) -> None:
        where = f"[{args.host}]" if ":" in args.host else args.host
        print(f"moestream: serving {name} at http://{where}:{port}/v1 (OpenAI-compatible; /health, /metrics)", flush=True)

    try:
        serve(app, args.host, args.port, log_level=args.log_level, on_ready=ready)
    except OSError as e:
        raise MoestreamError(f"cannot listen on {args.host}:{args.port} ({e}); choose another --port or --host") from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moestream",
        description="Run Mixture-of-Experts models larger than memory: dense weights stay resident, "
        "experts stream from SSD through a byte-budgeted cache.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"moestream {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("convert", help="convert a Hugging Face MoE checkpoint directory into a store")
    p.add_argument("src", help="checkpoint directory: config.json, *.safetensors, tokenizer files")
    p.add_argument("dst", help="store directory to create")
    p.add_argument(
        "--experts-dtype",
        choices=EXPERT_FORMATS,
        default=None,
        help="how expert weights are stored: bf16/fp16/fp32, or int8 (per channel), int4, int3, int2 (per "
        "group, affine); default: the checkpoint's float dtype (bf16 for FP8/MXFP4 sources). Fewer bits "
        "read less from disk and cache more experts; `moestream eval` shows what they cost in quality",
    )
    p.add_argument(
        "--layer-dtype",
        action="append",
        default=[],
        metavar="LAYERS=DTYPE",
        help="override --experts-dtype for some MoE layers (counted from 0 over the MoE layers, negative from "
        "the end), e.g. --layer-dtype 0-3=int3 --layer-dtype -1=int4; repeatable, later rules win",
    )
    p.add_argument(
        "--group-size", type=int, default=32, choices=[32, 64, 128], help="weights per scale for int4/int3/int2 (default 32)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--trust-remote-code", action="store_true", help="allow a config that names custom modeling code")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("generate", help="generate text, streaming experts under a memory budget")
    p.add_argument("store", help="store directory made by `moestream convert`")
    _add_memory(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding (deterministic)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default 0.95)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    p.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead of streaming")
    p.add_argument("--io-threads", type=int, default=4, help="parallel expert reads (default 4)")
    p.add_argument("--buffered-io", action="store_true", help="the same as --io buffered")
    p.add_argument(
        "--verify",
        choices=["first", "always", "off"],
        default="first",
        help="check expert records against their checksums on the first read of each (default), on every "
        "read, or never; resident files are checked at load unless off",
    )
    _add_policy(p)
    _add_prefetch_and_io(p)
    p.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE.npz",
        help="record this run's routing (expert ids and weights per token and layer) for `moestream simulate`",
    )
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser(
        "trace",
        help="record which experts a text routes to, per token and layer, into a trace file",
        description="Feed a text through the model as decoding would (the first --prefill tokens as one prompt, "
        "then one token at a time with the KV cache) and record, for every token and MoE layer, the chosen "
        "expert ids and weights, with the store's identity and shape. Replay it with `moestream simulate` "
        "or `moestream plan --trace` to choose a budget and a policy without running the model again.",
    )
    p.add_argument("store", help="store directory made by `moestream convert`")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to route, ideally like what you will run")
    p.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="record the first N tokens (default 1024)")
    p.add_argument(
        "--prefill", type=int, default=0, metavar="N", help="feed the first N tokens as one prompt call (default 0: every token decoded alone)"
    )
    p.add_argument("-o", "--output", required=True, metavar="FILE.npz", help="trace file to write")
    _add_memory(p)
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser(
        "simulate",
        help="replay a trace through the cache policies at several budgets, next to the optimum",
        description="Replay a routing trace through the runtime's own cache and policies (no model, no disk): hit "
        "rate, fraction of the optimum and expert bytes read per token for each budget and policy, next to "
        "Belady's MIN (evict the expert needed farthest in the future), the upper bound no policy can pass. The "
        "simulator makes the runtime's cache operations in the runtime's order, so its hit counts are the ones "
        "`generate --policy P --memory M` gets on the same routing from demand reads (speculative prefetch reads "
        "are not in a trace).",
    )
    p.add_argument("trace", help="a trace file from `moestream trace` or `generate --trace-out`")
    p.add_argument(
        "--memory",
        default="5%,10%,20%,30%,50%",
        help="comma-separated expert cache budgets: sizes (1GiB,2GiB) or shares of all experts (10%%); default "
        "5%%,10%%,20%%,30%%,50%%",
    )
    p.add_argument("--policy", default="lru,lfu,arc", help="comma-separated policies to compare (default lru,lfu,arc)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument(
        "--plot",
        default=None,
        metavar="DIR",
        help="also write PNGs to DIR: hit rate against budget per policy with the optimum (on these budgets and a "
        "grid from the minimum to all experts), expert popularity per layer, reuse distance histogram (needs matplotlib)",
    )
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser(
        "plan",
        help="sizes, cache and expected speed of a model from its config.json alone, before downloading it",
        description="From a config.json (or a checkpoint or store directory) alone, no weights: the exact resident "
        "and expert bytes moestream would store (the model is built on the meta device), bytes per expert and "
        "per token, the expert cache that --memory leaves, the expected hit rate (replayed from --trace, else a "
        "stated prior) and a tokens/s forecast, or that the model does not fit and the minimum --memory. "
        "Example configs are in examples/configs/.",
    )
    p.add_argument("config", help="config.json, or a Hugging Face checkpoint directory, or a store")
    p.add_argument("--memory", default="16GiB", help="all the memory moestream may use: resident weights + runtime + expert cache (default 16GiB)")
    p.add_argument(
        "--cache",
        default=None,
        metavar="SIZE",
        help="give the expert cache budget itself (what generate/bench call --memory) instead of deriving it from --memory",
    )
    p.add_argument("--bits", type=int, default=16, choices=[16, 8, 4, 3, 2], help="expert format: 16 = bf16, 8 = int8, 4/3/2 = int4/int3/int2 (default 16)")
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="weights per scale for 4/3/2 bits (default 32)")
    p.add_argument("--overhead", default="512MiB", help="memory for the Python/torch runtime, activations and KV cache (default 512MiB)")
    p.add_argument("--trace", default=None, metavar="FILE.npz", help="a routing trace of this model: hit rate replayed through the cache")
    _add_policy(p)
    p.add_argument(
        "--disk-bandwidth",
        default=None,
        metavar="BW",
        help="the disk's read speed, e.g. 3GB/s (reads then cost bytes / speed, no latency), or auto: time 1..top_k random "
        "records read at once, as a decode step's misses are, O_DIRECT, from a temporary file in --disk-dir (writes "
        "and deletes about 256 MiB). Without it, no tokens/s forecast",
    )
    p.add_argument("--disk-dir", default=".", help="where --disk-bandwidth auto probes (default: the current directory)")
    p.add_argument("--io-threads", type=int, default=4, help="parallel expert reads, as in generate/bench (default 4)")
    p.add_argument(
        "--compute",
        default="bandwidth",
        metavar="HOW",
        help="per-token compute with every expert cached: measure (build the model cut to 1 and 4 MoE layers with "
        "random weights, convert and time it here; takes memory and time for big models), bandwidth (default: the "
        "active weights at this machine's memory bandwidth, a lower bound), none, or milliseconds per token",
    )
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("inspect", help="sizes of a store and what a memory budget buys")
    p.add_argument("store")
    p.add_argument("--memory", default=None, help="show what this expert cache budget holds")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "verify",
        help="check a store's files and every record's checksum; exit 1 listing what is damaged",
        description="Check the manifest against the files (sizes, offsets, alignment), every expert record's "
        "checksum and the resident safetensors files. Exits 0 when the store is intact, 1 with a list of "
        "problems (file, layer, expert, offset) when it is not.",
    )
    p.add_argument("store")
    p.add_argument(
        "--quick",
        action="store_true",
        help="check a sample of records per layer (first, last and random ones) and resident headers only",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "eval",
        help="how far a store's next-token predictions are from a reference's: perplexity, KL, top-1 agreement",
        description="Run a store and a reference model on the same text and compare their next-token "
        "distributions: perplexity of each, the store's perplexity change in %, KL(reference || store) mean "
        "and 99th percentile over positions, and top-1 agreement. The text is tokenized by the store's "
        "tokenizer and cut into non-overlapping windows of --context tokens; each window is one "
        "teacher-forced forward of each model. Use it to measure what a conversion or an expert format costs.",
    )
    p.add_argument("store", help="store directory made by `moestream convert`")
    p.add_argument(
        "--reference",
        required=True,
        metavar="REF",
        help="the Hugging Face checkpoint directory the store was converted from (loaded by transformers in "
        "its own dtype, safetensors only, no custom code), or another store",
    )
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to evaluate on, ideally text the model was not trained on")
    p.add_argument("--max-tokens", type=int, default=1024, metavar="N", help="evaluate the first N tokens of the text (default 1024)")
    p.add_argument(
        "--context",
        type=int,
        default=256,
        metavar="C",
        help="tokens per window (default 256); the first token of each window is context only, so a window "
        "of C tokens scores C-1 predictions",
    )
    p.add_argument(
        "--memory",
        default="1GiB",
        metavar="M",
        help="expert cache budget of the store, and of REF if it is a store (default 1GiB); a smaller budget "
        "makes the evaluation slower but never changes its numbers",
    )
    p.add_argument(
        "--reference-dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="load a checkpoint REF in this dtype instead of its own: float32 compares against full "
        "precision (a bf16 store then shows what bf16 arithmetic alone costs)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser(
        "bench",
        help="decode speed against the disk's limit, measured in one run (optionally against peers)",
        description="Measure decode tokens/s, time to first token, hit rate and expert bytes read per token, "
        "the disk bandwidth on this run's own decode reads (replayed with O_DIRECT through the engine's reader, in "
        "the engine's batches), the I/O floor "
        "(bytes missed per token / bandwidth + all-hits compute) and efficiency = floor / measured time.",
    )
    p.add_argument("store")
    _add_memory(p)
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (default 32)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens to decode (default 32)")
    p.add_argument("--text", default=None, metavar="FILE", help="take the prompt from this text (default: random token ids)")
    p.add_argument(
        "--squeeze",
        default="0",
        metavar="SIZE",
        help="hold this much anonymous memory in a helper process during the run, so the machine behaves like "
        "a smaller one (there is no swap: it stays resident)",
    )
    p.add_argument(
        "--compare",
        default=None,
        metavar="CHECKPOINT",
        help="also run the peers on this Hugging Face checkpoint (the store's source): transformers fully "
        "loaded (if it fits) and transformers + accelerate disk offload at the same --memory",
    )
    p.add_argument(
        "--compare-gguf",
        default=None,
        metavar="FILE.gguf",
        help="also run llama.cpp (pip install llama-cpp-python) on this GGUF conversion of the same checkpoint, "
        "mmap'd; it caches in the page cache, so give it the same memory with --squeeze",
    )
    p.add_argument("--io-threads", type=int, default=4, help="parallel expert reads (default 4)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    _add_policy(p)
    _add_prefetch_and_io(p)
    p.add_argument(
        "--trace-out", default=None, metavar="FILE.npz", help="record the measured run's routing for `moestream simulate` / `plan --trace`"
    )
    p.set_defaults(func=cmd_bench)

    text_options = argparse.ArgumentParser(add_help=False)
    text_options.add_argument("store", help="store directory made by `moestream convert` (with tokenizer files)")
    _add_memory(text_options)
    text_options.add_argument("--io-threads", type=int, default=4, help="parallel expert reads (default 4)")
    text_options.add_argument("--buffered-io", action="store_true", help="the same as --io buffered")
    text_options.add_argument(
        "--verify",
        choices=["first", "always", "off"],
        default="first",
        help="check expert records against their checksums on the first read of each (default), on every read, or never",
    )
    _add_policy(text_options)
    _add_prefetch_and_io(text_options)

    p = sub.add_parser(
        "chat",
        parents=[text_options],
        help="talk with a store in the terminal, through the checkpoint's chat template",
        description="A conversation in the terminal. Each message goes through the checkpoint's chat template "
        "(a plain 'User: ... Assistant:' format when it has none) with the conversation so far; the answer "
        "streams as it is generated. When the conversation outgrows the model's context, the oldest exchanges "
        "are dropped. Commands: /stats (hit rate, MB read, tokens/s, RSS), /reset (new conversation), /exit "
        "(or Ctrl-D). Ctrl-C stops the current answer, not the program.",
    )
    p.add_argument("--system", default=None, help="a system message that opens every conversation")
    p.add_argument("--max-new-tokens", type=int, default=512, help="the longest answer, in tokens (default 512)")
    p.add_argument("--greedy", action="store_true", help="greedy decoding: always the most likely token")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold (default 0.95)")
    p.add_argument("--seed", type=int, default=None, help="seed the conversation's sampling: the same messages give the same answers")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser(
        "serve",
        parents=[text_options],
        help="serve a store over an OpenAI-compatible HTTP API (needs `pip install 'moestream[server]'`)",
        description="Serve a store over HTTP with OpenAI's API, so that the `openai` package and other clients "
        "work unchanged: GET /v1/models, POST /v1/chat/completions and /v1/completions (stream true or false; "
        "max_tokens, temperature, top_p, stop, seed; usage), GET /health, GET /metrics (Prometheus). One "
        "sequence runs at a time; other requests wait in a first-in first-out queue, and each answer is the "
        "one the request would get alone with the same seed. A client that disconnects cancels its request.",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one and prints it)")
    p.add_argument("--model-name", default=None, help="the model id clients send (default: the store directory's name)")
    p.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait for the model; more get 429 (default 64)"
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="the longest a request may take, queueing included; then it is cancelled (default 600)",
    )
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help="answer length of a chat request that sets no max_tokens (default 512; completions: 16, as OpenAI)",
    )
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info", help="uvicorn's log level (default info: one line per request)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("demo", help="build a synthetic MoE, convert it and stream it under a sweep of budgets")
    p.add_argument("--workdir", default=None, help="where to build the demo model (default: a temporary directory)")
    p.add_argument("--tokens", type=int, default=24, help="tokens generated per budget (default 24)")
    p.add_argument("--quick", action="store_true", help="a smaller model, for a fast check")
    p.set_defaults(func=cmd_demo)
    return parser


def _attach_negative_layer_rules(argv: list[str]) -> list[str]:
    """`--layer-dtype -1=int4` -> `--layer-dtype=-1=int4`: argparse takes a value that starts with "-"
    and is not a plain number for an option of its own, and counting from the last layer is the point."""
    out = []
    for arg in argv:
        if out and out[-1] == "--layer-dtype" and arg.startswith("-"):
            out[-1] = f"--layer-dtype={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(_attach_negative_layer_rules(sys.argv[1:] if argv is None else argv))
    try:
        return args.func(args)
    except MoestreamError as e:
        print(f"moestream: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nmoestream: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""`moestream serve`: its options and what it runs (the work itself: moestream.server.run)."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from ..errors import MoestreamError, UsageError
from ..options import (
    add_chat_template_argument,
    add_kv_disk_arguments,
    add_kv_memory_argument,
    add_store_arguments,
    kv_disk_directory,
    load_model,
    non_negative,
    positive,
)
from ..units import format_bytes, parse_bytes

DESCRIPTION = (
    "Serve a store over HTTP with OpenAI's and Anthropic's APIs, so that the `openai` and `anthropic` packages, "
    "agent CLIs and other clients work unchanged: GET /v1/models, POST /v1/chat/completions, /v1/completions, "
    "/v1/responses and /v1/messages (also without the /v1 prefix; streamed or not; "
    "sampling, stop sequences, seed, n, logprobs, logit_bias, JSON-schema outputs, tool calls; docs/guides/serving-and-agents.md lists "
    "every field, and one that is not honoured is refused by name), GET /health, GET /metrics (Prometheus). Up "
    "to --max-batch requests "
    "are decoded together, so each step reads every needed expert once for all of them; more wait in a "
    "first-in first-out queue. Recent conversations' KV is kept (--kv-memory), so a follow-up prefills only its "
    "new tokens. A seeded request gets the answer it would get alone. A client that disconnects cancels its "
    "request; --request-timeout, if given, bounds each."
)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    parser.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks a free one and prints it)"
    )
    parser.add_argument("--model-name", default=None, help="the model id clients send (default: the store directory's name)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MOESTREAM_API_KEY"),
        metavar="KEY",
        help="answer /v1 requests only when they carry `Authorization: Bearer KEY` (the openai client's api_key); "
        "others get 401. /health and /metrics stay open. Default: $MOESTREAM_API_KEY, or no key",
    )
    add_chat_template_argument(parser)
    parser.add_argument(
        "--cors",
        default=None,
        metavar="ORIGINS",
        help="let browser front-ends on these origins call the API: a comma-separated list such as "
        "http://localhost:3000,https://chat.example.org, or * for any (default: none; the browser then blocks "
        "pages of other origins)",
    )
    parser.add_argument(
        "--max-queue", type=int, default=64, metavar="N", help="requests that may wait for the model; more get 429 (default 64)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the longest a request may take, queueing included; then it is cancelled (default: no limit, as in "
        "llama.cpp's and vLLM's servers: an agent's first prompt can take many minutes to read on a CPU, and a "
        "client that gives up and disconnects cancels its request anyway)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, the time the stop may take: running requests go on until a few seconds "
        "before it (new ones get 503 with Retry-After), then the rest end with an error event and the server "
        "exits 0 within it. A second signal exits at once (default 30)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        metavar="N",
        help="answer length of a chat or responses request that sets no max_tokens / max_output_tokens (default "
        "512; completions: 16, as OpenAI). Agents often send none: a long tool call needs room",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=None,
        metavar="N",
        help="the context window served, in tokens: prompt plus answer (default: the model's own, from its config; "
        "a larger N is refused). /v1/models and /props report it; a longer prompt gets each API's "
        "context-length error, which agents answer by compacting",
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=8,
        metavar="N",
        help="the most requests decoded together (default 8; 1: one at a time). A step of N sequences reads each "
        "needed expert once for all of them",
    )
    parser.add_argument(
        "--batch-kv-memory",
        default="2GiB",
        metavar="SIZE",
        help="KV cache the running requests may hold together (default 2GiB): a request joins the batch only while "
        "every running one's prompt + max_tokens still fits, and one that could never fit is refused (400)",
    )
    add_kv_memory_argument(parser)
    add_kv_disk_arguments(parser)
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        metavar="N",
        help="feed a newcomer's prompt N tokens per step while other requests decode, so a long prompt slows them "
        "instead of stopping them; costs the newcomer time, since each part visits most experts again (default: "
        "one pass)",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="before serving, run each bf16/fp16 matmul shape the model will meet (every bucketed row count up to "
        "the context), for at most this long (default 10; 0: none), so the memory the CPU's matmul library keeps "
        "per shape is there from the start instead of growing over hours of serving",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level (default info: one line per request)"
    )


def cors_origins(value: str | None) -> tuple[str, ...]:
    """--cors as a tuple of origins (scheme://host[:port], or *)."""
    if value is None:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
            raise UsageError(f"--cors takes origins such as http://localhost:3000 (or *), not {origin!r}")
    if not origins:
        raise UsageError("--cors takes at least one origin (or *)")
    return origins


def run(args: argparse.Namespace) -> int:
    """Check the options, load the store, and serve until interrupted."""
    from ..generation.generate import context_length
    from ..generation.worker import ModelThread
    from ..server.run import serve

    positive(args.max_queue, "--max-queue")
    if args.request_timeout is not None:
        positive(args.request_timeout, "--request-timeout")
    non_negative(args.shutdown_timeout, "--shutdown-timeout")
    positive(args.default_max_tokens, "--default-max-tokens")
    positive(args.max_batch, "--max-batch")
    if args.prefill_chunk is not None:
        positive(args.prefill_chunk, "--prefill-chunk")
    non_negative(args.warmup, "--warmup")
    batch_kv = positive(parse_bytes(args.batch_kv_memory), "--batch-kv-memory")
    kv_memory = non_negative(parse_bytes(args.kv_memory), "--kv-memory")
    kv_disk_memory = positive(parse_bytes(args.kv_disk_memory), "--kv-disk-memory")
    origins = cors_origins(args.cors)
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535 (0: any free port), not {args.port}")
    try:
        import uvicorn  # noqa: F401  (checked here, before the model loads; serve() uses it)

        from ..core.runtime import runtime_of
        from ..server.http_app import ServerConfig, create_app
    except ImportError as e:
        raise MoestreamError(
            f"the server needs FastAPI, uvicorn and prometheus_client ({e}); install them with: pip install 'moestream[server]'"
        ) from None

    if args.context is not None:
        positive(args.context, "--context")
    model_thread = ModelThread()  # loads the model and then steps it: one thread on it (ModelThread says why)
    model, tokenizer = model_thread.call(load_model, args, need_tokenizer=True)
    own_context = context_length(model)
    if args.context is not None and own_context is not None and args.context > own_context:
        raise UsageError(
            f"--context {args.context} is beyond this model's context window ({own_context} tokens, its config's "
            f"max_position_embeddings); give at most {own_context}, or leave --context out"
        )
    if args.warmup > 0:
        from ..core.runtime import warm_matmul_shapes
        from ..generation.generate import PREFILL_PIECE

        rows = min(args.context or own_context or PREFILL_PIECE, PREFILL_PIECE)  # the most rows one forward pass runs
        warmed = model_thread.call(warm_matmul_shapes, model, rows, args.warmup)
        if warmed.of:
            print(
                f"moestream: warm-up ran {warmed.built} of {warmed.of} matmul shapes in {warmed.seconds:.1f} s (--warmup)",
                flush=True,
            )
    name = args.model_name or Path(args.store).resolve().name
    config = ServerConfig(
        name,
        args.max_queue,
        args.request_timeout,
        args.default_max_tokens,
        args.max_batch,
        batch_kv,
        kv_memory,
        args.prefill_chunk,
        args.api_key or None,
        origins,
        args.context,
        kv_disk_directory(args.kv_disk, args.store) if kv_memory > 0 else None,
        kv_disk_memory,
    )
    app = create_app(model, tokenizer, config, model_thread)

    def ready(port: int) -> None:
        where = f"[{args.host}]" if ":" in args.host else args.host
        print(
            f"moestream: memory budgets: experts {format_bytes(parse_bytes(args.memory))} (--memory), running requests' "
            f"KV {format_bytes(batch_kv)} (--batch-kv-memory, up to {args.max_batch} together), reused prefixes' KV "
            f"{format_bytes(kv_memory)} (--kv-memory)"
            + (f", on disk {format_bytes(kv_disk_memory)} in {config.kv_disk} (--kv-disk)" if config.kv_disk else "")
            + "; resident weights come on top",
            flush=True,
        )
        print(f"moestream: serving {name} at http://{where}:{port}/v1 (OpenAI-compatible; /health, /metrics)", flush=True)

    try:
        serve(app, args.host, args.port, log_level=args.log_level, on_ready=ready, shutdown_timeout=args.shutdown_timeout)
    except OSError as e:
        raise MoestreamError(f"cannot listen on {args.host}:{args.port} ({e}); choose another --port or --host") from None
    finally:
        runtime_of(model).close()  # the reader's threads end now, not when the interpreter waits for them
    return 0

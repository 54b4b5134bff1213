"""`moestream eval`: its options and what it runs (the work itself: moestream.tools.quality)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..choices import ACTIVATIONS, EVAL_CONTEXT, EVAL_MAX_TOKENS, EVAL_MEMORY, REFERENCE_DTYPES
from ..errors import UsageError

DESCRIPTION = (
    "Run a store and a reference model on the same text and compare their next-token "
    "distributions: perplexity of each, the store's perplexity change in percent, KL(reference || store) mean "
    "and 99th percentile over positions, and top-1 agreement. The text is tokenized by the store's "
    "tokenizer and cut into non-overlapping windows of --context tokens; each window is one "
    "teacher-forced forward of each model. Use it to measure what a conversion or an expert format costs."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from ..options import (
        add_activations_argument,
        add_attention_argument,
        add_device_arguments,
        add_kv_cache_argument,
        add_route_to_cached_argument,
        add_threads_argument,
    )

    parser.add_argument("store", help="store directory made by `moestream convert`")
    add_threads_argument(parser)
    parser.add_argument(
        "--reference",
        required=True,
        metavar="REF",
        help="the Hugging Face checkpoint directory the store was converted from (loaded by transformers in "
        "its own dtype, safetensors only, no custom code), another store, or a llama.cpp .gguf file (its blocks "
        "dequantized into a temporary float32 store beside STORE, removed afterwards: the float model the file "
        "stands for)",
    )
    parser.add_argument(
        "--text", required=True, metavar="FILE", help="UTF-8 text to evaluate on, ideally text the model was not trained on"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=EVAL_MAX_TOKENS,
        metavar="N",
        help=f"evaluate the first N tokens of the text (default {EVAL_MAX_TOKENS})",
    )
    parser.add_argument(
        "--context",
        type=int,
        default=EVAL_CONTEXT,
        metavar="C",
        help=f"tokens per window (default {EVAL_CONTEXT}); the first token of each window is context only, so a window "
        "of C tokens scores C-1 predictions",
    )
    parser.add_argument(
        "--memory",
        default=EVAL_MEMORY,
        metavar="M",
        help=f"expert cache budget of the store, and of REF if it is a store (default {EVAL_MEMORY}); a smaller budget "
        "makes the evaluation slower but never changes its numbers (unless --route-to-cached)",
    )
    parser.add_argument(
        "--reference-dtype",
        choices=list(REFERENCE_DTYPES),
        default=None,
        help="load a checkpoint REF in this dtype instead of its own: float32 compares against full "
        "precision (a bf16 store then shows what bf16 arithmetic alone costs)",
    )
    parser.add_argument(
        "--decode",
        action="store_true",
        help="the store predicts each window one token at a time with its KV cache, as it generates (slower); "
        "what decode-time behaviour costs, e.g. --route-to-cached under a small --memory",
    )
    add_route_to_cached_argument(parser)
    add_activations_argument(parser)
    parser.add_argument(
        "--reference-activations",
        choices=list(ACTIVATIONS),
        default="float",
        help="what the low-bit matmuls of a store REF take (default float): `moestream eval STORE --reference STORE "
        "--activations int8` prices int8 activations alone",
    )
    add_attention_argument(parser)  # (a store reference keeps sdpa: --decode prices the kernel)
    add_kv_cache_argument(parser)
    add_device_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")


def run(args: argparse.Namespace) -> int:
    from ..options import check_device, read_text_file
    from ..tools.quality import compare

    check_device(args)
    if not Path(args.reference).exists():
        raise UsageError(
            f"--reference {args.reference} does not exist; pass the checkpoint directory or store to compare against"
        )
    report = compare(
        args.store,
        args.reference,
        read_text_file(args.text, "--text"),
        max_tokens=args.max_tokens,
        context=args.context,
        memory=args.memory,
        reference_dtype=args.reference_dtype,
        progress=not args.json,
        device=args.device,
        gpu_memory=args.gpu_memory,
        decode=args.decode,
        route_to_cached=args.route_to_cached,
        activations=args.activations,
        reference_activations=args.reference_activations,
        attention=args.attention,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    print(json.dumps(report.to_json()) if args.json else report.table())
    return 0

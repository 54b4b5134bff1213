"""`moestream convert`: its options and what it runs (the work itself: moestream.conversion.convert)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..choices import DEFAULT_GROUP_SIZE, DENSE_FORMATS, EXPERT_FORMATS, GROUP_SIZES
from ..errors import UsageError

DESCRIPTION = (
    "Convert a Hugging Face MoE checkpoint directory (safetensors) into a moestream store, reading one tensor "
    "at a time, then print the store's sizes as `moestream inspect` does. The store appears only when complete."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "src",
        help="checkpoint directory (config.json, *.safetensors, tokenizer files), or a llama.cpp .gguf file of a "
        "qwen3moe, qwen2moe, Mixtral, DeepSeek-V2/V3/R1 (deepseek2) or gpt-oss model (its blocks kept at their bits where a store format holds them, else dequantized and stored as the options say)",
    )
    parser.add_argument("dst", help="store directory to create")
    parser.add_argument(
        "--experts-dtype",
        choices=EXPERT_FORMATS,
        default=None,
        help="how expert weights are stored: bf16/fp16/fp32, or int8 (per channel), int6, int4, int3, int2 (per "
        "group, affine); default: the checkpoint's float dtype (bf16 for FP8/MXFP4 sources), and for a GGUF "
        "each layer at the bits of its blocks (Q4_x: int4, keeping the codes; Q5_x, Q6_K: int6; Q8_0: int8; "
        "Q3_K: int3; Q2_K: int2). Fewer bits read less from disk and cache more experts; `moestream eval` "
        "shows what they cost in quality",
    )
    parser.add_argument(
        "--layer-dtype",
        action="append",
        default=[],
        metavar="LAYERS=DTYPE",
        help="override --experts-dtype for some MoE layers (counted from 0 over the MoE layers, negative from "
        "the end), e.g. --layer-dtype 0-3=int3 --layer-dtype -1=int4; repeatable, later rules win",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        choices=GROUP_SIZES,
        help=f"weights per scale for int6/int4/int3/int2 (default {DEFAULT_GROUP_SIZE}, int6 64; for a GGUF 32, its "
        "blocks' size, which keeps the codes of its 4-bit blocks)",
    )
    parser.add_argument(
        "--dense-dtype",
        choices=DENSE_FORMATS,
        default=None,
        help="how the resident linear layers (attention, shared experts, dense MLPs, an untied LM head; not the "
        "routers) are stored: float (the model's dtype, default), int8 (per channel), int6 or int4 (per group, "
        "--group-size; int6 64 by default), the LM head never below int6 (llama.cpp's Q4 files keep it Q6_K); "
        "default for a GGUF: each at the bits of its blocks (4 bits: int4, 5-6: int6, 7-8: int8, float: float). "
        "They are read for every token, so fewer bits decode faster and leave more memory to the expert cache",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="take the tokenizer (tokenizer.json, tokenizer_config.json, chat template, ...) from this directory "
        "instead of the source's: for a GGUF whose tokenizer transformers cannot rebuild from its metadata, or a "
        "checkpoint without tokenizer files",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow a config that names custom modeling code")


def run(args: argparse.Namespace) -> int:
    from ..conversion.convert import convert
    from ..conversion.inspect_store import print_inspect

    if not Path(args.src).is_dir() and not Path(args.src).is_file():
        what = "does not exist" if not Path(args.src).exists() else "is neither a directory nor a file"
        raise UsageError(
            f"{args.src} {what}; pass a Hugging Face checkpoint directory (config.json, *.safetensors) or a .gguf file"
        )
    if Path(args.dst).exists() and not Path(args.dst).is_dir():
        raise UsageError(
            f"{args.dst} is a file; pass the path of a store directory to create (--overwrite replaces only a directory)"
        )
    if Path(args.src).is_file():
        _use_compiled_kernels(Path(args.src))
    dst = convert(
        args.src,
        args.dst,
        args.experts_dtype,
        layer_dtypes=args.layer_dtype,
        group_size=args.group_size,
        dense_dtype=args.dense_dtype,
        overwrite=args.overwrite,
        trust_remote_code=args.trust_remote_code,
        tokenizer=args.tokenizer,
    )
    return print_inspect(dst, None)


# A GGUF this large imports for minutes at least: worth the compiled kernels' one build (about 30 s of one core).
BACKGROUND_BUILD_BYTES = 16 * 2**30


def _use_compiled_kernels(path: Path) -> None:
    """Have a GGUF's blocks read by the compiled kernels (4-bit codes re-paired, Q6_K rows made int8 or int4:
    a fifth of a Q4_0 import's CPU time, and 5 s of a 150k-token LM head's): where they are built already,
    from the first record; for a large file whose kernels are not built yet, from when a background build
    ends; for a small one, not (a build would take longer than it saves)."""
    from ..conversion import gguf_blocks
    from ..conversion.gguf_source import _split_files

    try:
        size = sum(f.stat().st_size for f in _split_files(path))
    except Exception:  # the converter names what is wrong with the file
        size = 0
    gguf_blocks.use_compiled_kernels(build=size >= BACKGROUND_BUILD_BYTES)

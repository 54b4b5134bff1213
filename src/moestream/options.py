"""Command-line options shared by the verbs, each defined once.

Every verb's module in commands/ owns its parser: optionally `DESCRIPTION`, `add_arguments(parser)` and
`run(args)`; cli.py only lists the verbs (and their help line). What several verbs share lives here: the
store and its engine options (generate, chat, serve, bench), the policy and I/O-thread options (also
plan), and checks of argument values that turn bad input into one-line errors.

The choices are choices.py's names, which the engine's modules take too; nothing here imports torch or the
engine at import time, so that every verb's --help answers at once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .choices import (
    ACTIVATIONS,
    ATTENTION,
    COMPUTE_DTYPES,
    DEFAULT_POLICY,
    KV_CACHE_DTYPES,
    POLICIES,
    PREFETCH_MODES,
    VERIFY_MODES,
)
from .errors import MoestreamError, UsageError

#: `--io`: direct = O_DIRECT reads, expert bytes live only in moestream's cache; buffered = through the page cache.
IO_MODES = ("direct", "buffered")
#: `--device`: where the model computes.
DEVICES = ("cpu", "cuda")
DEFAULT_IO_THREADS = 4


def add_memory_argument(parser: argparse.ArgumentParser, default: str = "4GiB") -> None:
    parser.add_argument(
        "--memory",
        default=default,
        metavar="SIZE",
        help=f"expert cache budget, e.g. 512MiB, 4GiB (default {default}); resident weights come on top",
    )


def add_kv_memory_argument(parser: argparse.ArgumentParser, default: str = "1GiB") -> None:
    """--kv-memory: the prefix cache's budget (chat and serve)."""
    parser.add_argument(
        "--kv-memory",
        default=default,
        metavar="SIZE",
        help=f"KV cache of recent conversations kept for reuse, so that a follow-up (or a repeated system prompt) "
        f"prefills only its new tokens; least recently used out first (default {default}; 0 keeps none)",
    )


def add_kv_disk_arguments(parser: argparse.ArgumentParser) -> None:
    """--kv-disk and --kv-disk-memory: the prefix cache's tier on disk (serve)."""
    parser.add_argument(
        "--kv-disk",
        default="auto",
        metavar="DIR",
        help="keep the KV of prefixes that leave --kv-memory in files here, and all of them at a clean stop, so a "
        "conversation that comes back (after other conversations, or after a restart) reads its prefix instead of "
        "prefilling it again; auto (the default): a directory of this store's under $MOESTREAM_KV_DISK, else "
        "$XDG_CACHE_HOME/moestream/kv (~/.cache/moestream/kv); off: none. Files of another store, KV layout or version are never loaded",
    )
    parser.add_argument(
        "--kv-disk-memory",
        default="8GiB",
        metavar="SIZE",
        help="disk space the KV tier may use, least recently used out first (default 8GiB)",
    )


def kv_disk_directory(value: str, store: str | os.PathLike) -> str | None:
    """--kv-disk as a directory (None: off); auto is this store's directory under the user's cache."""
    if value == "off":
        return None
    if value != "auto":
        return value
    from .conversion.store import MANIFEST, file_checksum  # (the store's identity: its manifest's checksum)

    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.environ.get("MOESTREAM_KV_DISK") or os.path.join(cache, "moestream", "kv")
    return os.path.join(root, file_checksum(Path(store) / MANIFEST)[:16])


def add_policy_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policy",
        choices=list(POLICIES),
        default=DEFAULT_POLICY,
        help="expert cache eviction policy: forecast (default: evicts the expert least likely to be used at its layer's "
        "next call, forecast online from use counts and expert-to-expert transitions; the closest to the optimum on "
        "trained models' routing), lfu (decayed use counts: keeps popular experts), lru (least recently used), arc "
        "(adaptive recency/frequency). `moestream simulate` compares them on a recorded trace",
    )


def add_io_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--io-threads",
        type=int,
        default=DEFAULT_IO_THREADS,
        metavar="N",
        help=f"parallel expert reads (default {DEFAULT_IO_THREADS})",
    )


def physical_cores() -> int:
    """Cores (not hyper-threads) among the CPUs this process may run on: the default of --threads, since
    two threads on one core share its vector units and slow a matmul down rather than up."""
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return len(cpus)  # no topology exposed (containers, other systems): count every CPU
    return len(cores)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --gpu-memory: where the model computes, and its VRAM expert budget."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=DEVICES[0],
        help="where the model computes: cpu (default), or cuda: resident weights on the GPU, experts kept in VRAM "
        "(--gpu-memory) above the host cache (--memory, page-locked RAM), read from disk below both",
    )
    parser.add_argument(
        "--gpu-memory",
        default=None,
        metavar="SIZE",
        help="with --device cuda: the VRAM budget of experts (default: half of the VRAM free once the resident weights "
        "are on the GPU)",
    )


def check_device(args: argparse.Namespace) -> None:
    if args.gpu_memory is not None and args.device != "cuda":
        raise UsageError("--gpu-memory is the VRAM budget of --device cuda; add --device cuda, or leave it out")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads: torch's intra-op threads, set by cli.main before the verb runs."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="compute threads (torch intra-op; default: the physical cores this process may use, "
        f"{physical_cores()} here). On a machine shared with other services, give each fewer; expert reads "
        "run on --io-threads besides these",
    )


def apply_threads(args: argparse.Namespace) -> None:
    """Set torch's compute threads from --threads (or to the physical cores) for verbs that have it."""
    if not hasattr(args, "threads"):
        return
    import torch

    torch.set_num_threads(positive(args.threads, "--threads") if args.threads is not None else physical_cores())


def add_store_arguments(parser: argparse.ArgumentParser, memory_default: str = "4GiB") -> None:
    """The store positional, --memory and the engine options of load(): for every verb that loads a model."""
    parser.add_argument("store", help="store directory made by `moestream convert`")
    add_memory_argument(parser, memory_default)
    add_device_arguments(parser)
    add_threads_argument(parser)
    add_io_threads_argument(parser)
    parser.add_argument(
        "--io",
        choices=IO_MODES,
        default=IO_MODES[0],
        help="direct (default): O_DIRECT, expert bytes live only in the cache; buffered: reads go through the "
        "page cache and stay there, a second cache the OS owns",
    )
    parser.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default=VERIFY_MODES[0],
        help="check expert records against their checksums on the first read of each (default), on every "
        "read, or never; resident files are checked at load unless off",
    )
    add_policy_argument(parser)
    parser.add_argument(
        "--compute-dtype",
        choices=list(COMPUTE_DTYPES),
        default="auto",
        help="dtype of the float weights and activations: auto (default: the model's; a bf16 model computes in "
        "fp32 on a CPU without bf16 arithmetic, where bf16 matmuls are slower, holding its float resident "
        "weights at twice their size), bf16 or fp32",
    )
    add_activations_argument(parser)
    add_attention_argument(parser)
    add_kv_cache_argument(parser)
    parser.add_argument(
        "--prefetch",
        choices=PREFETCH_MODES,
        default=PREFETCH_MODES[0],
        # argparse %-formats help strings: a percent sign must be written %%.
        help="speculative reads of the next layer's likely experts (its router applied to this layer's hidden "
        "state), and exact reads of hash-routed layers' experts: auto (default; times decode steps with it on "
        "and off, keeps it on only if that is at least 3%% faster, re-checks every 256 steps), on, or off (no "
        "reads ahead of need)",
    )
    add_route_to_cached_argument(parser)


def add_activations_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--activations",
        choices=ACTIVATIONS,
        default=ACTIVATIONS[0],
        help="what the CPU's low-bit (int8/int6/int4/int3/int2) matmuls take: auto (default: int8 where the compiled "
        "kernels are measured faster on the model's shapes, as the fast-paths line says), int8 (each "
        "activation row quantized to int8 and the dot products kept in integers, as llama.cpp does: a little "
        "rounding, priced by `moestream eval STORE --reference STORE --activations int8`) or float (the "
        "activations as they are)",
    )


def add_attention_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--attention",
        choices=ATTENTION,
        default=ATTENTION[0],
        help="the model's attention: auto (default: a compiled flash-decoding kernel that reads each cached key "
        "and value once for its group of query heads, as the model's attention function; a float32 or bf16 prompt "
        "on a CPU with AVX-512 (bf16: with BF16) gets a compiled flash kernel, other prompts keep sdpa) or sdpa (transformers' own). "
        "The kernels sum in another order: `moestream eval STORE --reference STORE --activations float` prices "
        "them on prompts, with --decode on decode steps",
    )


def add_kv_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=KV_CACHE_DTYPES[0],
        help="what the KV cache holds: auto (default: keys and values in the compute dtype) or int8 (each "
        "position's row of a head as int8 codes and one scale, as llama.cpp's -ctk/-ctv q8_0: about half the "
        "bytes a decode step reads at long context, read by the attention kernel; a little rounding, priced by "
        "`moestream eval STORE --reference STORE --decode --kv-cache-dtype int8`)",
    )


def add_route_to_cached_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--route-to-cached",
        type=float,
        default=0.0,
        metavar="MARGIN",
        help="cache-aware routing, off by default (0): in a decode step, a chosen expert that is not cached gives "
        "way to a cached one whose router probability is at least (1 - MARGIN) times its own (0.2: within 20%%). "
        "Fewer reads under a small budget, but other outputs than the model's: price it first with "
        "`moestream eval --decode --route-to-cached MARGIN`. Softmax top-k routers only (Qwen3-MoE, Mixtral, OLMoE)",
    )


def engine_options(args: argparse.Namespace) -> dict:
    """The load() keyword options that add_store_arguments defined, checked."""
    positive(args.io_threads, "--io-threads")
    check_device(args)
    return dict(
        device=args.device,
        gpu_memory=args.gpu_memory,
        io_threads=args.io_threads,
        direct_io=args.io == "direct",
        verify=args.verify,
        policy=args.policy,
        prefetch=args.prefetch,
        compute_dtype=args.compute_dtype,
        activations=args.activations,
        route_to_cached=args.route_to_cached,
        attention=args.attention,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template file used instead of the checkpoint's (e.g. one that defines tool calls, or for "
        "a checkpoint that has none); it is tried on a short conversation before the model loads",
    )


def read_chat_template(path: str) -> str:
    """The text of a --chat-template file, once it has rendered a one-message conversation; a UsageError
    saying what is wrong otherwise (a template that fails only at the first request would fail every one)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    text = read_text_file(path, "--chat-template")
    conversation = [{"role": "user", "content": "Hello"}]  # no system message: some templates refuse one
    try:
        render_jinja_template(conversations=[conversation], chat_template=text, add_generation_prompt=True)
    except Exception as e:  # jinja2's syntax errors, and whatever the template raises itself
        raise UsageError(
            f"--chat-template {path} does not render a one-message conversation ({type(e).__name__}: {e}); "
            "pass a Jinja chat template such as a checkpoint's chat_template.jinja"
        ) from None
    return text


def load_model(args: argparse.Namespace, need_tokenizer: bool = True):
    """(model, tokenizer) of args.store under args.memory with the engine options; MoestreamError when
    the store has no tokenizer files and the verb needs them (tokenizer is None when need_tokenizer is False).
    A --chat-template replaces the tokenizer's template."""
    from .core.loading import close, fast_paths, load

    options = engine_options(args)
    chat_template = read_chat_template(args.chat_template) if getattr(args, "chat_template", None) else None
    model, tokenizer = load(args.store, args.memory, **options)
    print(fast_paths(model), file=sys.stderr)  # a slower path is never silent
    if tokenizer is None and need_tokenizer:
        close(model)
        raise MoestreamError(
            f"{args.store} has no tokenizer files; convert it again from a checkpoint directory that includes them "
            "(tokenizer.json or tokenizer.model)"
        )
    if chat_template is not None and tokenizer is not None:
        tokenizer.chat_template = chat_template
    return model, tokenizer


def positive(value: int | float, option: str) -> int | float:
    """`value` if it is > 0, else a UsageError naming the option."""
    if value is None or not value > 0:  # `not >` also refuses NaN
        raise UsageError(f"{option} must be positive, not {value}")
    return value


def non_negative(value: int | float, option: str) -> int | float:
    if value is None or not value >= 0:
        raise UsageError(f"{option} must be 0 or more, not {value}")
    return value


def read_text_file(path: str | os.PathLike, option: str = "--text") -> str:
    """The UTF-8 text of `path`, or a UsageError saying why it cannot be read and what to pass instead."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{option} {path}: no such file; pass an existing UTF-8 text file")
    if p.is_dir():
        raise UsageError(f"{option} {path} is a directory; pass a UTF-8 text file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{option} {path} is not UTF-8 text ({e.reason} at byte {e.start}); pass a UTF-8 text file") from None
    except OSError as e:
        raise UsageError(f"{option} {path} cannot be read ({e.strerror or e}); pass a readable UTF-8 text file") from None
    if not text.strip():
        raise UsageError(f"{option} {path} is empty; pass a file with some text in it")
    return text


def existing_file(path: str | os.PathLike, option: str, what: str = "file") -> Path:
    """`path` as a Path if it is an existing regular file, else a UsageError naming the option."""
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{option} {path}: no such file; pass an existing {what}")
    if p.is_dir():
        raise UsageError(f"{option} {path} is a directory; pass a {what}")
    return p


def writable_file(path: str | os.PathLike, option: str) -> Path:
    """`path` as a Path if a file can be written there (its directory exists and it is not a directory)."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path} is a directory; pass a file name to write")
    if not p.parent.is_dir():
        raise UsageError(f"{option} {path}: the directory {p.parent} does not exist; create it first")
    return p


def add_sampling_arguments(
    parser: argparse.ArgumentParser, max_new_tokens: int, seed_help: str = "random seed for sampling"
) -> None:
    """--max-new-tokens, --greedy, --temperature, --top-p, --seed: the decoding options of generate and chat."""
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=max_new_tokens,
        metavar="N",
        help=f"the most tokens to generate (default {max_new_tokens})",
    )
    parser.add_argument("--greedy", action="store_true", help="greedy decoding: always the most likely token (deterministic)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling threshold, in (0, 1] (default 0.95)")
    parser.add_argument("--seed", type=int, default=None, help=seed_help)


def sampling_params(args: argparse.Namespace):
    """The SamplingParams of the values add_sampling_arguments defined, checked before any model is loaded."""
    from .generation.generate import SamplingParams

    positive(args.max_new_tokens, "--max-new-tokens")
    non_negative(args.temperature, "--temperature")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], not {args.top_p}")
    temperature = 0.0 if args.greedy else args.temperature
    return SamplingParams(args.max_new_tokens, temperature=temperature, top_p=args.top_p, seed=args.seed)


def trace_output(path: str | os.PathLike, option: str) -> Path:
    """A trace file to write (`--trace-out`, `trace -o`): writable and ending in .npz, checked before the run."""
    p = writable_file(path, option)
    if p.suffix != ".npz":
        raise UsageError(f"{option} {path}: a trace file ends in .npz (numpy's format), e.g. {p.with_suffix('.npz')}")
    return p

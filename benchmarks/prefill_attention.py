"""A prompt's causal attention at the Qwen3-30B-A3B shape in bf16 or float32: moestream's prefill kernel against
torch's sdpa as the model's attention function called it before (its flash kernel, grouped heads as they are),
side by side over growing prompts; with --eval, what the kernel costs in quality.

    python benchmarks/prefill_attention.py [--threads 2] [--positions 1024 4096 8192 16384] [--dtype bf16|fp32]
        [--eval STORE --text FILE]   # also `moestream eval STORE --reference STORE`: the kernels against sdpa
        [--record]                   # the tables as this machine's record of prefill-attention (benchmarks/machine.py)

32 query heads, 4 key/value heads of 128 (grouped 8 to 1), a causal prompt of N tokens with no cached prefix:
the fastest of 3 calls of each, the two alternating. GFLOPS counts the causal half's two matmuls (2 x 2 x
N^2 / 2 x 128 x 32), what either must compute. The kernel needs AVX-512, and in bf16 AVX-512 BF16 (Intel
Cooper Lake, Sapphire Rapids and later; AMD Zen 4 and later); elsewhere prompts keep sdpa and this script
says so.

--eval runs the store against itself with sdpa (a store reference keeps sdpa) on teacher-forced windows of
--context tokens (prompts: the prefill kernel; one thread), both with float activations so that only the
attention differs.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time

import machine
import torch
import torch.nn.functional as F

EVAL_LINES = ("perplexity", "perplexity change", "KL(ref || store) mean", "KL(ref || store) p99", "top-1 agreement")


def fastest_s(function, runs: int = 3) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def price(store: str, text: str, context: int, tokens: int) -> list[list[str]]:
    """`moestream eval STORE --reference STORE` on `text`: its quality lines as table rows."""
    command = [
        sys.executable,
        "-m",
        "moestream.cli",
        "eval",
        store,
        "--reference",
        store,
        "--text",
        text,
        "--context",
        str(context),
    ]
    command += ["--max-tokens", str(tokens), "--activations", "float", "--reference-activations", "float", "--threads", "1"]
    output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    rows = []
    for line in output.splitlines():
        name, _, value = line.strip().partition("  ")
        if name in EVAL_LINES:
            rows.append([name, value.strip()])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--eval", metavar="STORE", help="a store whose model computes in bf16 here, to price the kernels with")
    parser.add_argument("--text", help="the text --eval runs on")
    parser.add_argument("--context", type=int, default=1024, help="--eval's window (default 1024)")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="--eval's tokens (default 8192)")
    machine.add_record_argument(parser, "prefill-attention")
    args = parser.parse_args()
    if args.eval and not args.text:
        parser.error("--eval needs --text")
    ext = machine.compiled_kernels()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if not ext.prefill_attention_ready(dtype == torch.bfloat16):
        sys.exit(f"this CPU has no AVX-512{' BF16' * (args.dtype == 'bf16')}: {args.dtype} prompts run torch's sdpa here")
    torch.set_num_threads(args.threads)
    print(f"machine: {machine.line()}; {args.threads} threads; {args.dtype}")
    print(f"{'prompt':>7} {'kernel s':>9} {'GFLOPS':>7} {'sdpa s':>8} {'GFLOPS':>7} {'speed-up':>8}")
    rows = []
    for positions in args.positions:
        g = torch.Generator().manual_seed(positions)
        q = torch.randn(1, 32, positions, 128, generator=g).to(dtype)
        k = (torch.randn(1, 4, positions, 128, generator=g) * 2).to(dtype)
        v = torch.randn(1, 4, positions, 128, generator=g).to(dtype)
        ours = functools.partial(ext.prefill_attention, q, k, v, None, 128**-0.5, True)
        theirs = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=128**-0.5, is_causal=True, enable_gqa=True)
        kernel, sdpa = float("inf"), float("inf")
        for _ in range(2):
            kernel, sdpa = min(kernel, fastest_s(ours)), min(sdpa, fastest_s(theirs))
        gflop = 2 * 2 * positions * positions / 2 * 128 * 32 / 1e9
        print(
            f"{positions:>7} {kernel:>9.3f} {gflop / kernel:>7.0f} {sdpa:>8.3f} {gflop / sdpa:>7.0f} {sdpa / kernel:>7.2f}x",
            flush=True,
        )
        rows.append(
            [
                f"{positions:,}",
                f"{kernel:.3f} s",
                f"{gflop / kernel:.0f}",
                f"{sdpa:.3f} s",
                f"{gflop / sdpa:.0f}",
                f"{sdpa / kernel:.2f}x",
            ]
        )
    tables = [
        machine.table(
            f"A causal {args.dtype} prompt at the 30B shape (32 query heads, 4 key/value heads of 128): the prefill kernel against "
            f"torch's sdpa (`is_causal`, `enable_gqa`), alternating, fastest of 3 calls, {args.threads} threads:",
            ["prompt tokens", "kernel", "GFLOPS", "sdpa", "GFLOPS", "speed-up"],
            rows,
        )
    ]
    if args.eval:
        quality = price(args.eval, args.text, args.context, args.eval_tokens)
        for name, value in quality:
            print(f"  {name:<24} {value}")
        tables.append(
            machine.table(
                f"What the attention kernels cost: `moestream eval` of the store against itself with sdpa, {args.eval_tokens:,} "
                f"tokens of text in teacher-forced windows of {args.context} (prompts: the prefill kernel), float activations in both:",
                ["measure", "value"],
                quality,
            )
        )
    if args.record:
        notes = (
            "GFLOPS: the causal half's two matmuls over the time. In bf16 the kernel rounds the softmax's weights to bf16 "
            "before the values' dot products, as torch's bf16 flash kernel does; it sums in its own order: its outputs are "
            "within their dtype's rounding of float64 attention and on average as close as sdpa's (tests/test_attention.py)."
        )
        path = machine.write_result(args.record, "Prefill attention: the flash kernel", machine.invocation(), tables, notes)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""One decode query's attention at the Qwen3-30B-A3B shape: moestream's flash-decoding kernel against torch's
sdpa as transformers calls it, side by side, over growing contexts.

    python benchmarks/decode_attention.py [--threads 2] [--positions 1024 4096 16384 32768] [--dtype bf16] [--simd avx2]
        [--record]      # the table as this machine's record of flash-decoding (benchmarks/machine.py)

32 query heads, 4 key/value heads of 128 (grouped 8 to 1), one query against T cached positions: the fastest
of 15 calls of each, the two alternating; GB/s is the keys' and values' bytes over that time (the bytes a
decode step must read: the floor of a long-context decode). --simd avx2 (or loops) runs the kernel's
loops of a plainer CPU on this one; with ATEN_CPU_CAPABILITY=avx2 torch's sdpa does likewise (the compiler's
part of the kernel keeps this CPU's clone, so this approximates an AVX2-only CPU from above).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import machine
import torch
import torch.nn.functional as F


def fastest_ms(function, runs: int = 15) -> float:
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--positions", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--simd", choices=["avx512", "avx2", "loops"], default="avx512", help="the most capable loops allowed")
    machine.add_record_argument(parser, "flash-decoding")
    args = parser.parse_args()
    ext = machine.compiled_kernels()
    torch.set_num_threads(args.threads)
    ext.decode_attention_simd(args.simd)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"machine: {machine.line()}; {args.threads} threads; {args.dtype}; kernel loops up to {args.simd}")
    print(f"{'positions':>9} {'kernel ms':>10} {'GB/s':>6} {'sdpa ms':>9} {'GB/s':>6} {'speed-up':>8}")
    rows = []
    for positions in args.positions:
        g = torch.Generator().manual_seed(positions)
        q = torch.randn(1, 32, 1, 128, generator=g).to(dtype)
        k, v = (torch.randn(1, 4, positions, 128, generator=g).to(dtype) for _ in range(2))
        kernel, sdpa = float("inf"), float("inf")
        ours = functools.partial(ext.decode_attention, q, k, v, None, 128**-0.5)
        theirs = functools.partial(F.scaled_dot_product_attention, q, k, v, scale=128**-0.5, enable_gqa=True)
        for _ in range(3):
            kernel, sdpa = min(kernel, fastest_ms(ours, 5)), min(sdpa, fastest_ms(theirs, 5))
        gigabytes = 2 * k.numel() * k.element_size() / 1e9
        print(
            f"{positions:>9} {kernel:>10.3f} {gigabytes / kernel * 1e3:>6.1f} {sdpa:>9.3f} {gigabytes / sdpa * 1e3:>6.1f} "
            f"{sdpa / kernel:>7.2f}x",
            flush=True,
        )
        rows.append(
            [
                f"{positions:,}",
                f"{kernel:.3f} ms",
                f"{gigabytes / kernel * 1e3:.1f}",
                f"{sdpa:.3f} ms",
                f"{gigabytes / sdpa * 1e3:.1f}",
                f"{sdpa / kernel:.2f}x",
            ]
        )
    if args.record:
        aten = os.environ.get("ATEN_CPU_CAPABILITY", "its own")
        caption = (
            f"One decode query at the 30B shape (32 query heads, 4 key/value heads of 128), {args.dtype} keys and values: "
            f"the kernel (loops up to {args.simd}) against torch's sdpa (`enable_gqa`, torch's {aten} dispatch), "
            f"alternating, fastest of 15 calls, {args.threads} threads:"
        )
        columns = ["positions", "kernel", "GB/s", "sdpa", "GB/s", "speed-up"]
        notes = "GB/s: the keys' and values' bytes over the time, the floor of a long-context decode step."
        path = machine.write_result(
            args.record,
            "Long context: the flash-decoding kernel",
            machine.invocation(),
            [machine.table(caption, columns, rows)],
            notes,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""One int8 matmul for an attention layer's q, k and v projections against three, for one token.

    python benchmarks/packed_qkv.py [--threads 2]

For each shape (the fixture's and Qwen3-30B-A3B's: hidden -> q, k, v widths) it builds random int8
weights with per-row scales as `--dense-dtype int8` stores them, checks that the packed matmul's columns
are bit-equal to the three matmuls' outputs (1, 3 and 17 rows, bf16 and float32 activations), and times
one row through `torch._weight_int8pack_mm` both ways in bf16: the best of 10 x 300 calls after 30
warm-up ones.
"""

import argparse
import time

import torch

SHAPES = {"fixture": (256, (256, 128, 128)), "qwen3-30b-a3b": (2048, (4096, 512, 512))}


def best_us(fn, calls: int = 300, repeats: int = 10, warm_up: int = 30) -> float:
    """The best of `repeats` runs of `calls` calls of fn, in microseconds per call (kv_growth.py too)."""
    for _ in range(warm_up):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; one token, bf16, best of 10 x 300 calls")
    print("| shape | q, k, v widths | bit-equal | packed | three |")
    print("| --- | --- | --- | --- | --- |")
    for name, (hidden, widths) in SHAPES.items():
        weights = [torch.randint(-127, 128, (n, hidden), dtype=torch.int8, generator=g) for n in widths]
        scales = [torch.rand(n, generator=g) + 0.5 for n in widths]
        packed_w, packed_s = torch.cat(weights), torch.cat(scales)
        equal = True
        for dtype in (torch.bfloat16, torch.float32):
            for rows in (1, 3, 17):
                x = torch.randn(rows, hidden, generator=g).to(dtype)
                whole = torch._weight_int8pack_mm(x, packed_w, packed_s.to(dtype))
                parts = [torch._weight_int8pack_mm(x, w, s.to(dtype)) for w, s in zip(weights, scales)]
                equal &= torch.equal(whole, torch.cat(parts, dim=1))
        x = torch.randn(1, hidden, generator=g).bfloat16()
        packed_s16, scales16 = packed_s.bfloat16(), [s.bfloat16() for s in scales]
        packed = best_us(lambda x=x, w=packed_w, s=packed_s16: torch._weight_int8pack_mm(x, w, s))
        parts = tuple(zip(weights, scales16))
        three = best_us(lambda x=x, parts=parts: [torch._weight_int8pack_mm(x, w, s) for w, s in parts])
        print(
            f"| {name}: {hidden} -> | {', '.join(map(str, widths))} | {'yes' if equal else 'NO'} | {packed:.1f} us | {three:.1f} us |"
        )


if __name__ == "__main__":
    main()

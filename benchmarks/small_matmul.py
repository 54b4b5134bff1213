"""What one expert's matmul costs at the fixture's width, by dtype and rows: the fixed cost that makes a
batched step's time grow with its distinct experts.

    python benchmarks/small_matmul.py [--threads 2] [--shapes 256x256,128x256] [--rows 1,4,16]

For each shape (K x N: x [rows, K] @ W[N, K].T) it times `F.linear` with bf16 weights and bf16
activations (how a bf16 record computes today), with float32 weights and activations, and with the
bf16 weight cast to float32 on each call, as the median of 2000 calls after 50 warm-up ones.
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def timed(fn, calls: int = 2000, repeats: int = 5) -> float:
    for _ in range(50):
        fn()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return statistics.median(runs) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", default="256x256,128x256,1024x512,512x1024")
    parser.add_argument("--rows", default="1,4,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; microseconds per call (median of 5 x 2000)")
    print("| K x N | rows | bf16 | fp32 | bf16 weight cast to fp32 per call |")
    print("| --- | --- | --- | --- | --- |")
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        weight = torch.randn(n, k).bfloat16()
        weight32 = weight.float()
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k)
            xb = x.bfloat16()
            bf16 = timed(lambda xb=xb, w=weight: F.linear(xb, w))
            fp32 = timed(lambda x=x, w=weight32: F.linear(x, w))
            cast = timed(lambda x=x, w=weight: F.linear(x, w.float()))
            print(f"| {k} x {n} | {rows} | {bf16:.1f} | {fp32:.1f} | {cast:.1f} |")


if __name__ == "__main__":
    main()

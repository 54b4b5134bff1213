"""bf16 against float32 matmuls on this CPU: the measurement behind `--compute-dtype auto`.

    python benchmarks/compute_dtype.py [--threads 1]
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/compute_dtype.py   # as an AVX2-only CPU runs

A linear of Qwen3-30B-A3B's attention shapes (2048 -> 4096 and 4096 -> 2048) at batch 1 (decode) and 256
(prefill), bf16 weights and activations against float32 ones, best of 5 rounds each; then what `auto`
chooses here (kernels.compute_dtype: bf16 where the CPU has bf16 arithmetic, float32 otherwise).
"""

import argparse
import time

import torch
import torch.nn.functional as F

from moestream.core import kernels


def best_ms(x: torch.Tensor, w: torch.Tensor, calls: int) -> float:
    def fn():
        return F.linear(x, w)

    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    print(f"{'shape':>12} {'batch':>5} {'bf16 ms':>8} {'fp32 ms':>8} {'fp32/bf16':>9}")
    g = torch.Generator().manual_seed(0)
    for n, k in ((4096, 2048), (2048, 4096)):
        w = torch.randn(n, k, generator=g) * 0.02
        wb = w.bfloat16()
        for batch in (1, 256):
            x = torch.randn(batch, k, generator=g)
            xb = x.bfloat16()
            calls = 200 if batch == 1 else 10
            bf16, fp32 = best_ms(xb, wb, calls), best_ms(x, w, calls)
            print(f"{f'{k}->{n}':>12} {batch:>5} {bf16:>8.3f} {fp32:>8.3f} {fp32 / bf16:>9.2f}")
    chosen = kernels.compute_dtype("auto", torch.bfloat16)
    print(f"bf16 arithmetic listed by the CPU: {kernels.native_bf16()}; --compute-dtype auto for a bf16 model: {chosen}")


if __name__ == "__main__":
    main()

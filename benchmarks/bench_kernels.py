"""Expert matmul speed per storage format, on real MoE expert shapes, all measured in one run.

One "expert" is what the runtime computes per routed expert: x @ gate_up.T ([2I, H]) then h @ down.T
([H, I]) (the activation in between is the same for every format and left out). For each format, at
batch 1 (decode) and 32 (prefill chunk): median time per expert, the stored weight bytes streamed per
second, and the speed relative to dense bf16 measured in the same run.

    python benchmarks/bench_kernels.py [--repeats 20] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.core.kernels import cpu_record, expert_linear

SHAPES = {"Qwen3-30B-A3B (2048 -> 768 -> 2048)": (2048, 768), "DeepSeek-V3 (7168 -> 2048 -> 7168)": (7168, 2048)}
FORMATS = ["bf16", "fp32", "int8", "int4", "int3", "int2"]


def _expert(hidden: int, inter: int, fmt_name: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(2 * inter, hidden, generator=g) * 0.02
    down = torch.randn(hidden, inter, generator=g) * 0.02
    if fmt_name in ("bf16", "fp32"):
        dtype = torch.bfloat16 if fmt_name == "bf16" else torch.float32
        record = {"gate_up_proj": gate_up.to(dtype), "down_proj": down.to(dtype)}
        return record, None, dtype
    fmt = QuantFormat.make(fmt_name)
    record = cpu_record({**pack(quantize(gate_up, fmt), fmt, "gate_up_proj"), **pack(quantize(down, fmt), fmt, "down_proj")}, fmt)
    return record, fmt, torch.bfloat16


def _time_expert(record, fmt, dtype, hidden, inter, batch, repeats) -> float:
    x = torch.randn(batch, hidden).to(dtype)
    h = torch.randn(batch, inter).to(dtype)

    def once():
        expert_linear(x, record, "gate_up_proj", fmt, transposed=False)
        expert_linear(h, record, "down_proj", fmt, transposed=False)

    for _ in range(3):
        once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, CPU kernels {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for shape_name, (hidden, inter) in SHAPES.items():
        print(f"\n{shape_name}")
        print(f"{'format':>6} {'MiB/expert':>10} | {'batch':>5} {'ms/expert':>9} {'weight GB/s':>11} {'vs bf16':>7}")
        records = {f: _expert(hidden, inter, f, seed=1) for f in FORMATS}
        for batch in (1, 32):
            base = None
            for f in FORMATS:
                record, fmt, dtype = records[f]
                nbytes = sum(t.numel() * t.element_size() for t in record.values())
                seconds = _time_expert(record, fmt, dtype, hidden, inter, batch, args.repeats)
                base = base or seconds
                print(
                    f"{f:>6} {nbytes / 2**20:>10.2f} | {batch:>5} {seconds * 1e3:>9.3f} {nbytes / seconds / 1e9:>11.2f} {base / seconds:>6.2f}x"
                )


if __name__ == "__main__":
    main()

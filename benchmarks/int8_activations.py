"""The CPU's low-bit matmuls with int8 activations against float ones, and against the memory bus.

    python benchmarks/int8_activations.py [--threads 2] [--json OUT] [--record]

1. The machine's read bandwidth: torch's float32 sum over 512 MiB (one pass, best of 5), the ceiling a
   kernel streaming weights from DRAM can reach.
2. Per shape of Qwen3-30B-A3B (an expert's gate+up [1536, 2048] and down [2048, 768], attention's q
   [4096, 2048]) and format (int4 g32/g64/g128, int8), one matmul at 1, 4 and 512 activation rows:
   the int8-activation kernel (`--activations int8`) against the float-activation one (`--activations
   float`: torch's int4 kernel in bf16 on its own layout, torch's int8 kernel), each the best of several
   runs with the weights in cache.
3. From DRAM: one token through 64 distinct [1536, 2048] matrices (96-144 MiB, far beyond the caches), so
   each matmul streams its weights from memory: GB/s of weights read, and that as a share of (1).
Both kinds run in the same process, alternating, so a busy machine slows both.
"""

from __future__ import annotations

import argparse
import functools
import time

import machine
import torch

from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.core.compute import kernels
from moestream.native import fused_build

SHAPES = {"expert gate+up": (1536, 2048), "expert down": (2048, 768), "attention q": (4096, 2048)}
FORMATS = [("int4", 32), ("int4", 64), ("int4", 128), ("int8", None)]


def read_bandwidth() -> float:
    data = torch.rand(128 * 2**20)  # 512 MiB of float32
    return data.numel() * 4 / (kernels.fastest_ms(data.sum, 5) / 1e3) / 1e9


def start_benchmark(threads: int) -> float:
    """A kernel benchmark's start: the compiled kernels (or exit), `threads` torch threads, the machine and
    the loops' variant printed; returns the machine's read bandwidth in GB/s (printed too)."""
    machine.compiled_kernels()
    torch.set_num_threads(threads)
    print(f"machine: {machine.line()}; {threads} threads; {fused_build.extension().lowbit_isa('')} loops")
    bandwidth = read_bandwidth()
    print(f"read bandwidth (float32 sum over 512 MiB): {bandwidth:.1f} GB/s\n")
    return bandwidth


def matrix(fmt: QuantFormat, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    record = pack(quantize(torch.randn(n, k, generator=g), fmt), fmt, "w")
    stored = record["w.qweight"], record[f"w.{fmt.params}"]
    torch_layout = kernels.cpu_record(record, fmt)["w.qweight"]
    return stored, torch_layout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here too")
    machine.add_record_argument(parser, "int8-activation-kernels")
    args = parser.parse_args()
    bandwidth = start_benchmark(args.threads)
    results: dict = {"threads": args.threads, "bandwidth_gbs": bandwidth}
    rows = []
    print(f"{'shape':<16} {'format':<9} {'rows':>4} {'int8 act ms':>11} {'float act ms':>12} {'speed-up':>8}")
    for label, (n, k) in SHAPES.items():
        for name, group in FORMATS:
            fmt = QuantFormat.make(name, group or 32)
            (qweight, params), torch_layout = matrix(fmt, n, k, seed=n + k)
            for m in (1, 4, 512):
                x = torch.randn(m, k)
                repeats = 30 if m < 512 else 3
                integer = kernels.fastest_ms(functools.partial(kernels.quantized_matmul, x, qweight, params, fmt, True), repeats)
                floating = kernels.fastest_ms(
                    functools.partial(kernels.quantized_matmul, x, torch_layout, params, fmt, False), repeats
                )
                label_fmt = f"{name}-g{group}" if group else name
                print(
                    f"{label:<16} {label_fmt:<9} {m:>4} {integer:>11.3f} {floating:>12.3f} {floating / integer:>7.2f}x",
                    flush=True,
                )
                rows.append(dict(shape=label, n=n, k=k, format=label_fmt, rows=m, int8_ms=integer, float_ms=floating))
    results["matmuls"] = rows
    print("\none token through 64 distinct 1536x2048 matrices (weights from DRAM):")
    streaming = []
    for name, group in FORMATS:
        fmt = QuantFormat.make(name, group or 32)
        matrices = [matrix(fmt, 1536, 2048, seed=i) for i in range(64)]
        x = torch.randn(1, 2048)
        times = {True: [], False: []}
        for _ in range(4):
            for integer in (True, False):
                start = time.perf_counter()
                for (qweight, params), torch_layout in matrices:
                    kernels.quantized_matmul(x, qweight if integer else torch_layout, params, fmt, integer)
                times[integer].append((time.perf_counter() - start) / len(matrices))
        nbytes = sum(t.numel() * t.element_size() for t in matrices[0][0])  # codes and their scales
        label_fmt = f"{name}-g{group}" if group else name
        for integer in (True, False):
            rate = nbytes / min(times[integer]) / 1e9
            kind = "int8 act" if integer else "float act"
            print(
                f"  {label_fmt:<9} {kind:<9} {min(times[integer]) * 1e3:.3f} ms/matrix, {rate:5.1f} GB/s = {rate / bandwidth:.0%} of the bus"
            )
            streaming.append(dict(format=label_fmt, int8_activations=integer, ms=min(times[integer]) * 1e3, gbs=rate))
    results["from_dram"] = streaming
    if args.json:
        machine.write_json(args.json, results)
    if args.record:
        record(args, bandwidth, rows, streaming)


def record(args, bandwidth: float, rows: list[dict], streaming: list[dict]) -> None:
    """The document's two tables: from DRAM with the bus's share, and the expert gate+up matrix from cache."""
    dram = []
    for fmt in dict.fromkeys(r["format"] for r in streaming):
        cells = {r["int8_activations"]: r for r in streaming if r["format"] == fmt}
        dram.append(
            [fmt] + [f"{cells[k]['ms']:.3f}, {cells[k]['gbs']:.1f}, {cells[k]['gbs'] / bandwidth:.0%}" for k in (True, False)]
        )
    cached = []
    for fmt in dict.fromkeys(r["format"] for r in rows):
        cells = {r["rows"]: r for r in rows if r["format"] == fmt and (r["n"], r["k"]) == (1536, 2048)}
        cached.append(
            [fmt] + [f"{c['int8_ms']:.3f} / {c['float_ms']:.3f} ({c['float_ms'] / c['int8_ms']:.2f}x)" for c in cells.values()]
        )
    tables = [
        machine.table(
            f"One token through 64 distinct 1536x2048 matrices (weights streamed from DRAM), {args.threads} threads; the bus read {bandwidth:.1f} GB/s (float32 sum over 512 MiB):",
            ["format", "int8 act: ms/matrix, GB/s, share of the bus", "float act: ms/matrix, GB/s, share"],
            dram,
        ),
        machine.table(
            "From cache, one expert's gate+up matrix [1536, 2048] (ms per matmul):",
            ["format", "1 row: int8 / float act", "4 rows", "512 rows"],
            cached,
        ),
    ]
    path = machine.write_result(args.record, "int8-activation kernels against the memory bus", machine.invocation(), tables)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The int8-activation kernels' variants (native/lowbit_dot.h: AVX-512 VNNI, AVX2, portable) side by side, on
the machine at hand: each variant the CPU has, at Qwen3-30B-A3B's shapes, in cache and from DRAM.

    python benchmarks/isa_variants.py [--threads 2] [--json OUT] [--record]

1. Per shape (an expert's gate+up [1536, 2048] and down [2048, 768], attention's q [4096, 2048]) and format
   (int4 g32/g64/g128, int8), one matmul at 1, 4 and 64 activation rows: the fastest of several runs of
   each variant, the variants alternating, weights in cache.
2. From DRAM: one token through distinct [1536, 2048] matrices, 64 of them or as many as twice the last-level
   cache holds (copies of one, so that every pass reads them from DRAM): GB/s of weights read per variant,
   and that as a share of the machine's read bandwidth (a float32 sum over 512 MiB or twice that cache).

--record writes both tables as this machine's record of kernel-variants (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path

import machine
import torch

from moestream.conversion.quant import QuantFormat, pack, quantize
from moestream.core.compute import kernels

SHAPES = {"expert gate+up": (1536, 2048), "expert down": (2048, 768), "attention q": (4096, 2048)}
FORMATS = [("int4", 32), ("int4", 64), ("int4", 128), ("int8", None)]
ISAS = ["portable", "avx2", "avx512-vnni"]


def variants(ext) -> list[str]:
    previous = ext.lowbit_isa(ISAS[-1])
    best = ext.lowbit_isa(previous)
    return ISAS[1 : ISAS.index(best) + 1] or ["portable"]


def stored(fmt: QuantFormat, n: int, k: int, seed: int):
    record = pack(quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), fmt), fmt, "w")
    return record["w.qweight"], record[f"w.{fmt.params}"]


def last_level_cache() -> int:
    """The largest CPU cache in bytes (Linux's sysfs), 0 if unknown."""
    sizes = [0]
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        sizes.append(int(size.rstrip("KMG")) * scale)
    return max(sizes)


def label(name: str, group: int | None) -> str:
    return f"{name}-g{group}" if group else name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here too")
    machine.add_record_argument(parser, "kernel-variants")
    args = parser.parse_args()
    ext = machine.compiled_kernels()
    torch.set_num_threads(args.threads)
    names = variants(ext)
    print(f"machine: {machine.line()}; {args.threads} threads; variants: {', '.join(names)}")
    cache = last_level_cache()
    data = torch.rand(max(128 * 2**20, cache // 2))  # float32: 512 MiB, or twice the cache
    sum_bytes = data.numel() * 4
    bandwidth = sum_bytes / (kernels.fastest_ms(data.sum, 5) / 1e3) / 1e9
    del data
    print(
        f"last-level cache {cache / 2**20:.0f} MiB; read bandwidth (float32 sum over {sum_bytes / 2**20:.0f} MiB): {bandwidth:.1f} GB/s\n"
    )
    previous = ext.lowbit_isa("")
    results: dict = {"threads": args.threads, "bandwidth_gbs": bandwidth, "variants": names, "matmuls": [], "from_dram": []}
    results.update(last_level_cache_bytes=cache, bandwidth_sum_bytes=sum_bytes)
    try:
        print(f"{'shape':<16} {'format':<9} {'rows':>4} " + " ".join(f"{n + ' ms':>15}" for n in names) + "  ratio")
        for shape, (n, k) in SHAPES.items():
            for name, group in FORMATS:
                fmt = QuantFormat.make(name, group or 32)
                qweight, params = stored(fmt, n, k, seed=n + k)
                for m in (1, 4, 64):
                    x = torch.randn(m, k)
                    best = {v: float("inf") for v in names}
                    for _ in range(5):  # alternating, so that a busy moment slows every variant
                        for v in names:
                            ext.lowbit_isa(v)
                            run = functools.partial(kernels.quantized_matmul, x, qweight, params, fmt, True)
                            best[v] = min(best[v], kernels.fastest_ms(run, 6 if m < 64 else 2))
                    ratio = best[names[0]] / best[names[-1]]
                    cells = " ".join(f"{best[v]:>15.4f}" for v in names)
                    print(f"{shape:<16} {label(name, group):<9} {m:>4} {cells}  {ratio:.2f}x", flush=True)
                    results["matmuls"].append(dict(shape=shape, n=n, k=k, format=label(name, group), rows=m, ms=best))
        print(f"\none token through distinct 1536x2048 matrices (weights from DRAM); ratio {names[0]} / {names[-1]}:")
        for name, group in FORMATS:
            fmt = QuantFormat.make(name, group or 32)
            first = stored(fmt, 1536, 2048, seed=0)
            count = max(64, math.ceil(2 * cache / sum(t.numel() * t.element_size() for t in first)))
            matrices = [first] + [tuple(t.clone() for t in first) for _ in range(count - 1)]
            x = torch.randn(1, 2048)
            times = {v: [] for v in names}
            for _ in range(5):
                for v in names:
                    ext.lowbit_isa(v)
                    start = time.perf_counter()
                    for qweight, params in matrices:
                        kernels.quantized_matmul(x, qweight, params, fmt, True)
                    times[v].append((time.perf_counter() - start) / len(matrices))
            nbytes = sum(t.numel() * t.element_size() for t in matrices[0])
            rates = {v: nbytes / min(times[v]) / 1e9 for v in names}
            cells = ", ".join(f"{v} {min(times[v]) * 1e3:.3f} ms {rates[v]:.1f} GB/s ({rates[v] / bandwidth:.0%})" for v in names)
            ratio = min(times[names[0]]) / min(times[names[-1]])
            print(f"  {label(name, group):<9} {count} matrices: {cells}; {ratio:.2f}x")
            results["from_dram"].append(
                dict(format=label(name, group), matrices=count, ms={v: min(t) * 1e3 for v, t in times.items()}, gbs=rates)
            )
            del matrices, first
    finally:
        ext.lowbit_isa(previous)
    if args.json:
        machine.write_json(args.json, results)
    if args.record:
        record(args, results)


def record(args, results: dict) -> None:
    names = results["variants"]
    ratio = f"{names[0]} / {names[-1]}"
    caption = (
        f"One matmul, weights in cache, {args.threads} threads: the fastest of several runs of each variant, the variants "
        "alternating (ms):"
    )
    columns = ["shape", "format", "rows", *(f"{v} ms" for v in names), ratio]
    rows = [
        [f"{r['shape']} [{r['n']}, {r['k']}]", r["format"], r["rows"], *(f"{r['ms'][v]:.4f}" for v in names)]
        + [f"{r['ms'][names[0]] / r['ms'][names[-1]]:.2f}x"]
        for r in results["matmuls"]
    ]
    tables = [machine.table(caption, columns, rows)]
    caption = (
        "From DRAM: one token (one row) through distinct [1536, 2048] matrices (as many as twice the "
        f"{results['last_level_cache_bytes'] / 2**20:.0f} MiB last-level cache holds, 64 at least), the fastest of 5 passes per "
        f"variant; GB/s of weights read, and its share of the read bandwidth ({results['bandwidth_gbs']:.1f} GB/s, a float32 sum "
        f"over {results['bandwidth_sum_bytes'] / 2**20:.0f} MiB):"
    )
    columns = ["format", "matrices", *(f"{v} ms per matrix, GB/s (share)" for v in names), ratio]
    rows = [
        [r["format"], r["matrices"]]
        + [f"{r['ms'][v]:.3f}, {r['gbs'][v]:.1f} ({r['gbs'][v] / results['bandwidth_gbs']:.0%})" for v in names]
        + [f"{r['ms'][names[0]] / r['ms'][names[-1]]:.2f}x"]
        for r in results["from_dram"]
    ]
    tables.append(machine.table(caption, columns, rows))
    notes = (
        f"Variants this CPU has: {', '.join(names)}; the ratio is {ratio} time (above 1: {names[-1]} faster). int4 g32 "
        "runs the AVX2 loop under either setting (lowbit_dot.h's int4_variant), so its ratio is AVX2 against itself."
    )
    title = "Kernel variants per CPU"
    path = machine.write_result(args.record, title, machine.invocation(), tables, notes)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

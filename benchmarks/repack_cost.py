"""What a miss pays to turn a portable int4 record into torch's CPU kernel layout, against its read.

    python benchmarks/repack_cost.py WORKDIR [--shape 2048x768] [--experts 64] [--format int4] [--group-size 32]

Writes WORKDIR/records.bin: `--experts` records of one expert of the given shape (hidden x expert width;
default Qwen3-30B-A3B's 2048 x 768: gate_up [1536, 2048], down [2048, 768]) in the store's own record
layout, quantized from random weights. Then reads each record as the engine does on a miss (the reader's
O_DIRECT preadv into a cache-slot-sized aligned buffer, on an I/O thread, checksummed) with the engine's
preparer (repack.py) as the read's `after`, and prints per record the read's time and the repack's, their
medians and the ratio. Each read is of a record not read before in this process; O_DIRECT keeps the page
cache out of it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
from pathlib import Path

import numpy as np
import torch

from moestream.conversion.quant import QuantFormat, expert_record_specs, pack, quantize
from moestream.conversion.store import DTYPES, RecordLayout, checksum
from moestream.core import kernels, repack
from moestream.core.reader import RecordReader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--shape", default="2048x768", help="hidden x expert width (default: Qwen3-30B-A3B's)")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--format", default="int4", choices=["int4", "int3", "int2"])
    parser.add_argument("--group-size", type=int, default=32)
    args = parser.parse_args()
    hidden, width = (int(v) for v in args.shape.split("x"))
    fmt = QuantFormat.make(args.format, args.group_size)
    layout = RecordLayout.pack(
        expert_record_specs(
            {"gate_up_proj": (2 * width, hidden), "down_proj": (hidden, width)}, torch.bfloat16, fmt, False, "bench"
        )
    )
    args.workdir.mkdir(parents=True, exist_ok=True)
    path = args.workdir / "records.bin"
    g = torch.Generator().manual_seed(0)
    sums = []
    with open(path, "wb") as f:
        for _ in range(args.experts):
            record = np.zeros(layout.stride, dtype=np.uint8)
            parts = {
                **pack(quantize(torch.randn(2 * width, hidden, generator=g) * 0.02, fmt), fmt, "gate_up_proj"),
                **pack(quantize(torch.randn(hidden, width, generator=g) * 0.02, fmt), fmt, "down_proj"),
            }
            for t in layout.tensors:
                record[t.offset : t.offset + t.nbytes] = parts[t.name].contiguous().reshape(-1).view(torch.uint8).numpy()
            sums.append(checksum(record[: layout.nbytes]))
            f.write(record.data)
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)

    preparer = kernels.record_preparer(fmt, layout, cpu_kernels=True)
    for t in layout.tensors:  # the per-shape layout check, once, as at a model's first misses
        if t.name.endswith(".qweight"):
            repack.columns(t.shape[0], t.shape[1] * 8 // fmt.bits)
    arena = mmap.mmap(-1, layout.stride)
    raw = torch.frombuffer(arena, dtype=torch.uint8)
    views = {t.name: raw[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in layout.tensors}
    reader = RecordReader([path], threads=1, direct=True)
    reads, prepares = [], []
    for e in range(args.experts):
        future = reader.submit(
            0, e * layout.stride, layout.stride, memoryview(arena), (layout.nbytes, sums[e]), after=lambda: preparer(views)
        )
        result = future.result()
        reads.append(result.seconds)
        prepares.append(result.prepare_seconds)
    reader.close()
    read, prep = statistics.median(reads), statistics.median(prepares)
    print(
        f"cpu: {torch.backends.cpu.get_cpu_capability()}, kernel layout: {repack.columns.cache_info().currsize} shapes described"
    )
    print(
        f"record: {args.format} g{args.group_size}, {layout.stride / 2**20:.2f} MiB, {args.experts} records, direct I/O: {reader.direct}"
    )
    print(f"read    median {read * 1e3:.3f} ms ({layout.stride / read / 1e9:.2f} GB/s)")
    print(f"repack  median {prep * 1e3:.3f} ms  = {prep / read:.1%} of the read")
    print(
        f"per record (read ms, repack ms): {[(round(r * 1e3, 2), round(p * 1e3, 3)) for r, p in zip(reads[:8], prepares[:8])]} ..."
    )


if __name__ == "__main__":
    main()

"""The disk's read bandwidth over queue depth and record size, as moestream's reader reads: O_DIRECT
`preadv` of whole records at random aligned offsets of a store's files, from a pool of threads.

    python benchmarks/disk_curve.py STORE [--depths 1 2 4 8 16] [--sizes 256KiB 1MiB 2.65MiB 8MiB] [--seconds 3]

Each (depth, size) cell keeps `depth` reads in flight (one per thread) for `--seconds` and prints GB/s; the
offsets are random across all of the store's files, so neither the page cache (bypassed) nor a disk's
read-ahead helps. The virtual disks of cloud machines cache recently read blocks on the host: a cell run
twice reads faster the second time, so every cell reads offsets of its own. --json writes the table with
the machine that ran it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import threading
import time
from pathlib import Path

import machine

ALIGN = 4096


def cell(files: list[tuple[int, int]], size: int, depth: int, seconds: float, rng: random.Random) -> float:
    """GB/s of `depth` threads each reading `size` bytes at random aligned offsets for `seconds`."""
    done = [0] * depth
    stop = time.perf_counter() + seconds
    seeds = [rng.randrange(2**31) for _ in range(depth)]

    def worker(i: int) -> None:
        own = random.Random(seeds[i])
        buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        view = memoryview(buffer)
        while time.perf_counter() < stop:
            fd, length = files[own.randrange(len(files))]
            offset = own.randrange(0, max(1, (length - size) // ALIGN)) * ALIGN
            got = 0
            while got < size:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n <= 0:
                    break
                got += n
            done[i] += got
        view.release()
        buffer.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(depth)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store", type=Path, help="a store directory (its .bin files are read) or one large file")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--sizes", nargs="+", default=["256KiB", "1MiB", "2.65MiB", "8MiB"])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--json", help="write the table here too")
    args = parser.parse_args()

    from moestream.units import parse_bytes

    paths = (
        [args.store]
        if args.store.is_file()
        else sorted(p for p in args.store.rglob("*") if p.is_file() and p.stat().st_size > 64 << 20)
    )
    if not paths:
        raise SystemExit(f"disk_curve: no file of more than 64 MiB in {args.store}")
    files = [(os.open(p, os.O_RDONLY | os.O_DIRECT), p.stat().st_size) for p in paths]
    sizes = [parse_bytes(s) // ALIGN * ALIGN for s in args.sizes]
    print(f"machine: {machine.line()}")
    print(f"{sum(n for _, n in files) / 1e9:.1f} GB in {len(files)} files; GB/s, O_DIRECT, random offsets")
    print(f"{'size':>10}" + "".join(f"{'depth ' + str(d):>10}" for d in args.depths))
    rng, table = random.Random(0), {}
    for size in sizes:
        row = [cell(files, size, depth, args.seconds, rng) for depth in args.depths]
        table[size] = dict(zip(args.depths, row))
        print(f"{size / 2**20:>8.2f}Mi" + "".join(f"{v:>10.2f}" for v in row), flush=True)
    for fd, _ in files:
        os.close(fd)
    if args.json:
        machine.write_json(args.json, {"store": str(args.store), "seconds": args.seconds, "gb_per_s": table})


if __name__ == "__main__":
    main()

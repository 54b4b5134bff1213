"""How fast `moestream convert FILE.gguf` writes a store, against the disk's own write speed, side by side.

    python benchmarks/import_speed.py FILE.gguf WORKDIR [--rounds 3] [--baseline-src OTHER/src] [--convert-args "..."]

Each round: the GGUF is dropped from the page cache (posix_fadvise DONTNEED: a cold read, as a file just
downloaded is not), the store directory is removed (so no --overwrite deletes an old one inside the
timing), then `moestream convert FILE WORKDIR/store` runs in a fresh process, timed with its CPU time and
peak RSS; then the disk's write speed is measured as `dd if=/dev/zero of=F bs=16M count=256
conv=fdatasync` measures it (4 GiB written, then flushed) in the same directory. With --baseline-src (the
`src` directory of another checkout), a convert by that code runs before each of this checkout's, the
same way: A/B in alternation, as this machine's speed moves within minutes. Printed per run: wall time,
user and system CPU, peak RSS, store bytes, MB/s and the ratio to that round's disk speed. `--record`
writes them as a table of this machine's record of gguf-import-speed (benchmarks/machine.py), one table
per file.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import machine


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_write_speed(directory: Path, gib: int = 4) -> float:
    """Bytes/s of writing `gib` GiB of zeros 16 MiB at a time and flushing them (dd's conv=fdatasync)."""
    path = directory / "write-speed.tmp"
    chunk = bytes(16 * 2**20)
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(gib * 64):
            os.write(fd, chunk)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return gib * 2**30 / seconds


def timed_convert(gguf: Path, store: Path, extra: list[str], pythonpath: str | None) -> dict:
    shutil.rmtree(store, ignore_errors=True)
    drop_from_page_cache(gguf)
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "moestream.cli", "convert", str(gguf), str(store), *extra]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"convert failed: {proc.stderr.read().decode()[-2000:]}")
    size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    return {"wall": wall, "user": usage.ru_utime, "sys": usage.ru_stime, "rss_mib": usage.ru_maxrss / 1024, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path)
    parser.add_argument("workdir", type=Path, help="a directory on the disk to measure (the store is written here)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-src", help="the src directory of another checkout, run in alternation")
    parser.add_argument("--convert-args", default="", help="options passed to moestream convert")
    machine.add_record_argument(parser, "gguf-import-speed")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(machine.line())
    print(f"file: {args.gguf} ({args.gguf.stat().st_size / 1e9:.2f} GB)")
    extra = shlex.split(args.convert_args)
    runs = [("baseline", args.baseline_src), ("this", None)] if args.baseline_src else [("this", None)]
    rows = []
    for r in range(args.rounds):
        for name, pythonpath in runs:
            got = timed_convert(args.gguf, args.workdir / "store", extra, pythonpath)
            disk = disk_write_speed(args.workdir)
            rate = got["bytes"] / got["wall"]
            print(
                f"round {r + 1} {name:8s} wall {got['wall']:6.2f} s  user {got['user']:5.1f} s  sys {got['sys']:4.1f} s  "
                f"peak RSS {got['rss_mib']:5.0f} MiB  store {got['bytes'] / 1e9:.2f} GB  {rate / 1e6:4.0f} MB/s  "
                f"disk {disk / 1e6:4.0f} MB/s  ratio {rate / disk:.2f}",
                flush=True,
            )
            rows.append(
                [r + 1, "`--baseline-src`" if name == "baseline" else "this checkout", f"{got['wall']:.2f} s", f"{got['user']:.1f} + {got['sys']:.1f} s",
                 f"{got['rss_mib']:.0f} MiB", f"{rate / 1e6:.0f} MB/s", f"{disk / 1e6:.0f} MB/s", f"{rate / disk:.2f}x"]
            )  # fmt: skip
    shutil.rmtree(args.workdir / "store", ignore_errors=True)
    if args.record:
        options = f" {args.convert_args}" if args.convert_args else ""
        caption = (
            f"`{args.gguf.name}` ({args.gguf.stat().st_size / 1e9:.2f} GB), `moestream convert FILE STORE{options}`, a cold file, "
            "fresh processes, the disk's write speed measured after each:"
        )
        columns = [
            "round",
            "code",
            "wall time",
            "user + system CPU",
            "peak RSS",
            "store written",
            "disk alone",
            "against the disk",
        ]
        table = machine.table(caption, columns, rows)
        path = machine.write_result(args.record, "GGUF import speed against the disk", machine.invocation(), [table])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

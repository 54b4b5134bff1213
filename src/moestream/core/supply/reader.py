"""Aligned positional reads of expert records into caller-owned buffers, from a small thread pool.

`os.preadv` releases the GIL, so a few threads keep several reads in flight while the main thread
computes. In direct mode (the default) files are opened with O_DIRECT when the filesystem allows it (records,
lengths and buffers are all 4 KiB aligned), so expert bytes never get a second copy in the page cache;
where O_DIRECT is refused we read buffered and drop the pages right after with `posix_fadvise(DONTNEED)`.
In buffered mode reads go through the page cache and the pages stay: the OS caches experts in memory
the process does not own (useful when the machine has memory to spare; it is not counted in RSS).

Reads are made robust here, once, for every caller: short reads are completed, transient errors are
retried a bounded number of times with a short backoff, and a payload can be checked against its
xxh3-64 checksum on the I/O thread (xxhash releases the GIL) before anyone computes with it.
This module knows files, offsets and byte counts; it does not know what an expert is.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ...conversion.store import checksum
from ...errors import ExpertReadError, RecordChecksumError

READ_RETRIES = 3  # a failing read (EIO, EINTR, ...) is retried this many times before the error is raised
RETRY_BACKOFF_SECONDS = 0.01  # doubled after each failure: 10, 20, 40 ms, so a bad disk fails fast
# Injected faults (tests and soak runs; never a CLI flag): `MOESTREAM_FAULTS=read_error:0.01,short_read:0.005,
# stall:0.001,flip:0.001`, each the probability that one read suffers it; `stall_seconds:S` how long a stall
# lasts (default 120: past the supply's read timeout), `seed:N` for a repeatable run.
FAULTS_ENV = "MOESTREAM_FAULTS"
FAULT_KINDS = ("read_error", "short_read", "stall", "flip")


@dataclass
class Faults:
    """What `RecordFile.read_at` does wrong, and how often (see FAULTS_ENV); `injected` counts each kind."""

    read_error: float = 0.0  # the read fails with EIO
    short_read: float = 0.0  # the read returns half of what was asked (aligned), as a disk may
    stall: float = 0.0  # the read takes `stall_seconds` first
    flip: float = 0.0  # one byte of what was read is wrong (a checksum catches it where one is verified)
    stall_seconds: float = 120.0
    seed: int | None = None

    def __post_init__(self) -> None:
        self._random = random.Random(self.seed)
        self._lock = threading.Lock()
        self._woken = threading.Event()  # ends every injected stall now and from now on (the reader closes)
        self.injected = dict.fromkeys(FAULT_KINDS, 0)

    @classmethod
    def from_env(cls) -> Faults | None:
        spec = os.environ.get(FAULTS_ENV, "").strip()
        if not spec:
            return None
        fields: dict = {}
        for item in spec.split(","):
            name, _, value = item.partition(":")
            name = name.strip()
            if name not in (*FAULT_KINDS, "stall_seconds", "seed"):
                raise ValueError(f"{FAULTS_ENV}: unknown fault {name!r}; known: {', '.join(FAULT_KINDS)}, stall_seconds, seed")
            fields[name] = int(value) if name == "seed" else float(value)
        return cls(**fields)

    def draw(self) -> str | None:
        """The fault this read suffers, if any."""
        with self._lock:
            x = self._random.random()
            for kind in FAULT_KINDS:
                x -= getattr(self, kind)
                if x < 0:
                    self.injected[kind] += 1
                    return kind
        return None

    def stall_now(self) -> None:
        self._woken.wait(self.stall_seconds)

    def wake(self) -> None:
        """End the stalls: a closing reader's I/O threads must not outlive the process by minutes."""
        self._woken.set()


class RecordFile:
    """One open store file. `read_at` is the only call that touches the disk, so faults are injected here."""

    def __init__(self, path: Path, direct: bool, faults: Faults | None = None):
        self.path = path
        self.faults = faults
        self.direct = False
        # Asked for direct I/O but refused by the filesystem: read buffered, then drop the pages, so expert
        # bytes still have one copy only. Asked for buffered I/O: keep them, the page cache is a second cache.
        self.drop_pages = direct
        self.fd = -1
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:
                self.fd = -1
        if self.fd < 0:
            self.fd = os.open(path, os.O_RDONLY)
        self._lock = threading.Lock()

    def read_at(self, buffer: memoryview, offset: int) -> int:
        """One positional read into `buffer`; returns the bytes read (possibly fewer, 0 at end of file)."""
        fault = self.faults.draw() if self.faults is not None else None
        if fault == "read_error":
            raise OSError(errno.EIO, "injected read error")
        if fault == "stall":
            self.faults.stall_now()
        if fault == "short_read" and len(buffer) >= 8192:  # (half, kept aligned for direct reads)
            buffer = buffer[: len(buffer) // 2 // 4096 * 4096]
        n = os.preadv(self.fd, [buffer], offset)
        if fault == "flip" and n:
            buffer[n // 2] ^= 0x40
        return n

    def fall_back_to_buffered(self) -> None:
        with self._lock:
            if self.direct:
                old, self.fd, self.direct = self.fd, os.open(self.path, os.O_RDONLY), False
                os.close(old)

    def close(self) -> None:
        os.close(self.fd)


@dataclass(frozen=True)
class ReadResult:
    seconds: float  # wall time of the read, retries included, checksum excluded
    verify_seconds: float  # time spent hashing the payload (0 when no checksum was asked for)
    prepare_seconds: float = 0.0  # time spent in the caller's `after` (the kernel layout made from the record)


class RecordReader:
    def __init__(self, paths: list[Path], threads: int = 4, direct: bool = True, faults: Faults | None = None):
        # (faults: the test hook; else those of MOESTREAM_FAULTS, if set)
        self.faults = faults if faults is not None else Faults.from_env()
        self._files = [RecordFile(Path(p), direct, self.faults) for p in paths]
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moestream-io")
        # Speculative reads get their own queue: a demand read never waits behind one.
        self._speculative_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-prefetch")
        # When a list, every submitted read is appended to it as (file_index, offset, length): `moestream
        # bench` replays a run's own reads to time the disk on exactly the bytes that run needed.
        self.log: list | None = None
        # The time at least one read was in flight, summed: the bytes read over it are the rate this disk
        # gave these reads while it had work (`moestream bench`'s floor), whatever the reads' overlap.
        self._busy_lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_seconds = 0.0

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self._files)

    def busy_seconds(self) -> float:
        """Seconds during which at least one read was in flight, since the reader opened (to now)."""
        with self._busy_lock:
            ongoing = time.perf_counter() - self._busy_since if self._in_flight else 0.0
            return self._busy_seconds + ongoing

    def submit(
        self,
        file_index: int,
        offset: int,
        length: int,
        buffer: memoryview,
        expected: tuple[int, str] | None = None,
        speculative: bool = False,
        after=None,
    ) -> Future:
        """Read `length` bytes at `offset` into `buffer` on an I/O thread; the future's result is a ReadResult.

        expected: (payload bytes, xxh3-64 hex) to verify the first `payload bytes` against after the read.
        speculative: queue it behind other speculative reads only, on their own low-priority thread.
        after: called with no arguments on the I/O thread once the bytes are read and verified (the engine
        turns them into its kernels' layout there, off the model's thread).
        """
        pool = self._speculative_pool if speculative else self._pool
        if self.log is not None:
            self.log.append((file_index, offset, length))
        return pool.submit(self.read_into, file_index, offset, length, buffer, expected, after)

    def read_into(
        self, file_index: int, offset: int, length: int, buffer: memoryview, expected: tuple[int, str] | None = None, after=None
    ) -> ReadResult:
        f = self._files[file_index]
        start = self._read_begins()
        try:
            self._read_fully(f, offset, length, buffer)
        finally:
            end = self._read_ends()
        seconds = end - start
        verify_seconds = 0.0
        if expected is not None:
            payload, digest = expected
            t0 = time.perf_counter()
            actual = checksum(buffer[:payload])
            if actual != digest:
                # Read once more: a transient transfer error heals, damage on disk does not.
                self._read_fully(f, offset, length, buffer)
                actual = checksum(buffer[:payload])
            verify_seconds = time.perf_counter() - t0
            if actual != digest:
                raise RecordChecksumError(
                    f"{f.path}: the {payload} bytes at offset {offset} have checksum {actual}, the manifest says "
                    f"{digest}: the store is damaged. Run `moestream verify` on it, then convert the model again."
                )
        prepare_seconds = 0.0
        if after is not None:
            t0 = time.perf_counter()
            after()
            prepare_seconds = time.perf_counter() - t0
        return ReadResult(seconds, verify_seconds, prepare_seconds)

    def _read_begins(self) -> float:
        with self._busy_lock:
            now = time.perf_counter()
            if not self._in_flight:
                self._busy_since = now
            self._in_flight += 1
            return now

    def _read_ends(self) -> float:
        with self._busy_lock:
            now = time.perf_counter()
            self._in_flight -= 1
            if not self._in_flight:
                self._busy_seconds += now - self._busy_since
            return now

    @staticmethod
    def _read_fully(f: RecordFile, offset: int, length: int, buffer: memoryview) -> None:
        done, failures = 0, 0
        while done < length:
            try:
                n = f.read_at(buffer[done:length], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and f.direct:
                    f.fall_back_to_buffered()  # this filesystem or device refuses our alignment
                    continue
                failures += 1
                if failures > READ_RETRIES:
                    raise ExpertReadError(
                        f"reading {length} bytes at offset {offset} of {f.path} failed {failures} times "
                        f"({e.strerror or e}); check the disk (dmesg) and run `moestream verify` on the store"
                    ) from e
                time.sleep(RETRY_BACKOFF_SECONDS * 2 ** (failures - 1))
                continue
            if n == 0:
                raise ExpertReadError(
                    f"{f.path} ended at offset {offset + done} while reading {length} bytes at {offset}: "
                    "the file is truncated; run `moestream convert` again"
                )
            done += n  # a short read is not an error: continue where it stopped
        if not f.direct and f.drop_pages:
            os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.faults is not None:
            self.faults.wake()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._speculative_pool.shutdown(wait=False, cancel_futures=True)
        for f in self._files:
            f.close()
        self._files = []

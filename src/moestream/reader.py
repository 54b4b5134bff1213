"""Aligned positional reads of expert records into caller-owned buffers, from a small thread pool.

`os.preadv` releases the GIL, so a few threads keep several reads in flight while the main thread
computes. Files are opened with O_DIRECT when the filesystem allows it (records, lengths and buffers
are all 4 KiB aligned), so expert bytes never get a second copy in the page cache; where O_DIRECT is
refused we read buffered and drop the pages right after with `posix_fadvise(DONTNEED)`.
This module knows files, offsets and byte counts; it does not know what an expert is.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .errors import ExpertReadError

READ_RETRIES = 3  # a transient EIO/EINTR is retried this many times before the error is raised


class _File:
    def __init__(self, path: Path, direct: bool):
        self.path = path
        self.direct = False
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

    def fall_back_to_buffered(self) -> None:
        with self._lock:
            if self.direct:
                old, self.fd, self.direct = self.fd, os.open(self.path, os.O_RDONLY), False
                os.close(old)


class RecordReader:
    def __init__(self, paths: list[Path], threads: int = 4, direct: bool = True):
        self._files = [_File(Path(p), direct) for p in paths]
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="moestream-io")

    @property
    def direct(self) -> bool:
        return all(f.direct for f in self._files)

    def submit(self, file_index: int, offset: int, length: int, buffer: memoryview) -> Future:
        """Read `length` bytes at `offset` into `buffer`; the future's result is the seconds the read took."""
        return self._pool.submit(self.read_into, file_index, offset, length, buffer)

    def read_into(self, file_index: int, offset: int, length: int, buffer: memoryview) -> float:
        f = self._files[file_index]
        start = time.perf_counter()
        done, failures = 0, 0
        while done < length:
            try:
                n = os.preadv(f.fd, [buffer[done:length]], offset + done)
            except OSError as e:
                if e.errno == errno.EINVAL and f.direct:
                    f.fall_back_to_buffered()  # this filesystem or device refuses our alignment
                    continue
                failures += 1
                if failures > READ_RETRIES:
                    raise ExpertReadError(
                        f"reading {length} bytes at offset {offset} of {f.path} failed {failures} times: {e}"
                    ) from e
                continue
            if n == 0:
                raise ExpertReadError(
                    f"{f.path} ended at offset {offset + done} while reading {length} bytes at {offset}: "
                    "the file is truncated; run `moestream convert` again"
                )
            done += n
        if not f.direct:
            os.posix_fadvise(f.fd, offset, length, os.POSIX_FADV_DONTNEED)
        return time.perf_counter() - start

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for f in self._files:
            os.close(f.fd)
        self._files = []

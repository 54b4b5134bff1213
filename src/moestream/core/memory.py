"""Process memory and page-cache measurements (Linux): what the stats line and the RSS tests report."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import mmap
import os
import re
import resource
from pathlib import Path


def _status_kib(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start or since the last reset_peak_rss()."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024


def current_rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return (kib or 0) * 1024


def release_freed_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; nothing where the C library has
    none). glibc keeps what was freed for later allocations: a long-running server, whose steps allocate
    and free tensors of every size, would otherwise see its RSS creep up by memory it no longer uses (a
    soak's server grew 95 MiB in 20 minutes that one trim gave back). About 1-15 ms."""
    if _malloc_trim is not None:
        _malloc_trim(0)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
    ]


def heap_bytes() -> tuple[int, int] | None:
    """(bytes the C heap has handed out and not had back, bytes it holds free for later), over all its arenas
    (glibc's mallinfo2, 2.33 and later; None elsewhere). RSS mixes what a process uses with what its
    allocator keeps and with pages of mapped files; the bytes in use alone tell a leak (they grow) from an
    allocator holding on to freed memory (they stay while RSS grows)."""
    if _mallinfo2 is None:
        return None
    info = _mallinfo2()
    return info.uordblks + info.hblkhd, info.fordblks


def reset_peak_rss() -> bool:
    """Restart peak-RSS accounting (Linux's clear_refs "5"), so one run's peak can be measured in a process
    that did other work before. Returns False where the kernel does not allow it."""
    gc.collect()
    release_freed_heap()  # first, or the freed heap would count as part of the new peak
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc's (musl and macOS have none)
_mallinfo2 = getattr(_libc, "mallinfo2", None)  # glibc 2.33 and later (mallinfo's int fields wrap past 2 GiB)
if _mallinfo2 is not None:
    _mallinfo2.restype = _MallInfo2


def page_cache_bytes(path: str | os.PathLike) -> int:
    """Bytes of `path` currently in the page cache (mincore over a mapping that is never touched)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)

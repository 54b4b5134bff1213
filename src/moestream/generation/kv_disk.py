"""The prefix cache's tier on disk: the KV of prefixes that left RAM, kept as files under a byte budget, found
by token ids, and still there after a restart.

Why: agents resend the whole conversation every turn, and the RAM prefix cache (kv_cache.PrefixCache) holds a
few of them at most (a 12k-token prompt's KV at the Qwen3-30B-A3B shape is 1.2 GB in bf16, more than its
default budget); a second conversation, or a restart, evicts the first, whose next turn then pays the whole
prefill again: minutes on a CPU. The SSD that holds the experts gives that file back in a second or two
(docs/BENCHMARKS.md, "Conversations through the KV tier on disk").

A file per prefix (`<xxh3 of its token ids>.kv`):

    8 bytes   magic, b"MSKVTIER"
    8 bytes   the header's length H, little-endian
    H bytes   the header, JSON, padded with spaces so that the payload starts at a multiple of 4 KiB: the
              tier's format version, the identity of what wrote it (the store's manifest checksum, the
              model's KV layout and dtype: `identity`), the token ids the KV covers, each layer's class and
              attributes, each tensor's dtype, shape and offset in the payload (64-byte aligned), and the
              payload's xxh3-64
    payload   the tensors' bytes, one after another

A file is written to a temporary name and renamed, so a reader never sees half of one; it is read whole
(`read_file`: a large one with O_DIRECT by several threads) and its payload checked against the header's
checksum before any of it is used. A file of another identity (another store, KV layout or dtype, another
version of this format) is left alone and never loaded; a damaged or truncated one is deleted. Writes run on
a thread of their own at the lowest priority, so the model thread that evicts a prefix from RAM never waits
on the disk, and a decode step beside a write keeps its speed.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import xxhash
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from ..conversion.store import MANIFEST, file_checksum
from ..core.compute.attention import quantizes_kv
from ..core.runtime import runtime_of
from ..errors import UsageError
from .kv_layer import Int8Layer

log = logging.getLogger("moestream")

MAGIC = b"MSKVTIER"
FORMAT = 1
ALIGN = 4096  # the payload's start in a file (a page: each tensor's offset suits its dtype, and direct reads)
SUFFIX = ".kv"
_LAYER_CLASSES = {cls.__name__: cls for cls in (DynamicLayer, DynamicSlidingWindowLayer, Int8Layer)}
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64)}


class TierFileError(Exception):
    """A tier file that cannot be used: damaged, truncated, or not one of ours."""


def identity(manifest_checksum: str, model_config, kv: str = "float") -> dict:
    """What a tier file must have been written for: the store (its manifest's checksum), the KV layout its
    model computes (layers, KV heads, head size) and its KV's dtype (`kv`: the compute dtype's name, or
    "int8" for an 8-bit cache), with this format's version."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    layout = {
        name: getattr(config, name, None)
        for name in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "sliding_window")
    }
    return {"format": FORMAT, "store": manifest_checksum, "layout": layout, "kv": kv}


def tier_for(model, directory: str | os.PathLike, budget_bytes: int) -> DiskTier:
    """The prefix cache's tier on disk for a loaded `model`: its files are this store's (the manifest's
    checksum), for this KV layout and dtype (an 8-bit cache, else the compute dtype's)."""
    manifest = file_checksum(runtime_of(model).store.directory / MANIFEST)
    kv = "int8" if quantizes_kv(model) else str(model.get_input_embeddings().weight.dtype).removeprefix("torch.")
    try:
        return DiskTier(directory, budget_bytes, identity(manifest, model.config, kv))
    except OSError as e:
        raise UsageError(
            f"cannot keep the KV tier in {directory} ({e}); give another directory with --kv-disk, or --kv-disk off"
        ) from None


def file_name(ids: Sequence[int]) -> str:
    return xxhash.xxh3_64_hexdigest(json.dumps(list(ids)).encode()) + SUFFIX


def _plain(value):
    """An attribute of a cache or layer as JSON, or raise ValueError for one a file cannot hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    raise ValueError(f"an attribute of type {type(value).__name__}")


def _restored(value):
    if isinstance(value, dict) and "device" in value:
        return torch.device("cpu")  # (the tier serves the CPU's caches)
    if isinstance(value, dict) and "dtype" in value:
        return _DTYPES[value["dtype"]]
    return value


def encode(ids: Sequence[int], cache: DynamicCache, ident: dict) -> bytes:
    """A tier file's bytes for the KV of `ids` in `cache` (`encode_parts`, joined)."""
    return b"".join(encode_parts(ids, cache, ident))


def encode_parts(ids: Sequence[int], cache: DynamicCache, ident: dict) -> list:
    """A tier file's bytes for the KV of `ids` in `cache` (a batch-1 cache of plain layers on the CPU), as the
    pieces to write one after another (the tensors' own memory, not copies); ValueError for a cache the format
    cannot hold (another layer class, an attribute it cannot write)."""
    tensors: list[torch.Tensor] = []
    layers = []
    for layer in cache.layers:
        name = type(layer).__name__
        if name not in _LAYER_CLASSES:
            raise ValueError(f"a {name} layer")
        attrs, stored = {}, {}
        for key, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                if value.device.type != "cpu" or str(value.dtype).removeprefix("torch.") not in _DTYPES:
                    raise ValueError(f"a tensor on {value.device} in {value.dtype}")
                stored[key] = len(tensors)
                tensors.append(value.contiguous())
            else:
                attrs[key] = _plain(value)
        layers.append({"class": name, "attrs": attrs, "tensors": stored})
    cache_attrs = {key: _plain(value) for key, value in vars(cache).items() if key != "layers"}
    specs, pieces, offset = [], [], 0
    checksum = xxhash.xxh3_64()
    for t in tensors:
        size = t.numel() * t.element_size()
        pad = -offset % 64  # each tensor 64-byte aligned, whatever the sizes before it
        piece = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if size else b""
        for part in (bytes(pad), piece):
            checksum.update(part)
            pieces.append(part)
        offset += pad
        specs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset, "bytes": size})
        offset += size
    header = {
        **ident,
        "ids": list(ids),
        "cache": cache_attrs,
        "layers": layers,
        "tensors": specs,
        "checksum": checksum.hexdigest(),
    }
    head = json.dumps(header).encode()
    head += b" " * (-(16 + len(head)) % ALIGN)  # (JSON's whitespace): the payload starts aligned
    return [MAGIC + len(head).to_bytes(8, "little") + head, *pieces]


def read_header(path: Path) -> dict:
    """A tier file's header, read alone (the index reads these at start); TierFileError if it has none."""
    with open(path, "rb") as f:
        start = f.read(16)
        if len(start) != 16 or start[:8] != MAGIC:
            raise TierFileError("not a tier file")
        size = int.from_bytes(start[8:], "little")
        head = f.read(size)
    if len(head) != size:
        raise TierFileError("truncated header")
    try:
        return json.loads(head)
    except ValueError:
        raise TierFileError("a damaged header") from None


def decode(data: bytes, ident: dict) -> tuple[list[int], DynamicCache]:
    """(token ids, cache) from a tier file's bytes; TierFileError where they are damaged, truncated or of
    another identity."""
    if len(data) < 16 or bytes(data[:8]) != MAGIC:
        raise TierFileError("not a tier file")
    size = int.from_bytes(data[8:16], "little")
    try:
        header = json.loads(bytes(data[16 : 16 + size]))
    except ValueError:
        raise TierFileError("a damaged header") from None
    if any(header.get(key) != value for key, value in ident.items()):
        raise TierFileError("written for another store, KV layout or format")
    payload = memoryview(data)[16 + size :]
    specs = header["tensors"]
    if len(payload) != (specs[-1]["offset"] + specs[-1]["bytes"] if specs else 0):
        raise TierFileError("truncated")
    if xxhash.xxh3_64_hexdigest(payload) != header["checksum"]:
        raise TierFileError("its checksum does not match: damaged")
    tensors = []
    writable = bytearray(data) if isinstance(data, bytes) else data  # (the tensors are views into it: no copy)
    for spec in specs:
        if not spec["bytes"]:
            tensors.append(torch.empty(spec["shape"], dtype=_DTYPES[spec["dtype"]]))
            continue
        raw = torch.frombuffer(writable, dtype=torch.uint8, count=spec["bytes"], offset=16 + size + spec["offset"])
        tensors.append(raw.view(_DTYPES[spec["dtype"]]).view(spec["shape"]))
    cache = DynamicCache.__new__(DynamicCache)
    cache.__dict__.update({key: _restored(value) for key, value in header["cache"].items()})
    cache.layers = []
    for entry in header["layers"]:
        cls = _LAYER_CLASSES.get(entry["class"])
        if cls is None:
            raise TierFileError(f"a layer class {entry['class']!r} this version does not read")
        layer = cls.__new__(cls)
        layer.__dict__.update({key: _restored(value) for key, value in entry["attrs"].items()})
        for key, index in entry["tensors"].items():
            setattr(layer, key, tensors[index])
        cache.layers.append(layer)
    return header["ids"], cache


WRITER_NICENESS = 19  # the writer thread's: the lowest priority (Linux gives each thread its own)
DIRECT_FROM = 64 << 20  # files this large are read with O_DIRECT, by READERS threads in pieces of PIECE bytes
READERS, PIECE = 4, 16 << 20


def read_file(path: Path):
    """A tier file's bytes, writable (a bytearray, or a memoryview of page-aligned memory). A large one is read
    around the page cache (O_DIRECT) by several threads at once, which keep the disk's queue full as the
    expert reader's I/O threads do (benchmarks/kv_tier.py --shape compares it with the disk read alone);
    where the file system refuses O_DIRECT, a plain read."""
    size = path.stat().st_size
    if size >= DIRECT_FROM:
        try:
            return _read_direct(path, size)
        except OSError:
            pass  # (a file system without O_DIRECT: tmpfs, some network mounts)
    with open(path, "rb") as f:
        data = bytearray(size)
        if f.readinto(data) != size:
            raise TierFileError("shorter than when it was opened")
    return data


def _read_direct(path: Path, size: int):
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    buffer = mmap.mmap(-1, size + PIECE)  # anonymous memory is page-aligned, as O_DIRECT needs
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with ThreadPoolExecutor(READERS) as pool:
            got = sum(pool.map(lambda offset: os.preadv(fd, [view[offset : offset + PIECE]], offset), range(0, size, PIECE)))
    finally:
        os.close(fd)
    if got != size:
        raise TierFileError("shorter than when it was opened")
    return view[:size]


@dataclass
class DiskStats:
    entries: int = 0
    bytes: int = 0
    hits: int = 0
    tokens_reused: int = 0
    writes: int = 0
    bytes_written: int = 0
    reads: int = 0
    bytes_read: int = 0
    dropped: int = 0  # files found damaged, truncated or of another identity
    errors: int = 0  # reads or writes that failed (a full disk, an I/O error)


class DiskTier:
    """Prefixes' KV as files in `directory`, under `budget_bytes`, least recently used out first.

    At start it reads the headers of the files there (`_scan`): those of this `ident` are the index, the
    others are left alone. `put(ids, cache)` queues a prefix for the writer thread; `match(prompt_ids)` finds
    the file sharing the longest prefix with the prompt (at least one prompt token left to feed) and reads it.
    Thread-safe: the model thread puts and matches, the writer writes, /metrics reads the statistics."""

    def __init__(self, directory: str | os.PathLike, budget_bytes: int, ident: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = budget_bytes
        self.ident = ident
        self._index: dict[tuple[int, ...], _Entry] = {}
        self._lock = threading.Lock()
        self._stats = DiskStats()
        self._scan()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="moestream-kv-disk", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        foreign = 0
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                header = read_header(path)
            except (OSError, TierFileError):
                self._remove(path)
                self._stats.dropped += 1
                continue
            if any(header.get(key) != value for key, value in self.ident.items()):
                foreign += 1
                continue
            stat = path.stat()
            self._index[tuple(header["ids"])] = _Entry(path, stat.st_size, stat.st_mtime, _cuttable(header))
        if foreign:
            log.warning(
                "moestream: the KV tier %s holds %d prefixes of another store, KV layout or version: not used",
                self.directory,
                foreign,
            )
        self._trim()

    # -- writing ---------------------------------------------------------------------------------------------

    def put(self, ids: Sequence[int], cache: DynamicCache) -> None:
        """Queue the KV of `ids` (a prefix cache's entry, whose tensors are never written again) for the disk."""
        ids = tuple(ids)
        with self._lock:
            if ids in self._index:
                return
        self._queue.put((ids, cache))

    def flush(self) -> None:
        """Wait until every queued prefix is written (a clean stop; the tests)."""
        self._queue.join()

    def _write_loop(self) -> None:
        # The writer yields the CPU to the model's threads: a prefix's gigabyte (hashed, copied into the page
        # cache) taken at their priority slowed a decode step beside it.
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass  # (a platform without per-thread priorities: the writer runs as it is)
        while True:
            ids, cache = self._queue.get()
            try:
                self._write(ids, cache)
            except Exception as e:  # the writer outlives any one prefix: that one stays in RAM only
                with self._lock:
                    self._stats.errors += 1
                log.warning("moestream: the KV tier could not write a prefix (%s)", e)
            finally:
                self._queue.task_done()

    def _write(self, ids: tuple[int, ...], cache: DynamicCache) -> None:
        try:
            parts = encode_parts(ids, cache, self.ident)
        except ValueError as e:
            log.debug("moestream: a prefix the KV tier cannot hold (%s)", e)
            return
        size = sum(len(part) for part in parts)
        if size > self.budget_bytes:
            return
        path = self.directory / file_name(ids)
        temporary = path.with_suffix(".tmp")
        try:
            with open(temporary, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(temporary, path)
        except OSError as e:
            self._remove(temporary)
            with self._lock:
                self._stats.errors += 1
            log.warning("moestream: the KV tier could not write a prefix (%s); it stays in RAM only", e)
            return
        with self._lock:
            # A shorter prefix of the new one is dominated by it (the same ids queued twice: the same file).
            for old in [old for old in self._index if len(old) < len(ids) and old == ids[: len(old)]]:
                self._remove(self._index.pop(old).path)
            self._index[ids] = _Entry(path, size, time.time(), _cuttable(read_header(path)))
            self._stats.writes += 1
            self._stats.bytes_written += size
            self._trim()

    def _trim(self) -> None:
        """Drop least recently used files until the tier fits its budget (the lock held, or at start)."""
        total = sum(entry.size for entry in self._index.values())
        for ids in sorted(self._index, key=lambda ids: self._index[ids].used):
            if total <= self.budget_bytes:
                break
            entry = self._index.pop(ids)
            self._remove(entry.path)
            total -= entry.size

    # -- reading ---------------------------------------------------------------------------------------------

    def match(self, prompt_ids: Sequence[int], at_least: int = 1) -> tuple[DynamicCache | None, int]:
        """(a cache of the longest prefix of the prompt the tier holds, its length), or (None, 0) where none
        is at least `at_least` tokens long or the file cannot be used (it is then dropped)."""
        prompt = tuple(prompt_ids)
        with self._lock:
            best, best_len = None, 0
            for ids, entry in self._index.items():
                n = common_prefix(ids, prompt, len(prompt) - 1)
                if n > best_len and n >= at_least and (n == len(ids) or entry.cuttable):
                    best, best_len = ids, n
            if best is None:
                return None, 0
            path = self._index[best].path
        try:
            data = read_file(path)
            ids, cache = decode(data, self.ident)
            if tuple(ids) != best:
                raise TierFileError("its token ids are not the index's")
        except (OSError, TierFileError) as e:
            with self._lock:
                if self._index.pop(best, None) is not None:
                    self._stats.dropped += 1
            self._remove(path)
            log.warning("moestream: a KV tier file could not be used (%s): the prefix is computed again", e)
            return None, 0
        with self._lock:
            if best in self._index:
                self._index[best].used = time.time()
            self._stats.reads += 1
            self._stats.bytes_read += len(data)
            self._stats.hits += 1
            self._stats.tokens_reused += best_len
        if best_len < len(best):
            cache.crop(best_len - len(best))
        return cache, best_len

    def stats(self) -> DiskStats:
        with self._lock:
            return replace(self._stats, entries=len(self._index), bytes=sum(entry.size for entry in self._index.values()))

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading ids `a` and `b` share, at most `limit`."""
    n = 0
    for x, y in zip(a, b):
        if x != y or n >= limit:
            break
        n += 1
    return n


@dataclass
class _Entry:
    path: Path
    size: int
    used: float  # when last written or read (time.time(): files from before a restart keep their order)
    cuttable: bool  # its KV can be cut back to a shorter prefix (kv_cache._cuttable)


def _cuttable(header: dict) -> bool:
    """Whether a file's KV can be cut back: no sliding-window layer that has already dropped positions."""
    for layer in header["layers"]:
        attrs = layer["attrs"]
        window = attrs.get("sliding_window")
        if layer["class"] == "DynamicSlidingWindowLayer" and window is not None and attrs.get("cumulative_length", 0) >= window:
            return False
    return True

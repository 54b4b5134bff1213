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
              attributes, each tensor's dtype, shape, offset in the payload and xxh3-64, the payload's size
    payload   the tensors one after another, each as blocks of rows (a KV tensor [batch, heads, positions,
              head_dim]: a block per head), each block starting at a multiple of 4 KiB

A file is written to a temporary name and renamed, so a reader never sees half of one. Reading it back
(`load`) puts each block straight where the cache keeps it, with room after a full-attention layer's
positions for the tokens that follow (the aligned blocks are what lets a direct read land there), and
checks every tensor against its checksum before any of it is used: the prefix costs its read and nothing
more. A file of another identity (another store, KV layout or dtype, another version of this format) is
left alone and never loaded; a damaged or truncated one is deleted. Writes run on a thread of their own at
the lowest priority, so the model thread that evicts a prefix from RAM never waits on the disk, and a
decode step beside a write keeps its speed.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import mmap
import os
import queue
import threading
import time
from array import array
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
from .kv_layer import ROOM, GrowingLayer, Int8Layer

log = logging.getLogger("moestream")

MAGIC = b"MSKVTIER"
FORMAT = 2  # 2: each block of rows aligned, read into the cache's memory in place (1: tensors packed)
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
    embedding = model.get_input_embeddings()
    # (a GGUF's quantized token embedding has no float weight: it gives its rows in the compute dtype)
    weight = getattr(embedding, "weight", None)
    computes = weight.dtype if weight is not None else embedding.dtype
    kv = "int8" if quantizes_kv(model) else str(computes).removeprefix("torch.")
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


def _blocks(shape: Sequence[int]) -> tuple[int, int, int]:
    """(blocks, rows, row length) of a tensor as a file holds it: a block of rows per index of its leading
    dimensions (a KV layer's [batch, heads, positions, head_dim]: a block of positions per head); a tensor
    of fewer than two dimensions is one block of one row."""
    if len(shape) < 2:
        return 1, 1, math.prod(shape)
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _aligned(size: int) -> int:
    return size + (-size % ALIGN)


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
    zeros = memoryview(bytes(ALIGN))
    for t in tensors:
        blocks, rows, width = _blocks(t.shape)
        size = rows * width * t.element_size()
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        checksum = xxhash.xxh3_64()
        for b in range(blocks if size else 0):  # (the checksum covers the padding too: every byte of the file)
            pieces += [raw[b * size : (b + 1) * size], zeros[: _aligned(size) - size]]
            checksum.update(pieces[-2])
            checksum.update(pieces[-1])
        specs.append(
            {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": offset,
                "block": _aligned(size),
                "checksum": checksum.hexdigest(),
            }
        )
        offset += blocks * _aligned(size)
    header = {**ident, "ids": list(ids), "cache": cache_attrs, "layers": layers, "tensors": specs, "bytes": offset}
    head = json.dumps(header).encode()
    head += b" " * (-(16 + len(head)) % ALIGN)  # (JSON's whitespace): the payload starts aligned
    return [MAGIC + len(head).to_bytes(8, "little") + head, *pieces]


def write_file(path: Path, ids: Sequence[int], cache: DynamicCache, ident: dict) -> int:
    """Write the tier file of `ids` to `path` through a temporary name (a reader never sees half of one);
    its size. ValueError for a cache the format cannot hold, OSError where the disk refuses."""
    parts = encode_parts(ids, cache, ident)
    temporary = path.with_suffix(".tmp")
    try:
        with open(temporary, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(temporary, path)
    except OSError:
        DiskTier._remove(temporary)
        raise
    return sum(len(part) for part in parts)


def read_header(path: Path) -> tuple[dict, int]:
    """A tier file's header, read alone (the index reads these at start), and where its payload starts;
    TierFileError if it has none."""
    with open(path, "rb") as f:
        start = f.read(16)
        if len(start) != 16 or start[:8] != MAGIC:
            raise TierFileError("not a tier file")
        size = int.from_bytes(start[8:], "little")
        head = f.read(size)
    if len(head) != size:
        raise TierFileError("truncated header")
    try:
        return json.loads(head), 16 + size
    except ValueError:
        raise TierFileError("a damaged header") from None


# Layer classes read back as growing layers (kv_layer.GrowingLayer): their buffers get room for ROOM more
# positions after the file's, so the prompt's tokens after the prefix and the decode steps after it are
# written in place instead of copying the prefix (a gigabyte at the 30B shape) at the first of them.
_GROWING = {"DynamicLayer": GrowingLayer, "Int8Layer": Int8Layer}

WRITER_NICENESS = 19  # the writer thread's: the lowest priority (Linux gives each thread its own)
DIRECT_FROM = 64 << 20  # files this large are read with O_DIRECT, by READERS threads in pieces of PIECE bytes
READERS, PIECE = 4, 16 << 20
IOV_MAX = 512  # blocks per read call, within every Linux's limit (1,024)


def load(path: Path, ident: dict, keep: int | None = None) -> tuple[list[int], DynamicCache, Arrival]:
    """(token ids, cache, its arrival) of a tier file, its first `keep` positions (None: all); TierFileError
    where its header says it is truncated or of another identity.

    Each block of rows is read straight into its place in the cache's memory: full-attention layers get
    buffers with room after their positions (`_GROWING`), so nothing is copied after the read. A large file
    is read around the page cache (O_DIRECT) by several threads at once, which keep the disk's queue full as
    the expert reader's I/O threads do; where the file system refuses O_DIRECT, plain reads. The reads go on
    after `load` returns, in layer order, while the model computes the first layers (`Arrival`): each
    tensor is checked against its checksum as it lands, and a layer's first update waits for its own (and
    raises TierFileError if the file proved damaged). A cache with layers of other kinds, which have no such
    wait, is returned only once all of it is in and checked."""
    header, start = read_header(path)
    if any(header.get(key) != value for key, value in ident.items()):
        raise TierFileError("written for another store, KV layout or format")
    specs = header["tensors"]
    size = path.stat().st_size
    if size != start + header["bytes"]:
        raise TierFileError("truncated" if size < start + header["bytes"] else "longer than its header says")
    growing = {index for entry in header["layers"] if entry["class"] in _GROWING for index in entry["tensors"].values()}
    places, capacities, total = [], [], 0  # (where each tensor starts in memory, its blocks' stride there)
    for index, spec in enumerate(specs):
        blocks, rows, width = _blocks(spec["shape"])
        capacities.append(rows + ROOM if index in growing else rows)
        stride = _aligned(capacities[-1] * width * _DTYPES[spec["dtype"]].itemsize)
        places.append((total, stride))
        total += blocks * stride
    memory = mmap.mmap(-1, max(total, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned, as O_DIRECT needs
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)  # (fewer page faults for a gigabyte: they cost as much as the read)
    arrival = Arrival(path, start, size, specs, places, memoryview(memory))
    base = torch.frombuffer(memory, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    buffers = []  # each tensor with the room after its positions (`growing` only)
    for spec, (place, stride), capacity in zip(specs, places, capacities):
        dtype, shape = _DTYPES[spec["dtype"]], spec["shape"]
        blocks, rows, width = _blocks(shape)
        if not blocks * rows * width:
            buffers.append(torch.empty(shape, dtype=dtype))
            continue
        flat = base[place : place + blocks * stride].view(dtype)
        lead = list(shape[:-2]) if len(shape) >= 2 else []
        lead_strides = [stride // dtype.itemsize * math.prod(lead[i + 1 :]) for i in range(len(lead))]
        full = flat.as_strided([*lead, capacity, width], [*lead_strides, width, 1])
        buffers.append(full if len(shape) >= 2 else full.reshape(-1)[: math.prod(shape)].view(shape))
    cache = DynamicCache.__new__(DynamicCache)
    cache.__dict__.update({key: _restored(value) for key, value in header["cache"].items()})
    cache.layers = []
    waits = True  # every layer waits for its own tensors (else the whole file is waited for here)
    for entry in header["layers"]:
        cls = _GROWING.get(entry["class"]) or _LAYER_CLASSES.get(entry["class"])
        if cls is None:
            raise TierFileError(f"a layer class {entry['class']!r} this version does not read")
        layer = cls.__new__(cls)
        layer.__dict__.update({key: _restored(value) for key, value in entry["attrs"].items()})
        stored = entry["tensors"]
        if isinstance(layer, GrowingLayer) and set(stored) == {"keys", "values"}:
            rows = specs[stored["keys"]]["shape"][-2]
            layer.hold(buffers[stored["keys"]], buffers[stored["values"]], rows if keep is None else min(keep, rows))
            layer.arriving = functools.partial(arrival.wait, (stored["keys"], stored["values"]))
            cache.layers.append(layer)
            continue
        waits = False
        for key, index in stored.items():
            rows = _blocks(specs[index]["shape"])[1]
            setattr(layer, key, buffers[index][..., :rows, :] if index in growing else buffers[index])
        if keep is not None and keep < len(header["ids"]):
            layer.crop(keep - len(header["ids"]))  # (transformers: minus the positions to remove)
        cache.layers.append(layer)
    arrival.start()
    if not waits:
        arrival.wait(range(len(specs)))
    return header["ids"], cache, arrival


_readers = None  # the threads that read tier files (`Arrival`), made at the first read
_readers_lock = threading.Lock()


class Arrival:
    """A tier file's reads under way, into the memory `load` laid out: pieces of at most PIECE bytes in file
    order on READERS threads; each tensor is checked against its checksum, on a reading thread, once its last
    block is in. `wait(tensors)` blocks until those are in and checked; `then(checked, damaged)` calls
    `checked()` once every tensor is, or `damaged(reason)` once one is not (a checksum, a short or failed
    read), whichever comes (at once if it has come)."""

    def __init__(self, path: Path, start: int, size: int, specs: list, places: list, view: memoryview):
        self.path, self.size, self.specs = path, size, specs
        self._view, self._places = view, places
        self._lock = threading.Lock()
        self._done = [threading.Event() for _ in specs]
        self._left = [0] * len(specs)  # reads each tensor waits for
        self._unchecked = len(specs)
        self._failed: str | None = None
        self._callbacks: list = []
        self._reads = []  # (file offset, [memory views of consecutive blocks], the tensors they touch)
        end = None  # where the last read ends in the file
        for index, (spec, (place, stride)) in enumerate(zip(specs, places)):
            for b in range(_blocks(spec["shape"])[0] if spec["block"] else 0):
                offset, block = start + spec["offset"] + b * spec["block"], view[place + b * stride :][: spec["block"]]
                last = self._reads[-1] if self._reads else None
                if last and end == offset and len(last[1]) < IOV_MAX and end - last[0] < PIECE:
                    last[1].append(block)
                    if last[2][-1] != index:
                        last[2].append(index)
                        self._left[index] += 1
                else:
                    self._reads.append((offset, [block], [index]))
                    self._left[index] += 1
                end = offset + len(block)

    def start(self) -> None:
        global _readers
        fd = None
        if self.size >= DIRECT_FROM:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                pass  # (a file system without O_DIRECT: tmpfs, some network mounts)
        self._fd = os.open(self.path, os.O_RDONLY) if fd is None else fd
        self._open_reads = len(self._reads)
        for index in range(len(self.specs)):
            if not self._left[index]:
                self._check(index)  # (an empty tensor)
        if not self._reads:
            os.close(self._fd)
            return
        with _readers_lock:
            if _readers is None:
                from concurrent.futures import ThreadPoolExecutor

                _readers = ThreadPoolExecutor(READERS, thread_name_prefix="moestream-kv-read")
        for job in self._reads:
            _readers.submit(self._read, job)

    def _read(self, job) -> None:
        offset, views, tensors = job
        try:
            if self._failed is None and os.preadv(self._fd, views, offset) != sum(map(len, views)):
                self._fail("shorter than when it was opened")
        except OSError as e:
            self._fail(f"a read failed: {e}")
        for index in tensors:
            with self._lock:
                self._left[index] -= 1
                ready = self._left[index] == 0
            if ready:
                self._check(index)
        with self._lock:
            self._open_reads -= 1
            last = self._open_reads == 0
        if last:
            os.close(self._fd)

    def _check(self, index: int) -> None:
        spec, (place, stride) = self.specs[index], self._places[index]
        if self._failed is None:
            checksum = xxhash.xxh3_64()
            for b in range(_blocks(spec["shape"])[0] if spec["block"] else 0):
                checksum.update(self._view[place + b * stride :][: spec["block"]])
            if checksum.hexdigest() != spec["checksum"]:
                self._fail("its checksum does not match: damaged")
        with self._lock:
            self._unchecked -= 1
            everything = self._unchecked == 0 and self._failed is None
        self._done[index].set()
        if everything:
            self._settle()

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self._failed is not None:
                return
            self._failed = reason
        for event in self._done:
            event.set()  # (whoever waits learns of it now)
        self._settle()

    def _settle(self) -> None:
        with self._lock:
            callbacks, self._callbacks = self._callbacks, []
        for checked, damaged in callbacks:
            self._call(checked, damaged)

    def _call(self, checked, damaged) -> None:
        if self._failed is not None:
            damaged(self._failed)
        else:
            checked()

    def then(self, checked, damaged) -> None:
        with self._lock:
            if self._failed is None and self._unchecked:
                self._callbacks.append((checked, damaged))
                return
        self._call(checked, damaged)

    def wait(self, tensors) -> None:
        """Block until `tensors` (indexes into the file's) are in and checked; TierFileError if the file proved
        damaged meanwhile."""
        for index in tensors:
            self._done[index].wait()
            if self._failed is not None:
                raise TierFileError(self._failed)


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
        # Keyed by the prefix's ids packed 4 bytes each (`packed`): a tier of small models' KV holds millions
        # of tokens, which as tuples of Python ints took 36 bytes each in RAM, growing with the disk.
        self._index: dict[bytes, _Entry] = {}
        # Prefixes queued and not yet written, by the same keys: their KV is still in RAM (`pending`).
        self._pending: dict[bytes, tuple[tuple[int, ...], DynamicCache]] = {}
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
                header, _ = read_header(path)
            except (OSError, TierFileError):
                self._remove(path)
                self._stats.dropped += 1
                continue
            if any(header.get(key) != value for key, value in self.ident.items()):
                foreign += 1
                continue
            stat = path.stat()
            self._index[packed(header["ids"])] = _Entry(path, stat.st_size, stat.st_mtime, _cuttable(header))
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
        key = packed(ids)
        with self._lock:
            if key in self._index or key in self._pending:
                return
            self._pending[key] = (ids, cache)
        self._queue.put((ids, cache))

    def pending(self) -> list[tuple[tuple[int, ...], DynamicCache]]:
        """The prefixes queued and not yet written, (ids, cache) each: their KV is in RAM until its file is
        done. An agent's next turn comes as soon as its tool has run, while the last turn's gigabyte of KV
        is still being written (by a writer that yields the CPU to the prefill of that very turn): it finds
        its prefix here, not on disk."""
        with self._lock:
            return list(self._pending.values())

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
                with self._lock:
                    self._pending.pop(packed(ids), None)
                self._queue.task_done()

    def _write(self, ids: tuple[int, ...], cache: DynamicCache) -> None:
        path = self.directory / file_name(ids)
        try:
            size = write_file(path, ids, cache, self.ident)
        except ValueError as e:
            log.debug("moestream: a prefix the KV tier cannot hold (%s)", e)
            return
        except OSError as e:
            with self._lock:
                self._stats.errors += 1
            log.warning("moestream: the KV tier could not write a prefix (%s); it stays in RAM only", e)
            return
        if size > self.budget_bytes:
            self._remove(path)
            return
        key = packed(ids)
        with self._lock:
            # A shorter prefix of the new one is dominated by it (the same ids queued twice: the same file).
            for old in [old for old in self._index if len(old) < len(key) and key.startswith(old)]:
                self._remove(self._index.pop(old).path)
            self._index[key] = _Entry(path, size, time.time(), _cuttable(read_header(path)[0]))
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

    def match(self, prompt_ids: Sequence[int], at_least: int = 1, when_checked=None) -> tuple[DynamicCache | None, int]:
        """(a cache of the longest prefix of the prompt the tier holds, its length), or (None, 0) where none
        is at least `at_least` tokens long or the file cannot be used (it is then dropped). The cache's bytes
        may still be arriving (`load`); once all are in and checked, `when_checked(prefix ids, cache)`."""
        prompt = tuple(prompt_ids)
        key = packed(prompt)
        with self._lock:
            best, best_len = None, 0
            for ids, entry in self._index.items():
                n = common_packed_prefix(ids, key, len(prompt) - 1)
                if n > best_len and n >= at_least and (n == len(ids) // ID_BYTES or entry.cuttable):
                    best, best_len = ids, n
            if best is None:
                return None, 0
            path, size = self._index[best].path, self._index[best].size
        try:
            ids, cache, arrival = load(path, self.ident, keep=best_len)
            if packed(ids) != best:
                raise TierFileError("its token ids are not the index's")
        except (OSError, TierFileError) as e:
            self._drop(best, path, str(e))
            return None, 0
        with self._lock:
            if best in self._index:
                self._index[best].used = time.time()
            self._stats.reads += 1
            self._stats.bytes_read += size
            self._stats.hits += 1
            self._stats.tokens_reused += best_len
        arrival.then(
            lambda: when_checked(prompt[:best_len], cache) if when_checked is not None else None,
            lambda reason: self._drop(best, path, reason),
        )
        return cache, best_len

    def _drop(self, ids: bytes, path: Path, reason: str) -> None:
        """A file found damaged (as it was read, or after): out of the index and deleted."""
        with self._lock:
            if self._index.pop(ids, None) is not None:
                self._stats.dropped += 1
        self._remove(path)
        log.warning("moestream: a KV tier file could not be used (%s): the prefix is computed again", reason)

    def stats(self) -> DiskStats:
        with self._lock:
            return replace(self._stats, entries=len(self._index), bytes=sum(entry.size for entry in self._index.values()))

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass


ID_BYTES = array("i").itemsize  # a token id in the index's keys (4 on every platform torch runs on)


def packed(ids: Sequence[int]) -> bytes:
    """Token ids as the index keeps them: ID_BYTES each, native order (ids are below 2^31)."""
    return array("i", ids).tobytes()


def common_packed_prefix(a: bytes, b: bytes, limit: int) -> int:
    """`common_prefix` of two `packed` id sequences: a binary search over lengths, each step one comparison
    of bytes (in C), instead of a Python loop over every shared id of every entry."""
    low, high = 0, min(len(a), len(b)) // ID_BYTES  # a[:low] == b[:low] (in ids); beyond high they cannot agree
    while low < high:
        middle = (low + high + 1) // 2
        if a[: middle * ID_BYTES] == b[: middle * ID_BYTES]:
            low = middle
        else:
            high = middle - 1
    return min(low, limit)


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

"""Check a store against its own manifest: structure, file sizes, every record's checksum, resident files.

`moestream verify` is the slow, complete check a user runs after copying a store, after a crash, or when
a run reported a checksum error: it reads every byte (or, with --quick, a sample of the records) and
lists everything that is wrong, instead of stopping at the first problem the way loading does.
"""

from __future__ import annotations

import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import safe_open
from tqdm.auto import tqdm

from ..errors import StoreError
from .store import MANIFEST, ExpertLayer, Store, checksum, file_checksum

VERIFY_THREADS = 4
QUICK_RECORDS_PER_LAYER = 8  # --quick: the first, the last and this many minus two random records per layer


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a store, with enough location to find it."""

    file: str
    message: str
    layer: int | None = None
    expert: int | None = None
    offset: int | None = None

    def __str__(self) -> str:
        where = [self.file]
        if self.layer is not None:
            where.append(f"layer {self.layer}")
        if self.expert is not None:
            where.append(f"expert {self.expert}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        return f"{', '.join(where)}: {self.message}"

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class VerifyReport:
    directory: Path
    quick: bool
    problems: list[Problem] = field(default_factory=list)
    records_checked: int = 0
    records_total: int = 0
    resident_files_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        scope = f"{self.records_checked} of {self.records_total} expert records"
        rate = self.bytes_checked / self.seconds / 1e9 if self.seconds else 0.0
        head = (
            f"{self.directory}: {'OK' if self.ok else f'{len(self.problems)} problem(s)'}; checked {scope} and "
            f"{self.resident_files_checked} resident file(s){' (headers only)' if self.quick else ''}, "
            f"{self.bytes_checked / 1e9:.2f} GB in {self.seconds:.1f} s ({rate:.2f} GB/s)"
        )
        lines = [head] + [f"  {p}" for p in self.problems]
        if not self.ok:
            lines.append("The store is damaged: convert the model again (or restore the listed files from a good copy).")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "directory": str(self.directory),
            "ok": self.ok,
            "quick": self.quick,
            "problems": [p.to_json() for p in self.problems],
            "records_checked": self.records_checked,
            "records_total": self.records_total,
            "resident_files_checked": self.resident_files_checked,
            "bytes_checked": self.bytes_checked,
            "seconds": self.seconds,
        }


def verify_store(directory: str | os.PathLike, quick: bool = False, progress: bool = True) -> VerifyReport:
    """Check everything the manifest promises; never raises for a damaged store, reports instead."""
    start = time.perf_counter()
    report = VerifyReport(Path(directory), quick)
    try:
        store = Store(directory, check_files=False)
    except StoreError as e:
        # Without a valid manifest nothing else can be located, let alone trusted.
        report.problems.append(Problem(MANIFEST, str(e)))
        report.seconds = time.perf_counter() - start
        return report
    manifest = store.manifest
    report.problems += [Problem(file, message) for file, message in store.file_problems()]
    chosen = {layer.index: _records_to_check(layer, quick) for layer in manifest.layers}
    report.records_total = sum(layer.num_experts for layer in manifest.layers)
    total = sum(len(chosen[layer.index]) * layer.layout.nbytes for layer in manifest.layers)
    if not quick:
        total += sum(f.size for f in manifest.resident_files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress) as bar:
        for layer in manifest.layers:
            _check_records(store, layer, chosen[layer.index], report, bar)
        for f in manifest.resident_files:
            _check_resident(store, f, quick, report, bar)
    report.seconds = time.perf_counter() - start
    return report


def _records_to_check(layer: ExpertLayer, quick: bool) -> list[int]:
    n = layer.num_experts
    if not quick or n <= QUICK_RECORDS_PER_LAYER:
        return list(range(n))
    # First and last catch truncation and a shifted layout; the random rest catch scattered damage, and
    # differ from run to run so repeated quick checks cover more of the store.
    sample = {0, n - 1} | set(random.sample(range(1, n - 1), QUICK_RECORDS_PER_LAYER - 2))
    return sorted(sample)


def _check_records(store: Store, layer: ExpertLayer, experts: list[int], report: VerifyReport, bar) -> None:
    path = store.path(layer.file)
    if not path.is_file():
        return  # already reported by file_problems
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        # Several reads in flight (pread and xxhash both release the GIL) keep an SSD's queue busy.
        with ThreadPoolExecutor(VERIFY_THREADS) as pool:
            ordered = sorted(experts, key=lambda e: layer.offsets[e])  # file order: mostly sequential
            for checked, problem in pool.map(lambda e: _check_record(fd, size, layer, e), ordered):
                report.records_checked += 1
                report.bytes_checked += checked
                bar.update(checked)
                if problem is not None:
                    report.problems.append(problem)
    finally:
        os.close(fd)


def _check_record(fd: int, size: int, layer: ExpertLayer, e: int) -> tuple[int, Problem | None]:
    """(bytes hashed, the problem or None) for one record."""
    nbytes, offset = layer.layout.nbytes, layer.offsets[e]
    where = dict(file=layer.file, layer=layer.index, expert=e, offset=offset)
    if offset + nbytes > size:
        return 0, Problem(message=f"record lies beyond the end of the file ({size} bytes)", **where)
    try:
        data = os.pread(fd, nbytes, offset)
    except OSError as err:
        return 0, Problem(message=f"read error: {err.strerror or err}", **where)
    os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)  # do not push the user's data out
    actual = checksum(data)
    if actual != layer.checksums[e]:
        return nbytes, Problem(message=f"checksum {actual} does not match the manifest's {layer.checksums[e]}", **where)
    return nbytes, None


def _check_resident(store: Store, entry, quick: bool, report: VerifyReport, bar) -> None:
    path = store.path(entry.path)
    if not path.is_file() or path.stat().st_size != entry.size:
        return  # already reported by file_problems
    report.resident_files_checked += 1
    try:
        with safe_open(path, framework="pt") as f:  # parses and bounds-checks the header, loads no tensor
            if not list(f.keys()):
                report.problems.append(Problem(entry.path, "holds no tensors"))
    except Exception as err:  # safetensors raises its own SafetensorError and OSError variants
        report.problems.append(Problem(entry.path, f"not a valid safetensors file: {err}"))
        return
    if quick:
        return
    actual = file_checksum(path)
    report.bytes_checked += entry.size
    bar.update(entry.size)
    if actual != entry.checksum:
        report.problems.append(Problem(entry.path, f"checksum {actual} does not match the manifest's {entry.checksum}"))

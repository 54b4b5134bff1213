"""The store format (docs/FORMAT.md): manifest, resident safetensors, one aligned record per (layer, expert).

This module knows files and bytes only. It writes and validates `manifest.json`; it never builds torch
modules and never caches anything. Everything read from a manifest is checked before it is trusted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

from ..errors import StoreError
from ..version import __version__
from .quant import GROUP_SIZES, LEGACY_PACKINGS, PORTABLE_PACKING, QUANT_FORMATS, TABLE_FORMATS, TABLE_GROUP, QuantFormat

FORMAT_NAME = "moestream-store"
# 2 added per-layer `quantization`; 3 added `dense_quantization` (resident linears stored quantized);
# 4 stores int4-family codes in the portable layout (quant.PORTABLE_PACKING) instead of torch's CPU kernel
# layout of the converting machine. Older stores read as before: version 1 and 2's resident weights are all
# floats, version 3's int4 bytes run where this machine's kernel has their layout (`moestream upgrade`
# rewrites them for every other).
FORMAT_VERSION = 4
READABLE_FORMAT_VERSIONS = (1, 2, 3, 4)
MANIFEST = "manifest.json"
# Every record starts on a 4 KiB boundary and its stored length is a multiple of 4 KiB, so one O_DIRECT
# read (offset, length and buffer all block-aligned) fetches exactly one expert.
RECORD_ALIGNMENT = 4096
# Tensors inside a record start on 64-byte boundaries: cache-line and SIMD friendly views.
TENSOR_ALIGNMENT = 64

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int32": torch.int32,
    "int64": torch.int64,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def checksum(data) -> str:
    """xxh3-64 of a bytes-like object, as 16 hex digits (fast enough to verify at disk speed)."""
    return xxhash.xxh3_64_hexdigest(data)


def file_checksum(path: Path, chunk: int = 16 * 1024**2) -> str:
    """xxh3-64 of a whole file, read in chunks."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of an expert record: where it sits inside the record and how to view it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}


@dataclass(frozen=True)
class RecordLayout:
    """The tensors one expert needs, packed back to back; `stride` is the padded on-disk size."""

    tensors: tuple[TensorEntry, ...]

    @staticmethod
    def pack(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> "RecordLayout":
        entries, offset = [], 0
        for name, dtype, shape in specs:
            offset = align_up(offset, TENSOR_ALIGNMENT)
            entry = TensorEntry(name, DTYPE_NAMES[dtype], tuple(int(d) for d in shape), offset)
            entries.append(entry)
            offset += entry.nbytes
        return RecordLayout(tuple(entries))

    @property
    def nbytes(self) -> int:
        last = self.tensors[-1]
        return last.offset + last.nbytes

    @property
    def stride(self) -> int:
        return align_up(self.nbytes, RECORD_ALIGNMENT)

    def to_json(self) -> list[dict]:
        return [t.to_json() for t in self.tensors]


@dataclass(frozen=True)
class ExpertLayer:
    """All records of one experts module (one MoE layer), stored in one file."""

    index: int  # position among the model's experts modules, in module order
    module: str  # e.g. "model.layers.3.mlp.experts"
    file: str  # path relative to the store directory
    layout: RecordLayout
    offsets: tuple[int, ...]  # one per expert
    checksums: tuple[str, ...]  # xxh3-64 of each record's payload (layout.nbytes bytes)
    quantization: QuantFormat | None = None  # None: the matrices are stored as floats

    @property
    def num_experts(self) -> int:
        return len(self.offsets)

    @property
    def quantized_matrices(self) -> list[tuple[int, int]]:
        """(N, K) of each quantized matrix of a record (its `qweight` holds K * bits / 8 bytes per row); none
        for float records."""
        fmt = self.quantization
        if fmt is None:
            return []
        return [(t.shape[0], t.shape[1] * 8 // fmt.bits) for t in self.layout.tensors if t.name.endswith(".qweight")]

    def to_json(self) -> dict:
        return {
            "index": self.index,
            "module": self.module,
            "file": self.file,
            "record_bytes": self.layout.nbytes,
            "record_stride": self.layout.stride,
            "tensors": self.layout.to_json(),
            "offsets": list(self.offsets),
            "checksums": list(self.checksums),
            "quantization": self.quantization.to_json() if self.quantization else None,
        }


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    checksum: str

    def to_json(self) -> dict:
        return {"path": self.path, "size": self.size, "checksum": self.checksum}


@dataclass
class Manifest:
    model_config: dict
    experts_dtype: str
    resident_files: list[FileEntry]
    resident_bytes: int
    layers: list[ExpertLayer]
    extra_files: list[str] = field(default_factory=list)  # tokenizer / generation config copied from the source
    source: dict = field(default_factory=dict)
    created_by: str = f"moestream {__version__}"
    # Resident linear layers stored quantized (module name -> format); their tensors are the module's
    # `qweight` and `scales`/`scales_zeros` in the resident files, in the layout of quant.pack.
    dense: dict[str, QuantFormat] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION  # as read; what `write` writes is always FORMAT_VERSION

    @property
    def expert_bytes(self) -> int:
        return sum(layer.layout.nbytes * layer.num_experts for layer in self.layers)

    @property
    def max_record_stride(self) -> int:
        return max(layer.layout.stride for layer in self.layers)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "created_by": self.created_by,
            "source": self.source,
            "model_config": self.model_config,
            "experts_dtype": self.experts_dtype,
            "resident": {"bytes": self.resident_bytes, "files": [f.to_json() for f in self.resident_files]},
            "experts": {"layers": [layer.to_json() for layer in self.layers]},
            "extra_files": self.extra_files,
            "dense_quantization": {name: fmt.to_json() for name, fmt in self.dense.items()},
        }

    def write(self, directory: Path) -> None:
        """Write manifest.json last of all and durably: its presence is what makes a store loadable."""
        tmp = directory / (MANIFEST + ".partial")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / MANIFEST)


# ---------------------------------------------------------------------------------------------------------
# Reading and validating


def _require(cond: bool, where: str, problem: str) -> None:
    if not cond:
        raise StoreError(f"manifest.json is invalid: {where}: {problem}. The store is damaged; convert it again.")


def _get(obj: dict, key: str, kind, where: str):
    _require(isinstance(obj, dict), where, "expected an object")
    _require(key in obj, where, f"missing field {key!r}")
    value = obj[key]
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    _require(ok, f"{where}.{key}", f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _confined_path(directory: Path, rel: str, where: str) -> Path:
    """Resolve a manifest path, refusing anything that would escape the store directory."""
    _require(bool(rel) and not os.path.isabs(rel), where, f"path {rel!r} must be relative")
    root = directory.resolve()
    try:
        full = (root / rel).resolve()
    except (OSError, ValueError, RuntimeError) as e:
        # A NUL byte or a character the filesystem cannot encode (ValueError), a symlink loop (RuntimeError
        # before Python 3.13): no converter writes such a path.
        raise StoreError(
            f"manifest.json is invalid: {where}: path {rel!r} cannot be looked up ({e}). The store is damaged; convert it again."
        ) from None
    _require(full.is_relative_to(root) and full != root, where, f"path {rel!r} escapes the store directory")
    return full


def _parse_layer(directory: Path, raw: dict, i: int) -> ExpertLayer:
    where = f"experts.layers[{i}]"
    tensors = []
    for j, t in enumerate(_get(raw, "tensors", list, where)):
        tw = f"{where}.tensors[{j}]"
        dtype = _get(t, "dtype", str, tw)
        _require(dtype in DTYPES, tw, f"unknown dtype {dtype!r}")
        shape = _get(t, "shape", list, tw)
        _require(all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape), tw, "bad shape")
        offset = _get(t, "offset", int, tw)
        _require(offset >= 0 and offset % TENSOR_ALIGNMENT == 0, tw, "offset must be 64-byte aligned")
        tensors.append(TensorEntry(_get(t, "name", str, tw), dtype, tuple(shape), offset))
    _require(len(tensors) > 0, where, "a record needs at least one tensor")
    layout = RecordLayout(tuple(tensors))
    ends = sorted((t.offset, t.offset + t.nbytes) for t in tensors)
    _require(all(a[1] <= b[0] for a, b in zip(ends, ends[1:])), where, "tensors of a record overlap")
    _require(_get(raw, "record_bytes", int, where) == layout.nbytes, where, "record_bytes disagrees with tensors")
    _require(_get(raw, "record_stride", int, where) == layout.stride, where, "record_stride is not aligned")
    offsets = _get(raw, "offsets", list, where)
    sums = _get(raw, "checksums", list, where)
    _require(len(offsets) > 0 and len(offsets) == len(sums), where, "offsets and checksums differ in length")
    for e, (off, s) in enumerate(zip(offsets, sums)):
        _require(isinstance(off, int) and not isinstance(off, bool) and off >= 0, where, f"offset of expert {e}")
        _require(off % RECORD_ALIGNMENT == 0, where, f"offset of expert {e} is not 4096-aligned")
        _require(isinstance(s, str) and len(s) == 16, where, f"checksum of expert {e}")
    spans = sorted(offsets)
    _require(all(b - a >= layout.stride for a, b in zip(spans, spans[1:])), where, "records overlap")
    file = _get(raw, "file", str, where)
    _confined_path(directory, file, where)
    return ExpertLayer(
        quantization=_parse_quantization(raw.get("quantization"), f"{where}.quantization"),
        index=_get(raw, "index", int, where),
        module=_get(raw, "module", str, where),
        file=file,
        layout=layout,
        offsets=tuple(offsets),
        checksums=tuple(sums),
    )


def _parse_quantization(raw, where: str) -> QuantFormat | None:
    if raw is None:
        return None
    name = _get(raw, "format", str, where)
    _require(name in QUANT_FORMATS + TABLE_FORMATS, where, f"unknown format {name!r}")
    group = raw.get("group_size")
    packing = raw.get("packing")
    if name in TABLE_FORMATS:
        _require(type(group) is int and group == TABLE_GROUP, where, f"{name} has groups of {TABLE_GROUP}")
        _require(packing == PORTABLE_PACKING, where, f"{name} codes are stored as {PORTABLE_PACKING!r}")
    elif name == "int8":
        _require(group is None and packing is None, where, "int8 has no group size or packing")
    else:
        # type(): 32.0 == 32 and True == 1, but the int4 kernel takes only an int.
        _require(type(group) is int and group in GROUP_SIZES, where, f"group_size must be one of {GROUP_SIZES}")
        _require(isinstance(packing, str), where, "packing must name the int4 codes' layout")
    return QuantFormat(name, group, packing)


def parse_manifest(directory: Path, raw) -> Manifest:
    """Validate a decoded manifest field by field; StoreError on the first problem."""
    _require(isinstance(raw, dict), "top level", "expected a JSON object")
    fmt = raw.get("format")
    if fmt != FORMAT_NAME:
        raise StoreError(f"{directory} is not a moestream store (format {fmt!r}); create one with `moestream convert`.")
    version = _get(raw, "format_version", int, "top level")
    if version not in READABLE_FORMAT_VERSIONS:
        newer = version > FORMAT_VERSION
        raise StoreError(
            f"{directory} uses store format version {version}, this moestream ({__version__}) reads versions "
            f"{' and '.join(map(str, READABLE_FORMAT_VERSIONS))}. "
            + ("Upgrade moestream to read it." if newer else "Convert the model again.")
        )
    config = _get(raw, "model_config", dict, "top level")
    _require(isinstance(config.get("model_type"), str), "model_config", "missing model_type")
    resident = _get(raw, "resident", dict, "top level")
    files = []
    for i, f in enumerate(_get(resident, "files", list, "resident")):
        path = _get(f, "path", str, f"resident.files[{i}]")
        _confined_path(directory, path, f"resident.files[{i}]")
        files.append(
            FileEntry(path, _get(f, "size", int, f"resident.files[{i}]"), _get(f, "checksum", str, f"resident.files[{i}]"))
        )
    layers = [
        _parse_layer(directory, layer, i)
        for i, layer in enumerate(_get(_get(raw, "experts", dict, "top level"), "layers", list, "experts"))
    ]
    _require(len(layers) > 0, "experts.layers", "a store needs at least one experts layer")
    _require([layer.index for layer in layers] == list(range(len(layers))), "experts.layers", "indices must be 0..n-1")
    extra = raw.get("extra_files", [])
    _require(isinstance(extra, list) and all(isinstance(x, str) for x in extra), "extra_files", "expected strings")
    for x in extra:
        _confined_path(directory, x, "extra_files")
    dense = _parse_dense(raw.get("dense_quantization", {}))
    for where, fmt in [(f"experts.layers[{layer.index}]", layer.quantization) for layer in layers] + list(dense.items()):
        if fmt is not None and fmt.packing is not None:
            # Version 4 writes the portable layout only; earlier versions named torch's CPU kernel layout.
            allowed = (PORTABLE_PACKING,) if version >= 4 else LEGACY_PACKINGS
            _require(fmt.packing in allowed, where, f"packing {fmt.packing!r} is not one of {', '.join(allowed)}")
    return Manifest(
        format_version=version,
        model_config=config,
        experts_dtype=_get(raw, "experts_dtype", str, "top level"),
        resident_files=files,
        resident_bytes=_get(resident, "bytes", int, "resident"),
        layers=layers,
        extra_files=extra,
        source=raw.get("source", {}) if isinstance(raw.get("source", {}), dict) else {},
        created_by=str(raw.get("created_by", "")),
        dense=dense,
    )


def _parse_dense(raw) -> dict[str, QuantFormat]:
    _require(isinstance(raw, dict), "dense_quantization", "expected an object of module name -> format")
    formats = {name: _parse_quantization(fmt, f"dense_quantization[{name!r}]") for name, fmt in raw.items()}
    _require(None not in formats.values(), "dense_quantization", "every entry needs a format")
    return formats


class Store:
    """An opened, validated store directory. Cheap to open: reads the manifest and stats the files."""

    def __init__(self, directory: str | os.PathLike, check_files: bool = True):
        self.directory = Path(directory)
        manifest_path = self.directory / MANIFEST
        if not self.directory.is_dir():
            raise StoreError(f"{self.directory} is not a directory; pass the output of `moestream convert`.")
        if not manifest_path.is_file():
            raise StoreError(
                f"{self.directory} has no {MANIFEST}: it is not a moestream store, or its conversion did not "
                "finish. Run `moestream convert SRC DST` (again)."
            )
        try:
            data = manifest_path.read_bytes()
        except OSError as e:
            raise StoreError(f"{manifest_path} cannot be read ({e}); the store is damaged, convert it again.") from None
        try:
            raw = json.loads(data.decode("utf-8"))
        except RecursionError:
            raise StoreError(
                f"{manifest_path} is not valid JSON (nested too deeply); the store is damaged, convert it again."
            ) from None
        except ValueError as e:  # also bytes that are not UTF-8, and an integer longer than Python's int digits limit
            raise StoreError(f"{manifest_path} is not valid JSON ({e}); the store is damaged, convert it again.") from None
        self.manifest = parse_manifest(self.directory, raw)
        problems = self.file_problems() if check_files else []
        if problems:
            raise StoreError(problems[0][1])

    def path(self, rel: str) -> Path:
        return _confined_path(self.directory, rel, "path")

    def file_problems(self) -> list[tuple[str, str]]:
        """(file, message) for every store file that is missing or shorter than the manifest says (resident
        files: not exactly as long)."""
        expected = [(f.path, f.size, True) for f in self.manifest.resident_files]
        expected += [(layer.file, max(layer.offsets) + layer.layout.stride, False) for layer in self.manifest.layers]
        problems = []
        for rel, size, exact in expected:
            p = self.path(rel)
            try:
                actual = p.stat().st_size if p.is_file() else None
            except OSError as e:  # e.g. a name longer than the filesystem allows
                problems.append(
                    (rel, f"store file {rel!r} cannot be read ({e.strerror}); the store is damaged, convert it again.")
                )
                continue
            if actual is None:
                problems.append(
                    (rel, f"store file {rel} is missing from {self.directory}; the store is incomplete, convert it again.")
                )
                continue
            if actual < size or (exact and actual != size):
                problems.append(
                    (
                        rel,
                        f"store file {rel} is {actual} bytes, the manifest says {size}: it is truncated "
                        "or was replaced; convert the model again.",
                    )
                )
        return problems

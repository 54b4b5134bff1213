"""The `upgrade` verb: rewrite an older store in the current format, without the source checkpoint.

Format version 3 stored int4/int3/int2 codes in torch's CPU kernel layout of the machine that converted the
store (`packing`: torch-cpu-avx2, -avx512, -default), so such a store runs only where torch's kernel has
that layout. Version 4 stores them as portable nibbles (quant.py). The codes, scales and zeros are the same
numbers in both: upgrading moves nibbles and changes nothing else, so the upgraded store computes exactly
what the old one computed on its own machine.

Only what changes is written: records of int4-family layers (read, checked against their checksums,
rewritten in place in a new file at the same offsets) and resident files holding int4 weights. Every
other file is hard-linked into the new store (copied where the filesystem cannot link). The new store is
built in a hidden sibling directory and renamed over the old one at the end, as `convert` does, so a
killed upgrade leaves the old store as it was.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from tqdm.auto import tqdm

from ..errors import StoreError
from .convert import _cleanup_stale, _move_into_place
from .quant import PORTABLE_PACKING, QuantFormat, compress_int4_bytes, expand_int4_bytes, legacy_codes, pack_nibbles
from .resident_writer import ResidentFileWriter, resident_order
from .store import DTYPES, FileEntry, Store, checksum, file_checksum


def portable_bytes(stored: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """A version 3 `qweight` (torch's kernel layout `fmt.packing`, int3/int2 compressed from it) -> the
    version 4 `qweight` of the same codes."""
    kernel = stored if fmt.bits == 4 else expand_int4_bytes(stored, fmt.bits)
    nibbles = pack_nibbles(legacy_codes(kernel, fmt.packing))
    return nibbles if fmt.bits == 4 else compress_int4_bytes(nibbles, fmt.bits)


def _link(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def upgrade(path: str | os.PathLike, progress: bool = True) -> bool:
    """Rewrite the store at `path` in the current format; False if nothing in it depends on a machine."""
    store = Store(path)
    manifest = store.manifest
    legacy = [layer for layer in manifest.layers if layer.quantization is not None and not layer.quantization.portable]
    dense = {name: fmt for name, fmt in manifest.dense.items() if not fmt.portable}
    if not legacy and not dense:
        return False  # no weights in a machine's layout: it runs everywhere as it is
    directory = store.directory
    _cleanup_stale(directory)
    tmp = directory.parent / f".{directory.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        total = sum(layer.layout.stride * layer.num_experts for layer in legacy)
        bar = tqdm(total=total, unit="B", unit_scale=True, desc="upgrade", disable=not progress)
        layers, rewrite = [], {id(layer) for layer in legacy}
        for layer in manifest.layers:
            if id(layer) in rewrite:
                layers.append(_upgrade_layer(store, layer, tmp, bar))
            else:
                _link(store.path(layer.file), tmp / layer.file)
                layers.append(layer)
        bar.close()
        files = [_upgrade_resident(store, f, dense, tmp) for f in manifest.resident_files]
        for extra in manifest.extra_files:
            _link(store.path(extra), tmp / extra)
        portable = {
            name: replace(fmt, packing=PORTABLE_PACKING) if name in dense else fmt for name, fmt in manifest.dense.items()
        }
        upgraded = replace(manifest, layers=layers, resident_files=files, dense=portable)
        upgraded.resident_bytes = sum(f.size for f in files)
        upgraded.write(tmp)
        _move_into_place(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def _upgrade_layer(store: Store, layer, tmp: Path, bar):
    fmt = layer.quantization
    spec = {t.name: t for t in layer.layout.tensors}
    names = [name for name in spec if name.endswith(".qweight")]
    sums = []
    (tmp / layer.file).parent.mkdir(parents=True, exist_ok=True)
    with open(store.path(layer.file), "rb") as src, open(tmp / layer.file, "wb") as dst:
        for e, offset in enumerate(layer.offsets):
            src.seek(offset)
            record = np.frombuffer(bytearray(src.read(layer.layout.stride)), dtype=np.uint8)
            if len(record) < layer.layout.stride or checksum(record[: layer.layout.nbytes]) != layer.checksums[e]:
                raise StoreError(
                    f"{store.path(layer.file)}: expert {e} of {layer.module} at offset {offset} does not match its checksum; "
                    "the store is damaged and cannot be upgraded: convert the model again"
                )
            raw = torch.from_numpy(record)
            for name in names:
                t = spec[name]
                view = raw[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
                view.copy_(portable_bytes(view, fmt))
            sums.append(checksum(record[: layer.layout.nbytes]))
            dst.seek(offset)
            dst.write(record.data)
            bar.update(layer.layout.stride)
        dst.truncate(os.path.getsize(store.path(layer.file)))
        dst.flush()
        os.fsync(dst.fileno())
    return replace(layer, checksums=tuple(sums), quantization=replace(fmt, packing=PORTABLE_PACKING))


def _upgrade_resident(store: Store, entry: FileEntry, dense: dict[str, QuantFormat], tmp: Path) -> FileEntry:
    path = store.path(entry.path)
    if file_checksum(path) != entry.checksum:
        raise StoreError(f"{path} does not match its checksum; the store is damaged and cannot be upgraded: convert it again")
    tensors = load_file(path)
    changed = [name for name in tensors if name.endswith(".qweight") and name.removesuffix(".qweight") in dense]
    if not changed:
        _link(path, tmp / entry.path)
        return entry
    for name in changed:
        tensors[name] = portable_bytes(tensors[name], dense[name.removesuffix(".qweight")])
    names = sorted(tensors, key=resident_order)  # as `convert` writes them: the same bytes as a fresh store's
    writer = ResidentFileWriter(
        tmp / entry.path, [(n, tensors[n].dtype, tuple(tensors[n].shape)) for n in names], {"format": "pt"}
    )
    for name in names:
        writer.write(name, tensors[name])
    return FileEntry(entry.path, writer.nbytes, writer.close())

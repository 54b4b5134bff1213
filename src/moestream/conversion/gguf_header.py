"""A GGUF file's header read directly: its metadata and where each tensor's bytes are.

gguf-py's `GGUFReader` builds every metadata value, a vocabulary's 150k strings and its merges included,
one numpy view at a time: about 15 s for a Qwen3 file. The converter needs the scalars, the short arrays
and the tensor table, so this reads the header with `struct` over a memory map and skips each array longer
than LONG_ARRAY, which then stands for its length (the tokenizer is built by transformers, which reads
the vocabulary itself).

The layout (llama.cpp's docs/gguf.md, versions 2 and 3; all little-endian): the magic `GGUF`, the version
(u32), the number of tensors and of metadata entries (u64 each); each entry a key (a string: u64 length,
UTF-8 bytes), a value type (u32) and the value (an array: its element type, u32, a count, u64, then the
elements); then per tensor its name, the number of dimensions (u32), the dimensions (u64 each, fastest
first), its ggml type (u32) and its offset (u64) from the start of the data, which begins at the first
multiple of `general.alignment` (default 32) after the table. Anything that runs past the end of the file
or does not decode raises ValueError.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

LONG_ARRAY = 4096  # arrays longer than this are skipped and stand for their length

_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


class _Cursor:
    def __init__(self, data):
        self.data, self.pos, self.size = data, 0, len(data)

    def scalar(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.data, self.pos)
        except struct.error:
            raise ValueError(f"the header runs past the end of the file at byte {self.pos}") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > self.size - self.pos:
            raise ValueError(f"a string of {n} bytes at byte {self.pos} runs past the end of the file")
        value = bytes(self.data[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return value

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {self.pos}")
        item, count = self.scalar("<I"), self.scalar("<Q")
        if count <= LONG_ARRAY:
            return [self.value(item) for _ in range(count)]
        self.skip(item, count)
        return count

    def skip(self, kind: int, count: int) -> None:
        """Past `count` values of type `kind`."""
        if kind in _SCALARS:
            width = struct.calcsize(_SCALARS[kind])
            if count * width > self.size - self.pos:
                raise ValueError(f"an array of {count} values at byte {self.pos} runs past the end of the file")
            self.pos += count * width
        elif kind == _STRING:
            if count * 8 > self.size - self.pos:  # each string has at least its 8-byte length
                raise ValueError(f"an array of {count} strings at byte {self.pos} runs past the end of the file")
            for _ in range(count):
                n = self.scalar("<Q")
                self.pos += n
            if self.pos > self.size:
                raise ValueError("an array of strings runs past the end of the file")
        else:
            for _ in range(count):
                self.value(kind)


def read_header(path: Path) -> tuple[dict, list[tuple[str, int, tuple[int, ...], int]]]:
    """(metadata, [(tensor name, ggml type, shape in torch order, absolute byte offset)]) of a GGUF file
    whose first four bytes are the magic (the caller checks them)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        cursor = _Cursor(data)
        if bytes(data[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; moestream reads versions 2 and 3")
        tensors, entries = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata = {}
        for _ in range(entries):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        table = []
        for _ in range(tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            table.append((name, cursor.scalar("<I"), tuple(reversed(dims)), cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        if alignment <= 0:
            raise ValueError(f"general.alignment is {alignment}")
        start = -(-cursor.pos // alignment) * alignment
    return metadata, [(name, kind, shape, start + offset) for name, kind, shape, offset in table]

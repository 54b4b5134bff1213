"""A safetensors file written tensor by tensor, each tensor in pieces as it is produced, so that the
converter never holds a big resident tensor whole (a 150k x 2048 embedding is decoded from a GGUF a slice
of rows at a time; a whole DeepSeek-V3 embedding in bf16 is 1.8 GB).

The file is safetensors as its library reads it: 8 bytes of little-endian header length, the JSON header
(each tensor's dtype, shape and byte range, and the metadata) padded with spaces to a multiple of 8 bytes,
then the tensors' bytes in the header's order. The header comes first, so every tensor is declared up
front (`ResidentFileWriter(path, specs)`); `write(name, piece)` appends the next bytes of the tensor being
written; `close()` checks that every declared byte came and returns the file's xxh3-64 checksum (as
`store.file_checksum` computes it), hashed as the bytes were written. The library's own `save_file` needs
every tensor of the file in memory at once.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

import torch
import xxhash
from transformers.core_model_loading import dot_natural_key

from ..errors import SourceError

_DTYPE_NAMES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

Spec = tuple[str, torch.dtype, tuple[int, ...]]  # a tensor's name, dtype and shape


def spec_bytes(spec: Spec) -> int:
    """Bytes of the tensor `spec` declares."""
    _, dtype, shape = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


_QUANTIZED_PART = re.compile(r"^(?P<module>.+)\.(?P<part>qweight|scales|scales_zeros)$")


def resident_order(name: str) -> tuple:
    """The sort key of the order a store's resident tensors are written in, by `convert` and `upgrade`
    alike (so both write the same bytes): the model's parameters in transformers' natural order of names,
    a quantized matrix's parts (quant.py's qweight, then its scales) where its weight would be."""
    m = _QUANTIZED_PART.match(name)
    if m is None:
        return dot_natural_key(name), 0
    return dot_natural_key(m["module"] + ".weight"), 1 + ("qweight", "scales", "scales_zeros").index(m["part"])


class ResidentFileWriter:
    """One safetensors file whose tensors `specs` are written in that order, each in one or more pieces."""

    def __init__(self, path: Path, specs: list[Spec], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self._specs = list(specs)
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        self._sizes = []
        for name, dtype, shape in self._specs:
            size = spec_bytes((name, dtype, shape))
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            self._sizes.append(size)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the library's own files do
        self.nbytes = 8 + len(text) + offset
        self._data_bytes, self._total = offset, 0
        self._hash = xxhash.xxh3_64()
        self._file = open(self.path, "wb")
        self._index, self._written = 0, 0  # the tensor being written, and its bytes so far
        self._put(struct.pack("<Q", len(text)) + text)

    def write(self, name: str, piece: torch.Tensor) -> None:
        """Append `piece`, the next bytes (in row-major order) of tensor `name`, which must be the tensor
        being written or, once that one is complete, the next one declared."""
        while (
            self._index < len(self._specs) and self._written == self._sizes[self._index] and name != self._specs[self._index][0]
        ):
            self._index, self._written = self._index + 1, 0  # (past empty tensors too)
        if self._index >= len(self._specs) or name != self._specs[self._index][0]:
            expected = self._specs[self._index][0] if self._index < len(self._specs) else "nothing more"
            raise SourceError(f"{self.path.name}: {name} written where {expected} comes")
        dtype = self._specs[self._index][1]
        if piece.dtype != dtype:
            raise SourceError(f"{self.path.name}: {name} is {dtype}, a piece of it came as {piece.dtype}")
        data = piece.contiguous().view(-1).view(torch.uint8).numpy()
        if self._written + data.nbytes > self._sizes[self._index]:
            raise SourceError(f"{self.path.name}: {name} has {self._sizes[self._index]} bytes, more came")
        self._put(data)
        self._written += data.nbytes
        self._total += data.nbytes

    def close(self) -> str:
        """Finish the file (every declared byte written, synced to disk); its xxh3-64 checksum. Pieces
        come in order and never overrun their tensor, so all the bytes means every tensor whole."""
        complete = self._total == self._data_bytes
        self._file.flush()
        if complete:
            os.fsync(self._file.fileno())
        self._file.close()
        if not complete:
            raise SourceError(f"{self.path.name}: closed with {self._total} of its {self._data_bytes} tensor bytes written")
        return self._hash.hexdigest()

    def abandon(self) -> None:
        """Close the file unfinished: the store it belongs to is being removed."""
        self._file.close()

    def _put(self, data) -> None:
        self._hash.update(data)
        self._file.write(data)

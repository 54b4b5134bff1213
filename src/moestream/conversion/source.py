"""Read a Hugging Face checkpoint directory one tensor at a time, with bounded memory.

The safetensors header (8-byte length + JSON) is parsed here so that each tensor, or one expert's slice
of a fused 3D tensor, is fetched with a single `pread` into a fresh buffer. Going through an mmap of a
100 GB shard would count every touched page against the converter's RSS and leave the page cache full
of bytes that are read once; `posix_fadvise(DONTNEED)` after each read keeps it clean.

Quantized source formats are decoded to float here, so the rest of the converter only sees floats:
- FP8 e4m3 with 128x128 block scales (`X.weight` + `X.weight_scale_inv`, DeepSeek-V3 / Kimi);
- MXFP4 (`X_blocks` + `X_scales`, gpt-oss).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import SourceError

_ST_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class RawTensor:
    """Where one stored tensor lives in a shard."""

    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class OpenFiles:
    """A source's files, each opened once for `pread`, from any thread (the converter builds records on
    several)."""

    def __init__(self):
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def read_safetensors_header(path: Path) -> dict[str, RawTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SourceError(f"{path} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise SourceError(f"{path} has a corrupt safetensors header (length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SourceError(f"{path} has a corrupt safetensors header: {e}") from None
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise SourceError(f"{path}: tensor {key!r} has an unsupported dtype or a malformed entry: {info}") from None
        start = 8 + n + begin
        t = RawTensor(path, dtype, shape, start, end - begin)
        if end < begin or start + t.nbytes > size or t.nbytes != t.numel * dtype.itemsize:
            raise SourceError(f"{path}: tensor {key!r} lies outside the file or has the wrong size; the file is truncated")
        tensors[key] = t
    return tensors


def _pread_exact(fd: int, nbytes: int, offset: int) -> bytearray:
    buf = bytearray(nbytes)
    view = memoryview(buf)
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise SourceError(f"unexpected end of file at offset {offset + done}")
        done += n
    return buf


class CheckpointReader:
    """Random access to the tensors of a sharded safetensors checkpoint, one at a time."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        files = sorted(self.directory.glob("*.safetensors"))
        index = self.directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files = sorted({self.directory / name for name in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise SourceError(f"{index} lists shards that are missing: {', '.join(missing[:5])}")
        if not files:
            raise SourceError(
                f"{self.directory} has no *.safetensors files. moestream converts safetensors checkpoints; "
                "convert .bin/.pt checkpoints with transformers' save_pretrained first."
            )
        self.tensors: dict[str, RawTensor] = {}
        for f in files:
            self.tensors.update(read_safetensors_header(f))
        self._files = OpenFiles()

    def close(self) -> None:
        self._files.close()

    def _fd(self, path: Path) -> int:
        return self._files.fd(path)

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        """The stored tensor `key`, or only its slice `[index]` along dim 0 (one expert of a fused tensor)."""
        raw = self.tensors[key]
        shape, start, nbytes = raw.shape, raw.start, raw.nbytes
        if index is not None:
            per = nbytes // shape[0]
            shape, start, nbytes = shape[1:], start + index * per, per
        fd = self._fd(raw.file)
        buf = _pread_exact(fd, nbytes, start)
        # The bytes were read once; do not let them crowd the page cache (the source can be 100s of GB).
        os.posix_fadvise(fd, start, nbytes, os.POSIX_FADV_DONTNEED)
        if raw.dtype == torch.bool:
            return torch.from_numpy(np.frombuffer(buf, dtype=np.bool_).copy()).reshape(shape)
        return (
            torch.frombuffer(buf, dtype=torch.uint8).view(raw.dtype).reshape(shape)
            if nbytes
            else torch.empty(shape, dtype=raw.dtype)
        )


# ---------------------------------------------------------------------------------------------------------
# Quantized source formats, decoded to float


FP8_BLOCK = 128


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 e4m3 weight [.., out, in] with one scale per 128x128 block [.., ceil(out/128), ceil(in/128)] -> float32."""
    out_dim, in_dim = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return weight.float() * scale[..., :out_dim, :in_dim]


# The 16 values of an FP4 e2m1 nibble (sign bit, 2 exponent bits, 1 mantissa bit).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (OCP microscaling): blocks [.., rows, G, 16] uint8 (two e2m1 nibbles per byte, low nibble first),
    scales [.., rows, G] uint8 (e8m0 exponent, bias 127) -> float32 [.., rows, G*32]."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    low = lut[(blocks & 0x0F).long()]
    high = lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [.., rows, G, 32]
    exponent = scales.to(torch.int32) - 127
    values = torch.ldexp(values, exponent.unsqueeze(-1).float())
    return values.flatten(-2)


class DecodedCheckpoint:
    """The checkpoint as logical float tensors: quantized pairs appear under the name the model expects."""

    def __init__(self, directory: Path):
        self.reader = CheckpointReader(directory)
        raw = self.reader.tensors
        self.kinds: dict[str, tuple[str, ...]] = {}
        for key in raw:
            if key.endswith("_scale_inv") or key.endswith("_scales"):
                continue
            if key.endswith("_blocks"):
                base = key[: -len("_blocks")]
                if base + "_scales" not in raw:
                    raise SourceError(f"MXFP4 tensor {key} has no {base}_scales beside it")
                self.kinds[base] = ("mxfp4", key, base + "_scales")
            elif raw[key].dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                scale = key + "_scale_inv"
                if scale not in raw:
                    raise SourceError(f"FP8 tensor {key} has no {scale} beside it (only block-scaled FP8 is supported)")
                self.kinds[key] = ("fp8", key, scale)
            else:
                self.kinds[key] = ("plain", key)

    def keys(self) -> list[str]:
        return list(self.kinds)

    def dtype(self, key: str) -> torch.dtype:
        """The dtype to store this tensor in by default (quantized formats: bfloat16, the models' own dtype)."""
        kind = self.kinds[key]
        return torch.bfloat16 if kind[0] != "plain" else self.reader.tensors[kind[1]].dtype

    def read(self, key: str, index: int | None = None) -> torch.Tensor:
        kind = self.kinds[key]
        if kind[0] == "plain":
            return self.reader.read(key, index)
        if kind[0] == "fp8":
            w = dequantize_fp8_blocks(self.reader.read(kind[1], index), self.reader.read(kind[2], index))
        else:
            w = dequantize_mxfp4(self.reader.read(kind[1], index), self.reader.read(kind[2], index))
            # gpt-oss stores blocks as [experts, out, in/32, 16]; its modules hold [experts, in, out].
            w = w.transpose(-1, -2).contiguous()
        return w  # float32; the converter casts to the store's dtype

    def close(self) -> None:
        self.reader.close()

"""The store's portable int4 codes -> the layout torch's CPU int4 kernel reads on this machine.

A store keeps int4 (and int3/int2) codes as plain nibbles in row order (conversion/quant.py), the same on
every machine. torch's CPU int4 kernel (`_weight_int4pack_mm_for_cpu`) reads a layout of its own, which
differs between its CPU builds (AVX512, AVX2, the portable build) and may change with torch. So on the CPU
each record is repacked where it lands: on the I/O thread that read it, after its checksum, in the slot it
was read into (`RecordPreparer`); resident weights once at load (`kernel_layout`). On a GPU nothing is
repacked: its kernels read the portable layout (kernels.py).

How the layout is known: not from a table of torch versions, but from torch itself. Packing matrices of
known codes with torch's own packing function shows, for each byte of the kernel layout, which two rows'
codes it pairs and where input k's byte lies: N/2 "columns" (`Columns`), which the C++ kernel
`repack_int4` (core/fused_kernels.cpp) fills sixteen at a time. The description is checked once per shape
against torch's packing of random codes; where it does not hold, or without the compiled kernels, torch's
own packing function runs instead (the same bytes, several times slower).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from ..conversion.quant import QuantFormat, compress_int4_bytes, expand_int4_bytes, pack_nibbles, unpack_nibbles


def torch_packing(codes: torch.Tensor) -> torch.Tensor:
    """torch's own packing of codes [N, K] into its CPU kernel's layout [N, K/2]: the reference."""
    return torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def kernel_nibble_index(n: int, k: int) -> torch.Tensor:
    """Where torch's packing puts weight i of an [N, K] matrix (row-major): its nibble's index among the
    kernel bytes' nibbles (low, then high, of each byte). Found by packing the weights' own indices, four
    bits per pass: the packing moves each code to another nibble and changes nothing else."""
    index = torch.arange(n * k, dtype=torch.int64)
    holder = torch.zeros(n * k, dtype=torch.int64)  # nibble position -> the weight it holds
    shift = 0
    while (1 << shift) < n * k:
        packed = torch_packing(((index >> shift) & 15).view(n, k)).reshape(-1).to(torch.int64)
        holder |= torch.stack([packed & 15, packed >> 4], dim=-1).reshape(-1) << shift
        shift += 4
    return torch.argsort(holder)


@dataclass(frozen=True)
class Columns:
    """torch's kernel layout of an [N, K] matrix as N/2 columns: column c's byte for input k is
    `lo[c]`'s code (low nibble) and `hi[c]`'s (high), at byte `offset[c] + k * stride[c]`."""

    lo: torch.Tensor
    hi: torch.Tensor
    offset: torch.Tensor
    stride: torch.Tensor


def _probe(n: int, k: int) -> tuple[torch.Tensor, ...] | None:
    """(lo, hi, offset, stride) of an [N, k] matrix from torch's packing, or None where input k's byte is
    not a fixed step from input k - 1's."""
    index = kernel_nibble_index(n, k).view(n, k)
    first = index[:, 0]
    step = index[:, 1] - first  # nibbles from input 0 to input 1 of the same row
    if not bool((index == first[:, None] + step[:, None] * torch.arange(k)).all()) or bool((step % 2).any()):
        return None
    byte, high = first // 2, first % 2
    order = torch.argsort(byte * 2 + high)  # each byte's low row, then its high row
    lo, hi = order[0::2], order[1::2]
    if not (torch.equal(byte[lo], byte[hi]) and bool((high[lo] == 0).all()) and torch.equal(step[lo], step[hi])):
        return None
    return lo.contiguous(), hi.contiguous(), byte[lo], step[lo] // 2


@functools.lru_cache(maxsize=64)
def columns(n: int, k: int) -> Columns | None:
    """The column description of torch's layout for [N, K], checked against torch's packing of random codes;
    None where it does not describe it. Byte offsets grow linearly with K (a block of rows starts after
    the earlier blocks' K codes per row), so two narrow probes give them for any K."""
    small, large = _probe(n, 32), _probe(n, 64)
    if small is None or large is None or not all(torch.equal(a, b) for a, b in zip(small[:2] + small[3:], large[:2] + large[3:])):
        return None
    per_input = (large[2] - small[2]) // 32  # offset = base + per_input * K
    described = Columns(small[0], small[1], small[2] + per_input * (k - 32), small[3])
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n * 131 + k), dtype=torch.uint8)
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    if not _run(pack_nibbles(codes), out, described) or not torch.equal(out, torch_packing(codes)):
        return None
    return described


def _run(src: torch.Tensor, dst: torch.Tensor, described: Columns) -> bool:
    """The C++ repack of src into dst; False without the compiled kernels."""
    from . import fused  # the compiled kernels; imported here so that quant-only users never build them

    ext = fused.extension()
    if ext is None:
        return False
    ext.repack_int4(src, dst, described.lo, described.hi, described.offset, described.stride)
    return True


def kernel_layout(nibbles: torch.Tensor) -> torch.Tensor:
    """Portable int4 bytes [N, K/2] -> torch's kernel bytes [N, K/2] (a new tensor)."""
    n, k = nibbles.shape[0], nibbles.shape[1] * 2
    out = torch.empty_like(nibbles)
    described = columns(n, k)
    if described is not None and _run(nibbles.contiguous(), out, described):
        return out
    return torch_packing(unpack_nibbles(nibbles))


class RecordPreparer:
    """Turns the int4/int3/int2 matrices of a record just read into the kernel's layout, in place; called
    on the I/O thread (`reader.RecordReader.submit(after=...)`). One scratch buffer per thread, reused."""

    def __init__(self, fmt: QuantFormat, names: list[str]):
        self.fmt, self.names = fmt, names
        self._scratch = threading.local()

    @torch.inference_mode()  # the slot's views may be inference tensors (made under generate's inference mode)
    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.names:
            stored = tensors[name]
            if self.fmt.bits == 4:
                stored.copy_(self._repack(stored))
            else:  # int3/int2: compressed from the int4 bytes, so expand, repack, compress again
                stored.copy_(compress_int4_bytes(self._repack(expand_int4_bytes(stored, self.fmt.bits)), self.fmt.bits))

    def _repack(self, nibbles: torch.Tensor) -> torch.Tensor:
        n, k = nibbles.shape[0], nibbles.shape[1] * 2
        described = columns(n, k)
        if described is None:
            return torch_packing(unpack_nibbles(nibbles))
        scratch = getattr(self._scratch, "buffer", None)
        if scratch is None or scratch.numel() < nibbles.numel():
            scratch = self._scratch.buffer = torch.empty(nibbles.numel(), dtype=torch.uint8)
        out = scratch[: nibbles.numel()].view(nibbles.shape)
        if not _run(nibbles, out, described):
            return torch_packing(unpack_nibbles(nibbles))
        return out

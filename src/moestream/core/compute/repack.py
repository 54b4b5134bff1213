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
`repack_int4` (native/fused_kernels.cpp) fills sixteen at a time. The description is checked once per shape
against torch's packing of random codes; where it does not hold, or without the compiled kernels, torch's
own packing function runs instead (the same bytes, several times slower).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ...conversion.quant import QuantFormat, compress_int4_bytes, expand_int4_bytes, pack_nibbles, unpack_nibbles


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
        packed = torch_packing(((index >> shift) & 15).view(n, k))
        holder |= unpack_nibbles(packed).reshape(-1).to(torch.int64) << shift
        shift += 4
    return torch.argsort(holder)


@dataclass(frozen=True)
class Columns:
    """torch's kernel layout of an [N, K] matrix as N/2 columns: column c's byte for input k is
    `lo[c]`'s code (low nibble) and `hi[c]`'s (high), at byte `offset[c] + k * stride[c]`. `blocks` [B, 4]:
    (first column, end column, first byte, end byte) of each block of rows, whose columns read and write
    only that block's bytes, so the repack runs block by block in place."""

    lo: torch.Tensor
    hi: torch.Tensor
    offset: torch.Tensor
    stride: torch.Tensor
    blocks: torch.Tensor


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


def _blocks(lo: list[int], hi: list[int], offset: list[int], stride: list[int], k: int) -> torch.Tensor | None:
    """Cut the columns (in offset order) into the fewest runs that each read and write only the bytes of
    the rows they pair, or None where the rows are not in runs."""
    blocks, start, rows, low, top = [], 0, set(), None, -1
    half = k // 2
    for c in range(len(lo)):
        rows.update((lo[c], hi[c]))
        low = min(rows) if low is None else min(low, lo[c], hi[c])
        top = max(top, offset[c] + (k - 1) * stride[c])
        if (
            len(rows) == 2 * (c + 1 - start)
            and max(rows) - low + 1 == len(rows)
            and low * half <= offset[c]
            and top < (max(rows) + 1) * half
        ):
            if min(offset[start : c + 1]) >= low * half:
                blocks.append((start, c + 1, low * half, (max(rows) + 1) * half))
                start, rows, low, top = c + 1, set(), None, -1
    return torch.tensor(blocks, dtype=torch.int64).reshape(-1, 4) if start == len(lo) else None


@functools.lru_cache(maxsize=64)
def columns(n: int, k: int) -> Columns | None:
    """The column description of torch's layout for [N, K], checked against torch's packing of random codes;
    None where it does not describe it. Byte offsets grow linearly with K (a block of rows starts after
    the earlier blocks' K codes per row), so two narrow probes give them for any K."""
    small, large = _probe(n, 32), _probe(n, 64)
    if small is None or large is None or not all(torch.equal(a, b) for a, b in zip(small[:2] + small[3:], large[:2] + large[3:])):
        return None
    lo, hi, _, stride = small
    offset = small[2] + (large[2] - small[2]) // 32 * (k - 32)  # offset = base + per_input * K
    blocks = _blocks(lo.tolist(), hi.tolist(), offset.tolist(), stride.tolist(), k)
    if blocks is None:
        return None
    described = Columns(lo, hi, offset, stride, blocks)
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n * 131 + k), dtype=torch.uint8)
    got = pack_nibbles(codes)
    if not _run(got, described) or not torch.equal(got, torch_packing(codes)):
        return None
    return described


def _run(nibbles: torch.Tensor, described: Columns) -> bool:
    """The C++ repack of portable bytes into the kernel layout, in place; False without the compiled kernels."""
    from ...native import fused_build  # the compiled kernels; imported here so that quant-only users never build them

    ext = fused_build.extension()
    if ext is None:
        return False
    ext.repack_int4(nibbles, described.lo, described.hi, described.offset, described.stride, described.blocks)
    return True


def in_cpp(n: int, k: int) -> bool:
    """Whether an [N, K] matrix is repacked by the C++ kernel here (else by torch's packing function)."""
    from ...native import fused_build

    return fused_build.extension() is not None and columns(n, k) is not None


def repack_in_place(nibbles: torch.Tensor) -> None:
    """Portable int4 bytes [N, K/2] (contiguous) -> torch's kernel bytes, in place."""
    n, k = nibbles.shape[0], nibbles.shape[1] * 2
    described = columns(n, k)
    if described is None or not _run(nibbles, described):
        nibbles.copy_(torch_packing(unpack_nibbles(nibbles)))  # torch's own packing: slower, the same bytes


def kernel_layout(nibbles: torch.Tensor) -> torch.Tensor:
    """Portable int4 bytes [N, K/2] -> torch's kernel bytes [N, K/2] (a new tensor)."""
    out = nibbles.clone()
    repack_in_place(out)
    return out


class RecordPreparer:
    """Turns the int4/int3/int2 matrices of a record just read into the kernel's layout, in place; called
    on the I/O thread (`reader.RecordReader.submit(after=...)`)."""

    def __init__(self, fmt: QuantFormat, names: list[str]):
        self.fmt, self.names = fmt, names

    @torch.inference_mode()  # the slot's views may be inference tensors (made under generate's inference mode)
    def __call__(self, tensors: dict[str, torch.Tensor]) -> None:
        for name in self.names:
            stored = tensors[name]
            if self.fmt.bits == 4:
                repack_in_place(stored)
            else:  # int3/int2: compressed from the int4 bytes, so expand, repack, compress again
                expanded = expand_int4_bytes(stored, self.fmt.bits)
                repack_in_place(expanded)
                stored.copy_(compress_int4_bytes(expanded, self.fmt.bits))

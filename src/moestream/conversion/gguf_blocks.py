"""llama.cpp's 4-bit blocks of 32 weights read as int4 codes with a scale and a zero per 32 weights: what
an int4 group-32 record holds (quant.py: W = (code - 8) * s + z), taken from the blocks' bytes without
decoding them to floats.

Each of these types stores, per 32 weights of a row, 4-bit codes q and an affine map:
- Q4_0 (18 bytes: fp16 d, 16 bytes of codes): w = d (q - 8), so s = d and z = 0;
- Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of codes): w = d q + m, so s = d and z = m + 8 d;
- Q4_K (144 bytes per 256 weights: fp16 d and dmin, eight 6-bit scales sc and mins mn packed in 12 bytes,
  128 bytes of codes): sub-block j of 32 has w = d sc_j q - dmin mn_j, so s = d sc_j, z = 8 d sc_j - dmin mn_j.
In a Q4_0/Q4_1 block, byte i holds weight i in its low nibble and weight i + 16 in its high one; in Q4_K,
each 32 bytes hold two sub-blocks, the first in the low nibbles. s and z are computed in float32 (exact
for Q4_0 and Q4_K's s; one rounding for the zeros), and a store keeps them in bfloat16, its one loss
against the file (docs/BENCHMARKS.md, "GGUF files as a convert source").

MXFP4, IQ4_NL and IQ4_XS blocks hold 4-bit indices into a table of 16 values with a scale per 32 weights
(w = T[q] * s), the same pairing of nibbles as Q4_0: `table_nibbles` reads them as a table format's codes
and scales (quant.py's mxfp4 and iq4nl):
- MXFP4 (17 bytes: an e8m0 exponent e, 16 bytes of codes): T = e2m1 values doubled, s = 2^(e - 128);
- IQ4_NL (18 bytes: fp16 d, 16 bytes of codes): s = d;
- IQ4_XS (136 bytes per 256 weights: fp16 d, the high 2 bits of eight 6-bit scales in a uint16, their low 4
  bits in 4 bytes, 128 bytes of codes): sub-block j has s = d (ls_j - 32).

Other block types have no int4 group-32 counterpart (5, 6 and 8-bit codes; Q2_K and Q3_K scale groups of 16)
and are decoded to floats and quantized as any float weight is: by gguf-py's `dequantize`, except Q6_K
(`q6_k_decoded`: the same values 2.5x faster), the LM head of nearly every K-quant file, whose decoding
was a fifth of a 150k-token file's import.
"""

from __future__ import annotations

import numpy as np
import torch

from ..native import fused_build

# ggml type numbers (gguf.GGMLQuantizationType) -> bytes per block of that type.
Q4_0, Q4_1, Q4_K = 2, 3, 12
_BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q4_K: 144}
_BLOCK_WEIGHTS = {Q4_0: 32, Q4_1: 32, Q4_K: 256}
GROUP = 32  # weights per scale and zero, in every type here


def has_codes(ggml_type: int) -> bool:
    """Whether blocks of this type are int4 codes with a scale and zero per 32 weights."""
    return ggml_type in _BLOCK_BYTES


def four_bit_nibbles(raw: np.ndarray, ggml_type: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles [rows, cols/2] uint8 in the store's portable int4 layout, s [rows, cols/32] float32,
    z [rows, cols/32] float32) of `raw`, the bytes of `rows` rows of blocks of `ggml_type` ([rows,
    cols / block weights * block bytes] uint8), such that each weight is (code - 8) * s + z. The codes are
    re-paired from the blocks' nibbles straight into the layout's (byte j: weights 2j and 2j+1), never
    one byte per code: half the memory traffic of unpacking and packing again."""
    per_block = _BLOCK_BYTES[ggml_type]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // _BLOCK_WEIGHTS[ggml_type], per_block)
    words = blocks.view("<u2")  # every block type here has an even size
    if ggml_type == Q4_K:
        s, z = _q4_k_scales(blocks, words)
        nibbles = _runs(blocks, 16, 4, 32)  # each 32 bytes: two sub-blocks
    else:
        d = _half(words[..., 0])
        s = d
        z = np.zeros_like(d) if ggml_type == Q4_0 else _half(words[..., 1]) + 8 * d
        nibbles = _runs(blocks, 2 if ggml_type == Q4_0 else 4, 1, 16)
    return (
        torch.from_numpy(nibbles.reshape(rows, cols // 2)),
        torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32).reshape(rows, cols // GROUP)),
        torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32).reshape(rows, cols // GROUP)),
    )


def _pair_table() -> np.ndarray:
    """For every byte pair (a, b) read as the little-endian uint16 a | b << 8: the two portable bytes it
    becomes in `_repaired`, (a & 15) | (b & 15) << 4 in the low byte and a >> 4 | (b >> 4) << 4 in the high.
    Words and table are little-endian ("<u2") on any host, so the bytes come out in that order."""
    w = np.arange(1 << 16, dtype=np.uint32)
    low = (w & 0x0F) | ((w >> 4) & 0xF0)
    high = ((w >> 4) & 0x0F) | ((w >> 8) & 0xF0)
    return (low | (high << 8)).astype("<u2")


_PAIRS = _pair_table()  # 128 KiB: one lookup per byte pair, which numpy's strided byte arithmetic is 1.8x slower than
_compiled = None  # the compiled kernels' block readers once `use_compiled_kernels` asked for them


def use_compiled_kernels(build: bool) -> None:
    """Call the compiled kernels' `repair_nibbles`, `q6_k_int8` and `q6_k_int4` (native/fused_kernels.cpp)
    wherever they give their result rather than None: the same bytes, less CPU time (a fifth of a Q4_0
    import's for the first, 5 s of a 150k-token LM head's for the second; docs/BENCHMARKS.md). Built
    already: from now on. Not built: with `build`, from when a build started now in the background ends;
    without, never (the convert command decides by the file's size)."""
    global _compiled
    if fused_build.load_if_built() is None:
        if not build:
            return
        fused_build.start()
    _compiled = fused_build.WhenBuilt()


def has_compiled_kernels() -> bool:
    """Whether the compiled kernels are in use (they may still answer None, while being built)."""
    return _compiled is not None


def _runs(blocks: np.ndarray, offset: int, units: int, unit_bytes: int) -> np.ndarray:
    """Blocks [..., B] with `units` runs of `unit_bytes` bytes of codes from byte `offset` (as `_repaired`
    takes them) -> those runs re-paired into the portable order, [..., units * unit_bytes]."""
    if _compiled is not None:
        flat = torch.from_numpy(np.ascontiguousarray(blocks).reshape(-1, blocks.shape[-1]))
        repaired = _compiled.repair_nibbles(flat, offset, units, unit_bytes)
        if repaired is not None:
            return repaired.numpy().reshape(*blocks.shape[:-1], units * unit_bytes)
    codes = blocks[..., offset : offset + units * unit_bytes]
    if offset % 2:  # MXFP4's codes start at an odd byte: copied, so that they can be read as words
        codes = np.ascontiguousarray(codes)
    words = codes.view("<u2").reshape(*blocks.shape[:-1], units, unit_bytes // 2)
    return _repaired(words).reshape(*blocks.shape[:-1], units * unit_bytes)


def _repaired(words: np.ndarray) -> np.ndarray:
    """Units of 2m bytes, as m little-endian uint16 words [..., m], holding 4m weights, the first 2m in the
    low nibbles and the next 2m in the high ones (a Q4_0/Q4_1 block's 16 bytes; two Q4_K sub-blocks in
    32) -> the same weights in the portable order, 2m bytes [..., 2m]: byte j holds weights 2j (low
    nibble) and 2j + 1 (high). Byte j < m comes from the low nibbles of bytes 2j and 2j + 1 (word j),
    byte m + j from their high nibbles. Read as words, the blocks' bytes need no copy first."""
    m = words.shape[-1]
    pairs = _PAIRS[words].view(np.uint8).reshape(*words.shape, 2)
    out = np.empty((*words.shape[:-1], 2, m), dtype=np.uint8)
    out[..., 0, :] = pairs[..., 0]
    out[..., 1, :] = pairs[..., 1]
    return out.reshape(*words.shape[:-1], 2 * m)


def _half(word: np.ndarray) -> np.ndarray:
    """Little-endian fp16 read as uint16 words [...] -> [...] float32 (a strided view of the blocks' words:
    4x faster than copying their two bytes out first)."""
    return word.view("<f2").astype(np.float32)


def _q4_k_scales(blocks: np.ndarray, words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, n, 144] (and the same as uint16 words) -> s and z [rows, n, 8], one per
    sub-block of 32."""
    d, dmin = _half(words[..., 0])[..., None], _half(words[..., 1])[..., None]
    packed = blocks[..., 4:16]
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    # Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: a nibble of bytes 8-11
    # each, with the top two bits of bytes 0-3 (scales) and 4-7 (mins) above it.
    sc = np.concatenate([low & 63, (mixed & 15) | ((low >> 6) << 4)], axis=-1).astype(np.float32)
    mn = np.concatenate([high & 63, (mixed >> 4) | ((high >> 6) << 4)], axis=-1).astype(np.float32)
    s = d * sc
    return s, 8 * s - dmin * mn


# ggml type numbers of the table blocks -> (the table format holding them, bytes per block, weights per block)
MXFP4, IQ4_NL, IQ4_XS = 39, 20, 23
_TABLE_BLOCKS = {MXFP4: ("mxfp4", 17, 32), IQ4_NL: ("iq4nl", 18, 32), IQ4_XS: ("iq4nl", 136, 256)}


def table_of(ggml_type: int) -> str | None:
    """The table format (quant.TABLES) whose codes blocks of this type hold, or None."""
    entry = _TABLE_BLOCKS.get(ggml_type)
    return entry[0] if entry else None


def table_nibbles(raw: np.ndarray, ggml_type: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(nibbles [rows, cols/2] uint8 in the store's portable layout, s [rows, cols/32] float32) of `raw`,
    `rows` rows of MXFP4, IQ4_NL or IQ4_XS blocks, such that each weight is T[code] * s with T the table of
    `table_of(ggml_type)`; s is exact in float32 (a power of two, an fp16, an fp16 times a small integer)."""
    _, per_block, weights = _TABLE_BLOCKS[ggml_type]
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // weights, per_block)
    if ggml_type == IQ4_XS:
        words = blocks.view("<u2")
        low = blocks[..., 4:8, None] >> np.array([0, 4], dtype=np.uint8)  # [rows, n, 4, 2]: sub-blocks 2i, 2i+1
        high = words[..., 1, None] >> (2 * np.arange(8, dtype=np.uint16))
        ls = (low.reshape(*blocks.shape[:-1], 8) & 15) | ((high & 3) << 4).astype(np.uint8)
        s = _half(words[..., 0])[..., None] * (ls.astype(np.float32) - 32)
        nibbles = _runs(blocks, 8, 8, 16)  # eight sub-blocks of 32, each as Q4_0's 16 bytes
    else:
        if ggml_type == MXFP4:  # 2^(e - 128): e in the float32 exponent field, 2^-127 and 2^-128 as subnormals
            e = blocks[..., 0].astype(np.int32)
            s = np.ldexp(np.float32(1), e - 128).astype(np.float32)
        else:
            s = _half(blocks[..., :2].copy().view("<u2")[..., 0])
        nibbles = _runs(blocks, per_block - 16, 1, 16)  # 16 bytes of codes: a block of 32, as Q4_0's
    return torch.from_numpy(nibbles.reshape(rows, cols // 2)), torch.from_numpy(
        np.ascontiguousarray(s, dtype=np.float32).reshape(rows, cols // GROUP)
    )


# Q6_K's 210-byte super-block of 256 weights: ql (128 bytes: the low 4 bits), qh (64: the high 2), 16 int8
# scales (one per 16 weights), fp16 d; w = d * scale * (q - 32).
Q6_K, _Q6_K_BYTES = 14, 210
_LOW_SHIFTS = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
_HIGH_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)


def q6_k_decoded(raw: np.ndarray) -> torch.Tensor:
    """Q6_K blocks [..., n * 210] uint8 -> their weights [blocks, 256] float32, the values gguf-py's
    dequantize gives (the same operations in torch, which runs them 2.5x faster). Within each half of 128
    weights, weight 32 s + j has its low 4 bits in nibble s // 2 of ql byte 64 h + 32 (s % 2) + j and its high
    two at bit 2 s of qh byte 32 h + j (llama.cpp's dequantize_row_q6_K)."""
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(-1, _Q6_K_BYTES)
    n = blocks.shape[0]
    low = ((blocks[:, :128].reshape(n, 2, 1, 64) >> _LOW_SHIFTS) & 15).reshape(n, 8, 32)
    high = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> _HIGH_SHIFTS) & 3).reshape(n, 8, 32)
    codes = (low | (high << 4)).reshape(n, 16, 16)
    d = blocks[:, 208:210].contiguous().view(torch.float16).float()  # [n, 1]
    scales = (d * blocks[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    return codes.float().sub_(32).mul_(scales).reshape(n, 256)


def q6_k_int8(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rows of Q6_K blocks [rows, cols / 256 * 210] uint8 -> (int8 codes [rows, cols], float32 scales
    [rows]): exactly quant.quantize's int8 of `q6_k_decoded`'s weights, in one compiled pass; None where
    the compiled kernels are not at hand (the caller decodes and quantizes in torch)."""
    if _compiled is None:
        return None
    got = _compiled.q6_k_int8(torch.from_numpy(np.ascontiguousarray(raw)), cols)
    return None if got is None else (got[0], got[1])


def q6_k_int4(raw: np.ndarray, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Rows of Q6_K blocks [rows, cols / 256 * 210] uint8 -> what `four_bit_nibbles` gives of 4-bit blocks
    (portable int4 bytes [rows, cols/2], s and z [rows, cols/32] float32: bf16 values), exactly quant.quantize's
    int4 group-32 of `q6_k_decoded`'s weights, in one compiled pass (Q4_K_M's Q6_K down projections in an int4
    layer); None where the compiled kernels are not at hand (the caller decodes and quantizes in torch)."""
    if _compiled is None:
        return None
    got = _compiled.q6_k_int4(torch.from_numpy(np.ascontiguousarray(raw)), cols)
    return None if got is None else (got[0], got[1].float(), got[2].float())

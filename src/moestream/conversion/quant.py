"""Low-bit weight formats (experts, and resident linears with --dense-dtype): how a weight matrix is
quantized, packed into a record, and what it means.

Every format works on one weight matrix W [N, K] (out features, in features) and produces the record
tensors a kernel consumes directly (kernels.py), so a record goes from disk to the matmul unchanged:

- int8: symmetric per output channel. `qweight` int8 [N, K], `scales` float32 [N]; W = q * s.
- int4: affine per group of G inputs: `qweight` uint8 [N, K/2], `scales_zeros` bfloat16 [K/G, N, 2];
  W = (q - 8) * s + z with q in 0..15. `qweight` holds plain nibbles in row order (byte j of row n: the
  codes of inputs 2j, low nibble, and 2j+1, high), a layout of the format's own that depends on no CPU,
  torch version or device (`PORTABLE_PACKING`). The running machine's kernels get their own layout from
  it (core/compute/repack.py); stores of format version 3 held torch's CPU kernel layout for the converting CPU
  (`LEGACY_PACKINGS`), and `legacy_nibble_index` says where each code sits in those.
- mxfp4, iq4nl (table formats): the int4 layout (`qweight` nibbles, `scales_zeros` bf16 [K/32, N, 2],
  groups of 32), but code q stands for TABLES[name][q], an int8 value: W = T[q] * s + z. MXFP4's e2m1 values
  doubled with s = 2^(e - 128) (llama.cpp's kvalues_mxfp4), IQ4_NL's 16 levels with its block scale: a GGUF's
  MXFP4, IQ4_NL and IQ4_XS blocks are kept exactly (z = 0), up to IQ4's scales rounded to bf16. Their int8
  values run through the same int8-activation kernels as int8 weights (a table lookup per 32 codes).
- int6: the int4 formula with codes 0..63 (W = (q - 8) * s + z, z = m + 8 s as for int3/int2), for what a
  GGUF's Q6_K holds (its LM heads and down projections) at about its size: `qweight` uint8 [N, 3K/4], each
  row the portable nibbles of its codes' low 4 bits (K/2 bytes, as int4), then a plane of their top 2 bits:
  per 64 inputs 16 bytes, byte u holding the tops of nibble byte u's two codes in bits 0-3 and those of
  nibble byte u + 16's in bits 4-7 (`pack_six`). The int8-activation kernels read both parts as they are
  (native/lowbit_dot.h); elsewhere (float activations, a GPU) each matrix is dequantized for each call. K must
  be a multiple of 64.
- int3, int2: the int4 format restricted to codes 0..2^b-1 (so W = (q - 8) * s + z = q * s + m with
  z = m + 8 s), with the int4 bytes compressed densely: int2 keeps the 2 used bits of every nibble (two
  int4 bytes in one), int3 the 3 used bits (four int4 bytes in three). Expanding back is a handful of
  byte-wide shifts and masks per weight byte, whatever order the nibbles are in: no unpacking to floats,
  which was 100x slower than the matmul itself on AVX2.

`reference_dequantize` is the format's definition in float64, used by the tests as the ground truth
that kernels and packing are compared against.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ..choices import DEFAULT_GROUP_SIZE, DENSE_FORMATS, GROUP_SIZES, QUANT_FORMATS, TABLE_FORMATS  # noqa: F401 (this module's names)
from ..errors import UsageError

#: The int4 `packing` of format version 4: plain nibbles in row order, the same on every machine.
PORTABLE_PACKING = "nibbles"
#: The int4 packings of format version 3 stores: torch's CPU int4 kernel layout of the CPU that converted
#: them (`moestream upgrade` rewrites them as PORTABLE_PACKING).
LEGACY_PACKINGS = ("torch-cpu-default", "torch-cpu-avx2", "torch-cpu-avx512")


#: Each table format's 16 values, by code (llama.cpp's kvalues_mxfp4 and kvalues_iq4nl).
TABLES = {
    "mxfp4": (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12),
    "iq4nl": (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113),
}
TABLE_GROUP = 32  # a table format's weights per scale: the blocks it holds
#: int6's weights per scale where none is asked for: 6.5 bits a weight, about a GGUF's Q6_K (6.56).
SIX_GROUP = 64


def group_for(name: str | None, asked: int | None, default: int = DEFAULT_GROUP_SIZE) -> int:
    """The group size of format `name`: the one asked for, else int6's SIX_GROUP, else `default`."""
    return asked or (SIX_GROUP if name == "int6" else default)


def torch_int4_packing() -> str:
    """The int4 layout this process's torch CPU kernel consumes, e.g. "torch-cpu-avx2" (a version 3 store
    written with the same one runs as it is)."""
    return f"torch-cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


@dataclass(frozen=True)
class QuantFormat:
    """How the expert matrices of one layer are stored; recorded per layer in the manifest."""

    name: str  # one of QUANT_FORMATS or TABLE_FORMATS
    group_size: int | None = None  # inputs per scale (None: int8, per output channel)
    packing: str | None = None  # int4/int3/int2: PORTABLE_PACKING, or a version 3 store's LEGACY_PACKINGS

    @property
    def bits(self) -> int:
        return 4 if self.name in TABLES else int(self.name[3:])

    @property
    def table(self) -> tuple[int, ...] | None:
        """A table format's 16 values (code q stands for table[q]), or None."""
        return TABLES.get(self.name)

    @property
    def params(self) -> str:
        """The name of the tensor beside `qweight`: int8's per-channel scales, or the int4 family's
        interleaved scales and zeros."""
        return "scales" if self.name == "int8" else "scales_zeros"

    @property
    def torch_kernel(self) -> bool:
        """Whether torch has a CPU kernel for it in float activations: int8, and int4/int3/int2 (its int4
        kernel, on records repacked into its layout). The table formats and int6 have none: in float
        activations each matrix is dequantized per matmul, and their records are read as stored."""
        return self.name in ("int8", "int4", "int3", "int2")

    @property
    def portable(self) -> bool:
        """Whether `qweight` is stored machine-independent (int8, and every format version 4 layout)."""
        return self.packing is None or self.packing == PORTABLE_PACKING

    @staticmethod
    def make(name: str, group_size: int = DEFAULT_GROUP_SIZE) -> "QuantFormat":
        if name not in QUANT_FORMATS + TABLE_FORMATS:
            raise UsageError(f"unknown quantized format {name!r}; choose one of {', '.join(QUANT_FORMATS)}")
        if name == "int8":
            return QuantFormat("int8")
        if name in TABLES:
            return QuantFormat(name, TABLE_GROUP, PORTABLE_PACKING)
        if group_size not in GROUP_SIZES:
            raise UsageError(f"group size {group_size} is not supported; choose one of {GROUP_SIZES}")
        return QuantFormat(name, group_size, PORTABLE_PACKING)

    def to_json(self) -> dict:
        return {"format": self.name, "group_size": self.group_size, "packing": self.packing}

    def check_shape(self, n: int, k: int, what: str) -> None:
        """Refuse, at conversion time, matrices the kernels cannot take, naming a format that works."""
        if self.group_size and k % self.group_size:
            ok = [g for g in GROUP_SIZES if k % g == 0]
            hint = f"use --group-size {ok[0]}" if ok else "use int8 or a float dtype for it"
            raise UsageError(f"{what} has {k} inputs, not a multiple of the group size {self.group_size}; {hint}")
        if self.group_size and n % 16:
            raise UsageError(f"{what} has {n} outputs; the int4 kernel needs a multiple of 16: use int8 for it")
        if self.bits == 6 and k % 64:
            raise UsageError(f"{what} has {k} inputs; int6 stores them in 64s: use int8 for it")

    def record_specs(self, name: str, n: int, k: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The record tensors that store one [N, K] matrix called `name`."""
        if self.name == "int8":
            return [(f"{name}.qweight", torch.int8, (n, k)), (f"{name}.scales", torch.float32, (n,))]
        groups = k // self.group_size
        return [
            (f"{name}.qweight", torch.uint8, (n, k * self.bits // 8)),
            (f"{name}.scales_zeros", torch.bfloat16, (groups, n, 2)),
        ]


@dataclass
class Quantized:
    """A quantized matrix in a portable form: one code per weight, plus the per-group parameters."""

    codes: torch.Tensor  # [N, K]: int8 for int8, uint8 0..2^b-1 otherwise
    scales: torch.Tensor  # int8: [N] float32; others: s, [N, K/G] bfloat16
    offsets: torch.Tensor | None  # int8: None; others: the zero z, [N, K/G] bfloat16


def quantize(w: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """Round-to-nearest quantization of W [N, K] (any float dtype) in `fmt`. (A GGUF's 4-bit blocks of 32
    are not quantized again: their codes go into int4 group-32 records as they are, gguf_blocks.py.)"""
    w = w.to(torch.float32)
    n, k = w.shape
    if fmt.table is not None:
        return _nearest_in_table(w, fmt)
    if fmt.name == "int8":
        # |w|'s row maxima without |w| itself, and one temporary rounded in place: the same values, 1.7x faster
        # than abs, amax, round and clamp each making a copy (a 150k-token LM head is 37 slices of 32 MiB).
        scales = (torch.linalg.vector_norm(w, float("inf"), dim=1) / 127).clamp_min(1e-12)
        return Quantized((w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8), scales, None)
    g = w.view(n, k // fmt.group_size, fmt.group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    levels = 2**fmt.bits - 1
    scales = ((hi - lo) / levels).clamp_min(1e-8).to(torch.bfloat16)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)  # the kernel's zero: W = (q - 8) * s + z, q = 0 at lo
    # Codes are rounded against the parameters as stored (bf16), so that rounding is absorbed.
    # (in place after the first op: the same operations in the same order, one temporary instead of four)
    codes = (g - zeros.float()[:, :, None]).div_(scales.float()[:, :, None]).round_().add_(8)
    return Quantized(codes.clamp_(0, levels).to(torch.uint8).view(n, k), scales, zeros)


def _nearest_in_table(w: torch.Tensor, fmt: QuantFormat) -> Quantized:
    """A float matrix in a table format (tests, and `kernels.measure_activations`; a converter takes a GGUF's
    table codes as they are): per group, s = max |w| / max |T|, z = 0, each weight the nearest value."""
    n, k = w.shape
    table = torch.tensor(fmt.table, dtype=torch.float32)
    g = w.view(n, k // fmt.group_size, fmt.group_size)
    scales = (g.abs().amax(dim=2) / table.abs().max()).clamp_min(1e-30).to(torch.bfloat16)
    values, order = table.sort()
    nearest = torch.bucketize(g / scales.float()[..., None], (values[1:] + values[:-1]) / 2)
    return Quantized(order[nearest].to(torch.uint8).view(n, k), scales, torch.zeros_like(scales))


def reference_dequantize(q: Quantized, fmt: QuantFormat) -> torch.Tensor:
    """The format's definition, in float64: what every kernel must compute (up to its arithmetic)."""
    codes = q.codes.to(torch.float64)
    if fmt.name == "int8":
        return codes * q.scales.to(torch.float64)[:, None]
    s = q.scales.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    z = q.offsets.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    if fmt.table is not None:
        return torch.tensor(fmt.table, dtype=torch.float64)[q.codes.long()] * s + z
    return (codes - 8) * s + z


def pack(q: Quantized, fmt: QuantFormat, name: str) -> dict[str, torch.Tensor]:
    """The record tensors of `record_specs`, in the portable layout."""
    if fmt.name == "int8":
        return {f"{name}.qweight": q.codes, f"{name}.scales": q.scales.to(torch.float32)}
    if fmt.bits == 6:
        return int4_parts(name, pack_six(q.codes), q.scales, q.offsets)
    nibbles = pack_nibbles(q.codes)
    return int4_parts(name, nibbles if fmt.bits == 4 else compress_int4_bytes(nibbles, fmt.bits), q.scales, q.offsets)


def int4_parts(name: str, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> dict[str, torch.Tensor]:
    """An int4-family matrix's record tensors: its bytes as stored, and its scales and zeros [N, K/G]
    (bf16) side by side per group, [K/G, N, 2]."""
    return {f"{name}.qweight": qweight, f"{name}.scales_zeros": torch.stack([scales.t(), offsets.t()], dim=-1).contiguous()}


def rows_dim(part: str) -> int:
    """The dimension of a packed part (named as `pack` names them) along which the matrix's rows run: a
    matrix packed a slice of rows at a time is the slices' parts joined along it."""
    return 1 if part.endswith(".scales_zeros") else 0


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> the portable int4 bytes [N, K/2]: inputs 2j and 2j+1 in byte j's low and
    high nibble."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """The portable int4 bytes [N, K/2] -> codes [N, K] (uint8, 0..15), on the bytes' device."""
    return torch.stack([nibbles & 15, nibbles >> 4], dim=-1).view(nibbles.shape[0], -1)


def pack_six(codes: torch.Tensor) -> torch.Tensor:
    """int6 codes [N, K] (0..63) -> the stored bytes [N, 3K/4]: each row's low 4 bits as portable nibbles
    (K/2 bytes), then a plane of their top 2 bits (K/4 bytes; the layout in the module docstring)."""
    codes = codes.to(torch.uint8)
    n = codes.shape[0]
    top = (codes >> 4).view(n, -1, 32, 2)  # [N, K/64, nibble byte, low/high code]
    pairs = top[..., 0] | (top[..., 1] << 2)  # each nibble byte's two tops, 4 bits
    tops = (pairs[..., :16] | (pairs[..., 16:] << 4)).reshape(n, -1)
    return torch.cat([pack_nibbles(codes & 15), tops], dim=1).contiguous()


def unpack_six(stored: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_six: codes [N, K] (uint8, 0..63), on the bytes' device."""
    n, k = stored.shape[0], stored.shape[1] * 4 // 3
    low = unpack_nibbles(stored[:, : k // 2].contiguous()).view(n, -1, 32, 2)
    tops = stored[:, k // 2 :].reshape(n, -1, 16)
    pairs = torch.cat([tops & 15, tops >> 4], dim=2)  # [N, K/64, 32]: nibble byte u's two tops
    top = torch.stack([pairs & 3, pairs >> 2], dim=-1)
    return (low | (top << 4)).view(n, -1)


def stored_codes(qweight: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """The [N, K] codes of a stored int6/int4/int3/int2 matrix in the portable layout."""
    if fmt.bits == 6:
        return unpack_six(qweight)
    return unpack_nibbles(qweight if fmt.bits == 4 else expand_int4_bytes(qweight, fmt.bits))


# -- version 3 stores: torch's CPU kernel layouts ------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def legacy_nibble_index(packing: str, n: int, k: int) -> torch.Tensor:
    """Where torch's CPU int4 kernel layout `packing` keeps weight i of an [N, K] matrix (row-major): the
    index of its nibble among the bytes' nibbles (low, then high, of each byte in order).

    torch packs rows in blocks of 64 (AVX512) or 32 (AVX2, and the portable build): byte i of input k in a
    block of B rows holds rows i and i + B/2 (AVX2, AVX512) or rows 2i and 2i + 1 (the portable build, and
    every block narrower than B, i.e. a tail of N); input k's B/2 bytes follow input k - 1's. The running
    machine's own layout is checked against torch's packing function itself (tests/test_quant.py)."""
    if packing not in LEGACY_PACKINGS:
        raise ValueError(f"unknown int4 packing {packing!r}")
    block = 64 if packing == "torch-cpu-avx512" else 32
    split = packing != "torch-cpu-default"
    index = torch.empty(n, k, dtype=torch.int64)
    ks = torch.arange(k, dtype=torch.int64)
    for start in range(0, n, block):
        rows = min(block, n - start)
        base = 2 * start * k // 2  # nibbles before this block: start rows of K codes
        for r in range(rows):
            if split and rows == block:
                byte, high = r % (block // 2), r // (block // 2)
            else:
                byte, high = r // 2, r % 2
            index[start + r] = base + 2 * (ks * (rows // 2) + byte) + high
    return index


def legacy_codes(kernel_bytes: torch.Tensor, packing: str) -> torch.Tensor:
    """The [N, K] codes (uint8) of int4 kernel bytes [N, K/2] stored in a version 3 `packing`."""
    n, k = kernel_bytes.shape[0], kernel_bytes.shape[1] * 2
    return unpack_nibbles(kernel_bytes).reshape(-1)[legacy_nibble_index(packing, n, k).reshape(-1)].view(n, k)


# Each int4 byte holds two nibbles. With codes below 4 only bits 0,1,4,5 are used (mask 0x33); below 8,
# bits 0,1,2,4,5,6: the 0x33 part plus the 0x44 part. The byte stream is cut into equal contiguous parts
# (halves for int2, quarters for int3) whose bits share bytes, so that expanding is a few whole-tensor
# byte operations with contiguous reads and writes. It moves whole nibbles only, so it serves any nibble
# order (the portable one, and a version 3 store's kernel layout).


def compress_int4_bytes(int4_bytes: torch.Tensor, bits: int) -> torch.Tensor:
    """int4 bytes [N, K/2] whose codes fit in `bits` bits -> the dense int2/int3 `qweight`."""
    n = int4_bytes.shape[0]
    if bits == 2:
        a, b = int4_bytes.reshape(2, -1)
        return (a | (b << 2)).view(n, -1)  # two int4 bytes in one
    x0, x1, x2, x3 = int4_bytes.reshape(4, -1)
    low01 = (x0 & 0x33) | ((x1 & 0x33) << 2)
    low23 = (x2 & 0x33) | ((x3 & 0x33) << 2)
    high = ((x0 & 0x44) >> 2) | ((x1 & 0x44) >> 1) | (x2 & 0x44) | ((x3 & 0x44) << 1)
    return torch.cat([low01, low23, high]).view(n, -1)  # four int4 bytes in three


def expand_int4_bytes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of compress_int4_bytes: the int4 bytes, [N, K/2]."""
    n = qweight.shape[0]
    if bits == 2:
        b = qweight.reshape(-1)
        return torch.cat([b & 0x33, (b >> 2) & 0x33]).view(n, -1)
    low01, low23, high = qweight.reshape(3, -1)
    parts = [
        (low01 & 0x33) | ((high << 2) & 0x44),
        ((low01 >> 2) & 0x33) | ((high << 1) & 0x44),
        (low23 & 0x33) | (high & 0x44),
        ((low23 >> 2) & 0x33) | ((high >> 1) & 0x44),
    ]
    return torch.cat(parts).view(n, -1)


_LAYER_RULE = re.compile(r"^(-?\d+)(?:-(-?\d+))?=(\w+)$")


def parse_layer_rules(rules: list[str], num_layers: int) -> dict[int, str]:
    """`--layer-dtype 0-3=int3 --layer-dtype -1=int4` -> {experts layer index: format}; later rules win.

    Indices count the model's MoE layers (the store's experts/layer-NNN files), from 0; negative ones
    count from the last."""
    chosen: dict[int, str] = {}
    for rule in rules:
        m = _LAYER_RULE.match(rule.replace(" ", ""))
        if not m:
            raise UsageError(f"--layer-dtype {rule!r}: expected LAYER=DTYPE or FIRST-LAST=DTYPE, e.g. 0-3=int3 or -1=int4")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        first, last = (i + num_layers if i < 0 else i for i in (first, last))
        if not 0 <= first <= last < num_layers:
            raise UsageError(f"--layer-dtype {rule!r}: the model has MoE layers 0..{num_layers - 1}")
        for i in range(first, last + 1):
            chosen[i] = m.group(3)
    return chosen


def expert_record_specs(
    shapes: dict[str, tuple[int, ...]], float_dtype: torch.dtype, fmt: QuantFormat | None, transposed: bool, where: str
) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The record tensors of one expert, given its per-expert parameter shapes in module order.

    Float layers store each parameter as is. Quantized layers store each matrix in `fmt`, always as
    [N, K] (a module that keeps [K, N], like gpt-oss, is transposed first); biases stay `float_dtype`."""
    specs = []
    for name, shape in shapes.items():
        if fmt is None or len(shape) != 2:
            specs.append((name, float_dtype, tuple(shape)))
            continue
        n, k = (shape[1], shape[0]) if transposed else shape
        fmt.check_shape(n, k, f"{where}.{name}")
        specs += fmt.record_specs(name, n, k)
    return specs


def dense_formats(
    linears: list[tuple[str, int, int, bool]], dense_dtype: str, group_size: int, head_group: int = SIX_GROUP
) -> dict[str, QuantFormat]:
    """The format of each resident linear layer (name, out features, in features, is the LM head) to
    quantize: the one asked for where its shape fits the kernel, else the next wider one (int4 -> int8
    -> float). The LM head never goes below 6 bits: int6 in groups of `head_group` (what llama.cpp's Q4
    files keep theirs in: Q6_K, 6.56 bits), or int8 where asked for or where int6 cannot take its shape."""
    if dense_dtype not in DENSE_FORMATS:
        raise UsageError(f"unknown dense dtype {dense_dtype!r}; choose one of {', '.join(DENSE_FORMATS)}")
    if dense_dtype == "float":
        return {}
    int8 = QuantFormat.make("int8")
    chosen = {}
    for name, n, k, head in linears:
        if dense_dtype == "int8":
            narrow = []
        else:
            narrow = [QuantFormat.make("int6", head_group) if head else QuantFormat.make(dense_dtype, group_size)]
        for fmt in narrow + [int8]:
            try:
                fmt.check_shape(n, k, name)
            except UsageError:
                continue
            chosen[name] = fmt
            break
    return chosen

"""Low-bit weight formats (experts, and resident linears with --dense-dtype): how a weight matrix is
quantized, packed into a record, and what it means.

Every format works on one weight matrix W [N, K] (out features, in features) and produces the record
tensors a kernel consumes directly (kernels.py), so a record goes from disk to the matmul unchanged:

- int8: symmetric per output channel. `qweight` int8 [N, K], `scales` float32 [N]; W = q * s.
- int4: affine per group of G inputs, in the layout of torch's CPU int4 kernel
  (`torch._convert_weight_to_int4pack_for_cpu`): `qweight` uint8 [N, K/2] packed, `scales_zeros`
  bfloat16 [K/G, N, 2]; W = (q - 8) * s + z with q in 0..15. That packed layout depends on the CPU
  kernels torch runs (AVX512 and AVX2 interleave differently), so the store records it as `packing`
  and a machine with other kernels refuses the store instead of computing garbage.
- int3, int2: the int4 format restricted to codes 0..2^b-1 (so W = (q - 8) * s + z = q * s + m with
  z = m + 8 s), with the int4 kernel's bytes compressed densely: int2 keeps the 2 used bits of every
  nibble (two kernel bytes in one), int3 the 3 used bits (four kernel bytes in three). Expanding back
  is a handful of byte-wide shifts and masks per weight byte, then the int4 kernel runs: no unpacking
  to floats, which was 100x slower than the matmul itself on AVX2.

`reference_dequantize` is the format's definition in float64, used by the tests as the ground truth
that kernels and packing are compared against.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from ..errors import UsageError

QUANT_FORMATS = ("int8", "int4", "int3", "int2")
# Resident linear layers (attention, shared experts, dense MLPs): kept in the model's float dtype, or
# quantized into these kernel formats (core/dense.py runs them).
DENSE_FORMATS = ("float", "int8", "int4")
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 32


def int4_packing() -> str:
    """The int4 layout this process's torch kernels consume, e.g. "torch-cpu-avx2"."""
    return f"torch-cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


@dataclass(frozen=True)
class QuantFormat:
    """How the expert matrices of one layer are stored; recorded per layer in the manifest."""

    name: str  # one of QUANT_FORMATS
    group_size: int | None = None  # inputs per scale (None: int8, per output channel)
    packing: str | None = None  # int4/int3/int2: the int4 kernel layout `qweight` derives from

    @property
    def bits(self) -> int:
        return int(self.name[3:])

    @property
    def params(self) -> str:
        """The name of the tensor beside `qweight` that its kernel reads: int8's per-channel scales, or
        the int4 kernel's interleaved scales and zeros."""
        return "scales" if self.name == "int8" else "scales_zeros"

    @staticmethod
    def make(name: str, group_size: int = DEFAULT_GROUP_SIZE) -> "QuantFormat":
        if name not in QUANT_FORMATS:
            raise UsageError(f"unknown quantized format {name!r}; choose one of {', '.join(QUANT_FORMATS)}")
        if name == "int8":
            return QuantFormat("int8")
        if group_size not in GROUP_SIZES:
            raise UsageError(f"group size {group_size} is not supported; choose one of {GROUP_SIZES}")
        return QuantFormat(name, group_size, int4_packing())

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
    """Round-to-nearest quantization of W [N, K] (any float dtype) in `fmt`."""
    w = w.to(torch.float32)
    n, k = w.shape
    if fmt.name == "int8":
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12)
        return Quantized(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8), scales, None)
    g = w.view(n, k // fmt.group_size, fmt.group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    levels = 2**fmt.bits - 1
    scales = ((hi - lo) / levels).clamp_min(1e-8).to(torch.bfloat16)
    zeros = (lo + 8 * scales.float()).to(torch.bfloat16)  # the kernel's zero: W = (q - 8) * s + z, q = 0 at lo
    # Codes are rounded against the parameters as stored (bf16), so that rounding is absorbed.
    codes = torch.round((g - zeros.float()[:, :, None]) / scales.float()[:, :, None]) + 8
    return Quantized(codes.clamp(0, levels).to(torch.uint8).view(n, k), scales, zeros)


def reference_dequantize(q: Quantized, fmt: QuantFormat) -> torch.Tensor:
    """The format's definition, in float64: what every kernel must compute (up to its arithmetic)."""
    codes = q.codes.to(torch.float64)
    if fmt.name == "int8":
        return codes * q.scales.to(torch.float64)[:, None]
    s = q.scales.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    z = q.offsets.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    return (codes - 8) * s + z


def pack(q: Quantized, fmt: QuantFormat, name: str) -> dict[str, torch.Tensor]:
    """The record tensors of `record_specs`, in the kernels' layout."""
    if fmt.name == "int8":
        return {f"{name}.qweight": q.codes, f"{name}.scales": q.scales.to(torch.float32)}
    kernel_bytes = torch._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1)  # [N, K/2]
    scales_zeros = torch.stack([q.scales.t(), q.offsets.t()], dim=-1).contiguous()  # [K/G, N, 2]
    qweight = kernel_bytes if fmt.bits == 4 else compress_kernel_bytes(kernel_bytes, fmt.bits)
    return {f"{name}.qweight": qweight, f"{name}.scales_zeros": scales_zeros}


# Each byte of the int4 kernel's layout holds two nibbles. With codes below 4 only bits 0,1,4,5 are
# used (mask 0x33); below 8, bits 0,1,2,4,5,6: the 0x33 part plus the 0x44 part. The kernel's byte
# stream is cut into equal contiguous parts (halves for int2, quarters for int3) whose bits share bytes,
# so that expanding is a few whole-tensor byte operations with contiguous reads and writes.


@functools.lru_cache(maxsize=16)
def int4_unpack_index(n: int, k: int) -> torch.Tensor:
    """For the int4 kernel bytes of an [N, K] matrix (this process's packing): which nibble of the bytes
    (low then high nibble of each byte, in order) holds weight i of the matrix in row-major order.

    torch's CPU packing moves each 4-bit code to another nibble and changes nothing else, so that map
    is found by packing the weights' own indices, four bits per pass, and reading where each landed. It
    lets a device without torch's CPU int4 kernel (CUDA) recover the codes from the records as stored."""
    index = torch.arange(n * k, dtype=torch.int64)
    holder = torch.zeros(n * k, dtype=torch.int64)  # nibble position -> the weight it holds
    shift = 0
    while (1 << shift) < n * k:
        codes = ((index >> shift) & 15).view(n, k).to(torch.int32)
        holder |= _nibbles(torch._convert_weight_to_int4pack_for_cpu(codes, 1)).to(torch.int64) << shift
        shift += 4
    return torch.argsort(holder)  # weight -> the nibble position that holds it


def _nibbles(kernel_bytes: torch.Tensor) -> torch.Tensor:
    """Every nibble of the bytes, low then high nibble of each byte, in order (the bytes' dtype)."""
    b = kernel_bytes.reshape(-1)
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(-1)


def unpack_int4_codes(kernel_bytes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The [N, K] uint8 codes (0..15) of int4 kernel bytes [N, K/2], with `int4_unpack_index(N, K)` on
    the bytes' device."""
    return _nibbles(kernel_bytes)[index].view(kernel_bytes.shape[0], -1)


def compress_kernel_bytes(kernel_bytes: torch.Tensor, bits: int) -> torch.Tensor:
    """int4 kernel bytes whose codes fit in `bits` bits -> the dense int2/int3 `qweight`."""
    n = kernel_bytes.shape[0]
    if bits == 2:
        a, b = kernel_bytes.reshape(2, -1)
        return (a | (b << 2)).view(n, -1)  # two kernel bytes in one
    x0, x1, x2, x3 = kernel_bytes.reshape(4, -1)
    low01 = (x0 & 0x33) | ((x1 & 0x33) << 2)
    low23 = (x2 & 0x33) | ((x3 & 0x33) << 2)
    high = ((x0 & 0x44) >> 2) | ((x1 & 0x44) >> 1) | (x2 & 0x44) | ((x3 & 0x44) << 1)
    return torch.cat([low01, low23, high]).view(n, -1)  # four kernel bytes in three


def expand_kernel_bytes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of compress_kernel_bytes: the bytes the int4 kernel reads, [N, K/2]."""
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


def dense_formats(linears: list[tuple[str, int, int, bool]], dense_dtype: str, group_size: int) -> dict[str, QuantFormat]:
    """The format of each resident linear layer (name, out features, in features, is the LM head) to
    quantize: the one asked for where its shape fits the kernel, else the next wider one (int4 -> int8
    -> float); the LM head never below int8."""
    if dense_dtype not in DENSE_FORMATS:
        raise UsageError(f"unknown dense dtype {dense_dtype!r}; choose one of {', '.join(DENSE_FORMATS)}")
    if dense_dtype == "float":
        return {}
    int8 = QuantFormat.make("int8")
    chosen = {}
    for name, n, k, head in linears:
        for fmt in [int8] if head or dense_dtype == "int8" else [QuantFormat.make("int4", group_size), int8]:
            try:
                fmt.check_shape(n, k, name)
            except UsageError:
                continue
            chosen[name] = fmt
            break
    return chosen

"""Low-bit expert formats: how a weight matrix is quantized, packed into a record, and what it means.

Every format works on one weight matrix W [N, K] (out features, in features) and produces the record
tensors a kernel consumes directly (kernels.py), so a record goes from disk to the matmul unchanged:

- int8: symmetric per output channel. `qweight` int8 [N, K], `scales` float32 [N]; W = q * s.
- int4: affine per group of G inputs, in the layout of torch's CPU int4 kernel
  (`torch._convert_weight_to_int4pack_for_cpu`): `qweight` uint8 [N, K/2] packed, `scales_zeros`
  bfloat16 [K/G, N, 2]; W = (q - 8) * s + z with q in 0..15. That packed layout depends on the CPU
  kernels torch runs (AVX512 and AVX2 interleave differently), so the store records it as `packing`
  and a machine with other kernels refuses the store instead of computing garbage.
- int3, int2: affine per group, codes packed densely (int2: 4 a byte; int3: bit-sliced planes),
  `scales` and `mins` float16 [N, K/G]; W = q * s + m with q in 0..2^b-1. Computed by dequantizing
  to the activation dtype and one matmul.

`reference_dequantize` is the format's definition in float64, used by the tests as the ground truth
that kernels and packing are compared against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .errors import UsageError

QUANT_FORMATS = ("int8", "int4", "int3", "int2")
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
    packing: str | None = None  # int4 only: the kernel layout of `qweight`

    @property
    def bits(self) -> int:
        return int(self.name[3:])

    @staticmethod
    def make(name: str, group_size: int = DEFAULT_GROUP_SIZE) -> "QuantFormat":
        if name not in QUANT_FORMATS:
            raise UsageError(f"unknown quantized format {name!r}; choose one of {', '.join(QUANT_FORMATS)}")
        if name == "int8":
            return QuantFormat("int8")
        if group_size not in GROUP_SIZES:
            raise UsageError(f"group size {group_size} is not supported; choose one of {GROUP_SIZES}")
        return QuantFormat(name, group_size, int4_packing() if name == "int4" else None)

    def to_json(self) -> dict:
        return {"format": self.name, "group_size": self.group_size, "packing": self.packing}

    def check_shape(self, n: int, k: int, what: str) -> None:
        """Refuse, at conversion time, matrices the kernels cannot take, naming a format that works."""
        if self.group_size and k % self.group_size:
            ok = [g for g in GROUP_SIZES if k % g == 0]
            hint = f"use --group-size {ok[0]}" if ok else "use int8 or a float dtype for it"
            raise UsageError(f"{what} has {k} inputs, not a multiple of the group size {self.group_size}; {hint}")
        if self.name == "int4" and n % 16:
            raise UsageError(f"{what} has {n} outputs; the int4 kernel needs a multiple of 16: use int8 for it")

    def record_specs(self, name: str, n: int, k: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """The record tensors that store one [N, K] matrix called `name`."""
        if self.name == "int8":
            return [(f"{name}.qweight", torch.int8, (n, k)), (f"{name}.scales", torch.float32, (n,))]
        groups = k // self.group_size
        if self.name == "int4":
            return [(f"{name}.qweight", torch.uint8, (n, k // 2)), (f"{name}.scales_zeros", torch.bfloat16, (groups, n, 2))]
        return [
            (f"{name}.qweight", torch.uint8, (n, k * self.bits // 8)),
            (f"{name}.scales", torch.float16, (n, groups)),
            (f"{name}.mins", torch.float16, (n, groups)),
        ]


@dataclass
class Quantized:
    """A quantized matrix in a portable form: one code per weight, plus the per-group parameters."""

    codes: torch.Tensor  # [N, K]: int8 for int8, uint8 0..2^b-1 otherwise
    scales: torch.Tensor  # int8: [N] float32; int4: [N, K/G] bfloat16; int3/int2: [N, K/G] float16
    offsets: torch.Tensor | None  # int4: zeros z; int3/int2: mins m; int8: None


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
    # The codes are rounded against the parameters as stored (bf16/fp16), so that rounding is absorbed.
    store_dtype = torch.bfloat16 if fmt.name == "int4" else torch.float16
    scales = ((hi - lo) / levels).clamp_min(1e-8).to(store_dtype)
    s = scales.float()[:, :, None]
    if fmt.name == "int4":
        offsets = (lo + 8 * scales.float()).to(store_dtype)  # the kernel's zero: W = (q - 8) * s + z
        codes = torch.round((g - offsets.float()[:, :, None]) / s) + 8
    else:
        offsets = lo.to(store_dtype)
        codes = torch.round((g - offsets.float()[:, :, None]) / s)
    codes = codes.clamp(0, levels).to(torch.uint8).view(n, k)
    return Quantized(codes, scales, offsets)


def reference_dequantize(q: Quantized, fmt: QuantFormat) -> torch.Tensor:
    """The format's definition, in float64: what every kernel must compute (up to its arithmetic)."""
    codes = q.codes.to(torch.float64)
    if fmt.name == "int8":
        return codes * q.scales.to(torch.float64)[:, None]
    n, k = codes.shape
    s = q.scales.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    o = q.offsets.to(torch.float64).repeat_interleave(fmt.group_size, dim=1)
    if fmt.name == "int4":
        return (codes - 8) * s + o
    return codes * s + o


def pack(q: Quantized, fmt: QuantFormat, name: str) -> dict[str, torch.Tensor]:
    """The record tensors of `record_specs`, in the kernels' layout."""
    if fmt.name == "int8":
        return {f"{name}.qweight": q.codes, f"{name}.scales": q.scales.to(torch.float32)}
    if fmt.name == "int4":
        packed = torch._convert_weight_to_int4pack_for_cpu(q.codes.to(torch.int32), 1)
        scales_zeros = torch.stack([q.scales.t(), q.offsets.t()], dim=-1).contiguous()  # [K/G, N, 2]
        return {f"{name}.qweight": packed, f"{name}.scales_zeros": scales_zeros}
    return {f"{name}.qweight": pack_bits(q.codes, fmt.bits), f"{name}.scales": q.scales, f"{name}.mins": q.offsets}


def _pack_plane(codes: torch.Tensor, width: int) -> torch.Tensor:
    """[N, K] codes < 2^width -> uint8 [N, K*width/8], 8/width codes a byte, the first in the lowest bits."""
    n, k = codes.shape
    per_byte = 8 // width
    c = codes.to(torch.uint8).view(n, k // per_byte, per_byte)
    out = c[:, :, 0].clone()
    for i in range(1, per_byte):
        out |= c[:, :, i] << (i * width)
    return out


def _unpack_plane(packed: torch.Tensor, width: int, k: int) -> torch.Tensor:
    shifts = torch.arange(0, 8, width, dtype=torch.uint8)
    return ((packed[:, :, None] >> shifts) & (2**width - 1)).view(packed.shape[0], k)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] codes -> uint8 [N, K*bits/8]. int2: 4 codes a byte. int3: bit-sliced, the low 2 bits of
    every code (K/4 bytes) then their high bits (K/8 bytes): still 3 bits a weight, and both planes
    unpack with byte-wide shifts, which is what makes the dequantizing kernel fast enough."""
    if bits == 2:
        return _pack_plane(codes, 2)
    return torch.cat([_pack_plane(codes & 3, 2), _pack_plane(codes >> 2, 1)], dim=1)


def unpack_bits(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of pack_bits: uint8 [N, K*bits/8] -> uint8 codes [N, K]."""
    if bits == 2:
        return _unpack_plane(packed, 2, k)
    return _unpack_plane(packed[:, : k // 4], 2, k) | (_unpack_plane(packed[:, k // 4 :], 1, k) << 2)


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

"""Matmuls on expert records as stored: y = x @ W.T for a float or quantized W [N, K] (quant.py).

The runtime calls one function, `expert_linear`, per expert matrix; which kernel runs is decided here
and nowhere else, so a CUDA path (torch's `_weight_int4pack_mm` with its own packing, or dequantize to
bf16) is one more entry in `_KERNELS`.

CPU kernels:
- int4: `torch._weight_int4pack_mm_for_cpu`, bf16 activations (fp32 activations would make the AVX2
  kernel ~10x slower, so we cast in and out).
- int8: `torch._weight_int8pack_mm`, in the activation dtype.
- int3, int2: unpack the codes, dequantize to the activation dtype, one `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .quant import QuantFormat, unpack_bits


def _int8(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, w[f"{name}.qweight"], w[f"{name}.scales"].to(x.dtype))


def _int4(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat) -> torch.Tensor:
    y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w[f"{name}.qweight"], fmt.group_size, w[f"{name}.scales_zeros"])
    return y.to(x.dtype)


def _dequantized(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat) -> torch.Tensor:
    return F.linear(x, dequantize(w, name, fmt, x.dtype))


def dequantize(w: dict, name: str, fmt: QuantFormat, dtype: torch.dtype) -> torch.Tensor:
    """int3/int2 record tensors -> W [N, K] in `dtype`."""
    scales, mins = w[f"{name}.scales"], w[f"{name}.mins"]
    n, groups = scales.shape
    codes = unpack_bits(w[f"{name}.qweight"], fmt.bits, groups * fmt.group_size).view(n, groups, fmt.group_size)
    # In float32, rounded once at the end: bf16 products and sums would each lose another 8 bits.
    w = codes.to(torch.float32) * scales.to(torch.float32)[:, :, None] + mins.to(torch.float32)[:, :, None]
    return w.view(n, -1).to(dtype)


_KERNELS = {"int8": _int8, "int4": _int4, "int3": _dequantized, "int2": _dequantized}


def expert_linear(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat | None, transposed: bool) -> torch.Tensor:
    """x [M, K] -> [M, N] with the record's matrix `name`.

    Float records keep the module's own orientation (`transposed`: stored [K, N], as gpt-oss does);
    quantized records are always stored [N, K] (the converter transposes before quantizing)."""
    if fmt is None:
        weight = w[name]
        return x @ weight if transposed else F.linear(x, weight)
    return _KERNELS[fmt.name](x, w, name, fmt)

"""Matmuls on expert records as stored: y = x @ W.T for a float or quantized W [N, K] (quant.py).

The runtime calls one function, `expert_linear`, per expert matrix; which kernel runs is decided here
and nowhere else, so a CUDA path (torch's `_weight_int4pack_mm` with its own packing, or dequantize to
bf16) is one more entry in `_KERNELS`.

CPU kernels:
- int4: `torch._weight_int4pack_mm_for_cpu`, bf16 activations (fp32 activations would make the AVX2
  kernel ~10x slower, so we cast in and out).
- int8: `torch._weight_int8pack_mm`, in the activation dtype.
- int3, int2: expand the dense bytes to the int4 kernel's (byte-wide shifts and masks), then int4.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conversion.quant import QuantFormat, expand_kernel_bytes


def _int8(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, w[f"{name}.qweight"], w[f"{name}.scales"].to(x.dtype))


def _int4(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat) -> torch.Tensor:
    qweight = w[f"{name}.qweight"]
    if fmt.bits < 4:
        qweight = expand_kernel_bytes(qweight, fmt.bits)  # int3/int2 are int4 with fewer bits stored
    y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), qweight, fmt.group_size, w[f"{name}.scales_zeros"])
    return y.to(x.dtype)


_KERNELS = {"int8": _int8, "int4": _int4, "int3": _int4, "int2": _int4}


def expert_linear(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat | None, transposed: bool) -> torch.Tensor:
    """x [M, K] -> [M, N] with the record's matrix `name`.

    Float records keep the module's own orientation (`transposed`: stored [K, N], as gpt-oss does);
    quantized records are always stored [N, K] (the converter transposes before quantizing)."""
    if fmt is None:
        weight = w[name]
        return x @ weight if transposed else F.linear(x, weight)
    return _KERNELS[fmt.name](x, w, name, fmt)

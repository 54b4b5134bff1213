"""Matmuls on weights as stored: y = x @ W.T for a float or quantized W [N, K] (quant.py).

Expert records go through `expert_linear`, resident quantized linears (dense.py) through
`quantized_matmul`; which kernel runs is decided here and nowhere else.

CPU kernels:
- int4: `torch._weight_int4pack_mm_for_cpu`, bf16 activations (fp32 activations would make the AVX2
  kernel ~10x slower, so we cast in and out).
- int8: `torch._weight_int8pack_mm`, in the activation dtype. Its bf16 path gives wrong results when
  the inputs are not a multiple of 16 (K = 72: half the output wrong; K = 33: NaN or a crash, torch
  2.13 on AVX512), so such matrices run it in float32 (slower, and rare: real models' widths are
  multiples of 64).
- int3, int2: expand the dense bytes to the int4 kernel's (byte-wide shifts and masks), then int4.

The int4 family's bytes as these kernels take them: on the CPU, torch's kernel layout, made from the
store's portable one where a record lands (repack.py); on a GPU, the portable layout as stored.

CUDA kernels: float records in their own dtype (`F.linear`); int8 and the int4 family dequantized per
call, then one matmul (`int8_dequantized`, `int4_dequantized`, which unpacks the portable nibbles).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conversion.quant import QuantFormat, expand_int4_bytes, torch_int4_packing, unpack_nibbles
from ..errors import StoreError, UsageError
from .repack import RecordPreparer


def _int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if x.device.type != "cpu":
        return int8_dequantized(x, qweight, scales)
    if x.dtype == torch.bfloat16 and x.shape[1] % 16:
        return torch._weight_int8pack_mm(x.float(), qweight, scales.float()).to(x.dtype)
    return torch._weight_int8pack_mm(x, qweight, scales if scales.dtype == x.dtype else scales.to(x.dtype))


def _int4(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits < 4:
        qweight = expand_int4_bytes(qweight, fmt.bits)  # int3/int2 are int4 with fewer bits stored
    if x.device.type != "cpu":
        return int4_dequantized(x, qweight, scales_zeros, fmt)
    if x.dtype == torch.bfloat16:
        return torch._weight_int4pack_mm_for_cpu(x, qweight, fmt.group_size, scales_zeros)
    return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), qweight, fmt.group_size, scales_zeros).to(x.dtype)


def int8_dequantized(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 on a device without torch's int8 kernel (CUDA): the matrix dequantized to the activations'
    dtype for this call (W = q * s), then one matmul."""
    return F.linear(x, qweight.to(x.dtype) * scales.to(x.dtype)[:, None])


def int4_dequantized(x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """int4 on a device without torch's CPU int4 kernel (CUDA): the codes of the portable layout as stored
    (`quant.unpack_nibbles`), dequantized to the activations' dtype for this call (W = (q - 8) * s + z per
    group), then one matmul."""
    codes = unpack_nibbles(nibbles)
    n, k = codes.shape
    groups = codes.view(n, k // fmt.group_size, fmt.group_size).to(x.dtype)
    scales = scales_zeros[..., 0].t().to(x.dtype)[:, :, None]  # [N, K/G, 1]
    zeros = scales_zeros[..., 1].t().to(x.dtype)[:, :, None]
    return F.linear(x, ((groups - 8) * scales + zeros).view(n, k))


def one_token_experts(module, layer, x: torch.Tensor, tiered: bool) -> tuple | None:
    """The fused kernel for one token through a layer's experts (core/fused.py's `experts_decode`) with the
    record tensors' names it takes, its bits and group size; or None where it does not apply: a device
    tier, float or int3/int2 records, int8 in bf16 at widths torch's kernel gets wrong (`_int8`), or a
    module whose gate differs from the kernel's. int4 with float32 activations casts them to bf16 and back,
    as `_int4` does, so both compute the same numbers."""
    from . import fused  # fused imports dense, which imports this module

    fmt = layer.quantization
    if tiered or x.device.type != "cpu" or fmt is None or fmt.name not in ("int4", "int8"):
        return None
    first = "gate_up_proj" if module.has_gate else "up_proj"
    shapes = {t.name: t.shape for t in layer.layout.tensors}
    width = shapes[f"{first}.qweight"][0]  # the first matrix's rows: gate and up stacked
    if fmt.name == "int8" and x.dtype == torch.bfloat16 and (x.shape[-1] % 16 or (width // 2) % 16):
        return None
    kernel = fused.experts_kernel(module, width, x.dtype)
    if kernel is None:
        return None
    names = (f"{first}.qweight", f"{first}.{fmt.params}", "down_proj.qweight", f"down_proj.{fmt.params}")
    return kernel, names, fmt.bits, fmt.group_size or 0


def record_preparer(fmt: QuantFormat | None, layout, cpu_kernels: bool):
    """What makes a layer's records, as read, into the bytes its kernels take (called on the I/O thread
    with the record's tensors), or None where they take them as stored: float and int8 records, a GPU,
    and a version 3 store's records (already in this machine's kernel layout, `check_packing`)."""
    if fmt is None or fmt.name == "int8" or not cpu_kernels or not fmt.portable:
        return None
    return RecordPreparer(fmt, [t.name for t in layout.tensors if t.name.endswith(".qweight")])


def cpu_record(record: dict[str, torch.Tensor], fmt: QuantFormat | None) -> dict[str, torch.Tensor]:
    """A portable record's tensors as torch's CPU kernels take them (a copy; what the engine does in place
    where a record lands), for callers that compute with records outside the engine."""
    record = {name: t.clone() for name, t in record.items()}
    if fmt is not None and fmt.name != "int8":
        RecordPreparer(fmt, [name for name in record if name.endswith(".qweight")])(record)
    return record


def check_packing(fmt: QuantFormat | None, where: str, on_gpu: bool) -> None:
    """Refuse int4 bytes this device's kernels cannot read: a version 3 store's records are in torch's CPU
    kernel layout of the CPU that converted it, which runs as it is only where this machine's kernel has
    the same layout; everywhere else the store is rewritten once in the portable layout."""
    if fmt is None or fmt.portable:
        return
    here = "a GPU" if on_gpu else f"torch's {torch_int4_packing()} kernels"
    if on_gpu or fmt.packing != torch_int4_packing():
        raise StoreError(
            f"the {fmt.name} weights of {where} are in torch's {fmt.packing} layout (store format 3), which {here} "
            "cannot read; rewrite the store once in the portable format: moestream upgrade STORE (no checkpoint needed)"
        )


_KERNELS = {"int8": _int8, "int4": _int4, "int3": _int4, "int2": _int4}


def quantized_matmul(x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """x [M, K] -> [M, N] with a quantized matrix: `qweight` and its `fmt.params` tensor."""
    return _KERNELS[fmt.name](x, qweight, params, fmt)


def expert_linear(x: torch.Tensor, w: dict, name: str, fmt: QuantFormat | None, transposed: bool) -> torch.Tensor:
    """x [M, K] -> [M, N] with the record's matrix `name`.

    Float records keep the module's own orientation (`transposed`: stored [K, N], as gpt-oss does);
    quantized records are always stored [N, K] (the converter transposes before quantizing)."""
    if fmt is None:
        weight = w[name]
        return x @ weight if transposed else F.linear(x, weight)
    return _KERNELS[fmt.name](x, w[f"{name}.qweight"], w[f"{name}.{fmt.params}"], fmt)


# -- the activations' dtype ------------------------------------------------------------------------------

#: `load(compute_dtype=...)` / `--compute-dtype`: the dtype float weights and activations compute in.
COMPUTE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp32": torch.float32}


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16, AMX, or Arm's BF16): without it a bf16 matmul
    converts every weight to float32 on the fly and is slower than a float32 one (docs/BENCHMARKS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "").split()
    except OSError:
        return False
    return any(flag in flags for flag in ("avx512_bf16", "amx_bf16", "bf16"))


def compute_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a model of `model_dtype` computes in: the choice, or with "auto" the model's own, except
    bf16 on a CPU without bf16 arithmetic, which computes in float32 (its float weights held as float32,
    twice their stored size)."""
    if choice not in COMPUTE_DTYPES:
        raise UsageError(f"compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {choice!r}")
    if COMPUTE_DTYPES[choice] is not None:
        return COMPUTE_DTYPES[choice]
    return torch.float32 if model_dtype == torch.bfloat16 and not native_bf16() else model_dtype

"""Matmuls on weights as stored: y = x @ W.T for a float or quantized W [N, K] (quant.py).

Each matrix's plan (plan.py, where every choice of kernel is made: the activations, and which matrices
take int8 ones) binds its kernel once, at load: `matmul_kernel` for quantized matrices, of experts and of
resident linears (dense.py) alike, `float_matmul` (or row_buckets.bucketed_linear) for float expert records.
What is here is each storage format's matmul per device, dtype and activations (the C++ has its one
dispatch too, native/matmuls.h's `project`); `quantized_matmul` and `expert_linear` choose per call, for
callers outside the plans.

CPU kernels with int8 activations (`load(activations=...)`, the default where they are measured faster,
plan.choose_activations): the compiled kernels of native/lowbit_dot.h quantize each activation row to int8 (a
scale per 32 inputs) and keep the dot products in integers, as llama.cpp does; they read the int4 family's
portable bytes as stored (no repack) and int8 weights as they are. Their arithmetic is defined in
lowbit_dot.h and computed in float64 by `int8_activations_reference`.

CPU kernels with float activations:
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

import functools
import time

import torch
import torch.nn.functional as F

from ... import choices
from ...conversion.quant import (
    TABLES,
    QuantFormat,
    expand_int4_bytes,
    stored_codes,
    torch_int4_packing,
    unpack_nibbles,
)
from ...errors import StoreError, UsageError
from ...native import fused_build
from .repack import RecordPreparer


def _int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, qweight, scales if scales.dtype == x.dtype else scales.to(x.dtype))


def _int8_in_float32(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """bf16 activations on a matrix whose width is not a multiple of 16, which torch's bf16 path gets wrong."""
    return torch._weight_int8pack_mm(x.float(), qweight, scales.float()).to(x.dtype)


def _int8_on_gpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return int8_dequantized(x, qweight, scales)


def _int4(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits < 4:
        qweight = expand_int4_bytes(qweight, fmt.bits)  # int3/int2 are int4 with fewer bits stored
    return torch._weight_int4pack_mm_for_cpu(x, qweight, fmt.group_size, scales_zeros)


def _int4_through_bf16(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """float32 (or fp16) activations: torch's int4 kernel takes bf16 ones (in float32 its AVX2 path is ~10x slower)."""
    return _int4(x.to(torch.bfloat16), qweight, scales_zeros, fmt).to(x.dtype)


def _int4_on_gpu(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits < 4:
        qweight = expand_int4_bytes(qweight, fmt.bits)
    return int4_dequantized(x, qweight, scales_zeros, fmt)


def _int6(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """int6 in float activations, on any device: torch has no kernel for its codes, so the matrix is
    dequantized to the activations' dtype for this call, then one matmul (slow: on the CPU the
    int8-activation kernel is the fast path, `choose_activations`)."""
    return _affine_dequantized(x, stored_codes(qweight, fmt), scales_zeros, fmt)


def _table(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """A table format (quant.py) in float activations, on any device: the matrix dequantized to the
    activations' dtype for this call (W = T[q] * s + z per group), then one matmul. torch has no kernel of
    its own for these codes; on the CPU the int8-activation kernel is the fast path (`choose_activations`)."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    values = _byte_values(fmt.name, x.dtype, x.device).index_select(0, qweight.reshape(-1).long())
    values = values.view(n, k // fmt.group_size, fmt.group_size)
    scales = scales_zeros[..., 0].t().to(x.dtype)[:, :, None]  # [N, K/G, 1]
    zeros = scales_zeros[..., 1].t().to(x.dtype)[:, :, None]
    return F.linear(x, (values * scales + zeros).view(n, k))


def _int8_activations_table(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return _compiled().table_matmul(x, qweight, scales_zeros, table_values(fmt.name))


@functools.lru_cache(maxsize=None)
def table_values(name: str) -> torch.Tensor:
    """A table format's 16 values as the compiled kernels take them (int8)."""
    return torch.tensor(TABLES[name], dtype=torch.int8)


@functools.lru_cache(maxsize=None)
def _byte_values(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 2]: the two values a byte of a table format's portable nibbles stands for (low nibble first),
    so that a matrix is looked up one byte, not one code, at a time."""
    table = torch.tensor(TABLES[name], dtype=dtype)
    byte = torch.arange(256)
    return torch.stack([table[byte & 15], table[byte >> 4]], dim=1).to(device)


def _int8_activations_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    return _compiled().int8_matmul(x, qweight, scales)


def _int8_activations_int4(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    if fmt.bits < 4:
        qweight = expand_int4_bytes(qweight, fmt.bits)
    return _compiled().int4_matmul(x, qweight, scales_zeros, fmt.group_size, fmt.bits)


def _compiled():
    """The compiled kernels (native/fused_kernels.cpp), or None where they are off."""
    return fused_build.extension()


def int8_dequantized(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 on a device without torch's int8 kernel (CUDA): the matrix dequantized to the activations'
    dtype for this call (W = q * s), then one matmul."""
    return F.linear(x, qweight.to(x.dtype) * scales.to(x.dtype)[:, None])


def int4_dequantized(x: torch.Tensor, nibbles: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """int4 on a device without torch's CPU int4 kernel (CUDA): the codes of the portable layout as stored
    (`quant.unpack_nibbles`), dequantized to the activations' dtype for this call (W = (q - 8) * s + z per
    group), then one matmul."""
    return _affine_dequantized(x, unpack_nibbles(nibbles), scales_zeros, fmt)


def _affine_dequantized(x: torch.Tensor, codes: torch.Tensor, scales_zeros: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """x @ W.T for codes [N, K] of the int4 formula (W = (q - 8) * s + z per group), dequantized in x's dtype."""
    n, k = codes.shape
    groups = codes.view(n, k // fmt.group_size, fmt.group_size).to(x.dtype)
    scales = scales_zeros[..., 0].t().to(x.dtype)[:, :, None]  # [N, K/G, 1]
    zeros = scales_zeros[..., 1].t().to(x.dtype)[:, :, None]
    return F.linear(x, ((groups - 8) * scales + zeros).view(n, k))


def repacked_for_torch(fmt: QuantFormat | None) -> bool:
    """Whether torch's CPU kernel for this format takes its records in a layout of its own (the int4 family's
    int4pack), not as stored: int8's and float records go in as they are, formats without a torch kernel too."""
    return fmt is not None and fmt.name != "int8" and fmt.torch_kernel


def cpu_record(record: dict[str, torch.Tensor], fmt: QuantFormat | None) -> dict[str, torch.Tensor]:
    """A portable record's tensors as torch's CPU kernels take them (a copy; what the engine does in place
    where a record lands), for callers that compute with records outside the engine."""
    record = {name: t.clone() for name, t in record.items()}
    if repacked_for_torch(fmt):
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


_INT8_ACTIVATION_KERNELS = {"int8": _int8_activations_int8, "int6": _int8_activations_int4, "int4": _int8_activations_int4,
                            "int3": _int8_activations_int4, "int2": _int8_activations_int4, "mxfp4": _int8_activations_table,
                            "iq4nl": _int8_activations_table}  # fmt: skip
_DEQUANTIZING_KERNELS = {"int6": _int6, "mxfp4": _table, "iq4nl": _table}  # no torch kernel: on every device


# What the C++ (native/matmuls.h, `project`) runs for a matrix, as the plan chose it: the codes of its
# `MatmulKernel`, one per kernel below that it computes the same way (a float weight is 0).
FLOAT_WEIGHT = 0
_COMPILED_KERNELS = {_int8_activations_int8: 1, _int8_activations_int4: 1, _int8_activations_table: 1, _int8: 2,
                     _int8_in_float32: 3, _int4: 4, _int4_through_bf16: 5}  # fmt: skip


def compiled_kernel(matmul) -> int:
    """The C++'s code for a kernel `matmul_kernel` bound (what the fused one-token attention and experts steps
    are told to run, instead of choosing again)."""
    return _COMPILED_KERNELS[matmul.func]


def matmul_kernel(fmt: QuantFormat, int8_activations: bool, on_gpu: bool, dtype: torch.dtype, k: int):
    """The function (x, qweight, params) -> x @ W.T for a quantized [N, K] matrix of `fmt`, chosen once, by the
    matrix's plan at load (plan.py), from what stays the same call after call: the activations (int8 ones:
    a matrix that `int8_activations_fit`, on the CPU), the device, the compute dtype and K."""
    if int8_activations:
        kernel = _INT8_ACTIVATION_KERNELS[fmt.name]
    elif fmt.name in _DEQUANTIZING_KERNELS:
        kernel = _DEQUANTIZING_KERNELS[fmt.name]
    elif fmt.name == "int8":
        kernel = _int8_on_gpu if on_gpu else _int8_in_float32 if dtype == torch.bfloat16 and k % 16 else _int8
    else:  # the int4 family
        kernel = _int4_on_gpu if on_gpu else _int4 if dtype == torch.bfloat16 else _int4_through_bf16
    return functools.partial(kernel, fmt=fmt)


def quantized_matmul(
    x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, fmt: QuantFormat, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] -> [M, N] with a quantized matrix: `qweight` and its `fmt.params` tensor; with
    `int8_activations` (a matrix that `int8_activations_fit`, on the CPU) the integer kernels. The kernel is
    chosen for this call (`matmul_kernel`): for callers outside the plans (timings, tests)."""
    kernel = matmul_kernel(fmt, int8_activations, x.device.type != "cpu", x.dtype, x.shape[-1])
    return kernel(x, qweight, params)


def float_matmul(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x @ W.T for a float record's matrix; W stored [K, N] where `transposed` (gpt-oss's experts)."""
    return x @ weight if transposed else F.linear(x, weight)


def expert_linear(
    x: torch.Tensor, w: dict, name: str, fmt: QuantFormat | None, transposed: bool, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] -> [M, N] with the record's matrix `name`, its kernel chosen for this call (the engine's
    plans choose theirs once: plan.ExpertsPlan).

    Float records keep the module's own orientation (`transposed`: stored [K, N], as gpt-oss does);
    quantized records are always stored [N, K] (the converter transposes before quantizing)."""
    if fmt is None:
        return float_matmul(x, w[name], transposed)
    return quantized_matmul(x, w[f"{name}.qweight"], w[f"{name}.{fmt.params}"], fmt, int8_activations)


def fastest_ms(run, repeats: int) -> float:
    """The fastest of `repeats` timed calls of `run` in milliseconds, after one untimed call (first-call
    costs and cold caches left out)."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def int8_activations_reference(x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, fmt: QuantFormat) -> torch.Tensor:
    """What the int8-activation kernels compute (lowbit_dot.h), in float64: x [M, K] quantized in blocks of
    32 with float32 operations, exact integer sums per block, then the scales -> [M, N]."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).double()  # round half to even, as the kernels
    d = d.double()
    if fmt.name == "int8":
        codes = qweight.double().view(qweight.shape[0], k // 32, 32)
        return (torch.einsum("mbi,nbi->mnb", q, codes) * d[:, None, :]).sum(-1) * params.double()[None, :]
    if fmt.table is not None:  # W = T[c] s + z
        middle, codes = 8, torch.tensor(fmt.table, dtype=torch.float64)[unpack_nibbles(qweight).long()]
    else:
        middle = 2 ** (fmt.bits - 1)  # W = (c - C) s + (z - (8 - C) s): codes centred on C
        codes = stored_codes(qweight, fmt).double() - middle
    n, g = codes.shape[0], fmt.group_size
    per_block = torch.einsum("mbi,nbi->mnb", q, codes.view(n, k // 32, 32)) * d[:, None, :]
    per_group = per_block.view(m, n, k // g, g // 32).sum(-1)
    scales, zeros = params[..., 0].t().double(), params[..., 1].t().double()  # [N, K/G]
    sums = x.double().view(m, k // g, g).sum(-1)  # the second term takes the float activations
    return (per_group * scales[None] + (zeros - (8 - middle) * scales)[None] * sums[:, None, :]).sum(-1)


# -- the activations' dtype ------------------------------------------------------------------------------

#: `load(compute_dtype=...)` / `--compute-dtype`: the dtype float weights and activations compute in.
COMPUTE_DTYPES = dict(zip(choices.COMPUTE_DTYPES, (None, torch.bfloat16, torch.float32)))


def native_bf16() -> bool:
    """Whether this CPU has bf16 arithmetic (AVX512-BF16, AMX, or Arm's BF16): without it a bf16 matmul
    converts every weight to float32 on the fly and is slower than a float32 one (docs/DECISIONS.md, "Compute dtype: bf16 only with bf16 arithmetic")."""
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

"""Matmuls on weights as stored: y = x @ W.T for a float or quantized W [N, K] (quant.py).

Expert records go through `expert_linear` (called by each layer's plan, plan.py, which holds whether the
layer takes int8 activations), resident quantized linears (dense.py) through `quantized_matmul`: the matmul
for each storage format and device is chosen here (the registries below; the C++ has its one dispatch too,
native/matmuls.h's `project`).

CPU kernels with int8 activations (`load(activations=...)`, the default where they are measured faster,
`choose_activations`): the compiled kernels of native/lowbit_dot.h quantize each activation row to int8 (a
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
from ...choices import ACTIVATIONS
from ...conversion.quant import (
    TABLES,
    QuantFormat,
    expand_int4_bytes,
    pack,
    quantize,
    stored_codes,
    torch_int4_packing,
    unpack_nibbles,
)
from ...errors import StoreError, UsageError
from ...native import fused_build
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


def takes_int8_activations(layer) -> bool:
    """Whether every quantized matrix of an expert layer's records fits the int8-activation kernels."""
    if layer.quantization is None:
        return False
    return all(int8_activations_fit(layer.quantization, n, k) for n, k in layer.quantized_matrices)


def record_preparer(fmt: QuantFormat | None, layout, cpu_kernels: bool, int8_activations: bool = False):
    """What makes a layer's records, as read, into the bytes its kernels take (called on the I/O thread
    with the record's tensors), or None where they take them as stored: float and int8 records, the formats
    torch has no kernel for (`QuantFormat.torch_kernel`), a GPU, int8-activation kernels, and a version 3
    store's records (already in this machine's kernel layout, `check_packing`)."""
    if not _repacked_for_torch(fmt) or not cpu_kernels or int8_activations or not fmt.portable:
        return None
    return RecordPreparer(fmt, [t.name for t in layout.tensors if t.name.endswith(".qweight")])


def _repacked_for_torch(fmt: QuantFormat | None) -> bool:
    """Whether torch's CPU kernel for this format takes its records in a layout of its own (the int4 family's
    int4pack), not as stored: int8's and float records go in as they are, formats without a torch kernel too."""
    return fmt is not None and fmt.name != "int8" and fmt.torch_kernel


def cpu_record(record: dict[str, torch.Tensor], fmt: QuantFormat | None) -> dict[str, torch.Tensor]:
    """A portable record's tensors as torch's CPU kernels take them (a copy; what the engine does in place
    where a record lands), for callers that compute with records outside the engine."""
    record = {name: t.clone() for name, t in record.items()}
    if _repacked_for_torch(fmt):
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


_KERNELS = {"int8": _int8, "int6": _int6, "int4": _int4, "int3": _int4, "int2": _int4, "mxfp4": _table, "iq4nl": _table}
_INT8_ACTIVATION_KERNELS = {"int8": _int8_activations_int8, "int6": _int8_activations_int4, "int4": _int8_activations_int4,
                            "int3": _int8_activations_int4, "int2": _int8_activations_int4, "mxfp4": _int8_activations_table,
                            "iq4nl": _int8_activations_table}  # fmt: skip


def quantized_matmul(
    x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, fmt: QuantFormat, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] -> [M, N] with a quantized matrix: `qweight` and its `fmt.params` tensor; with
    `int8_activations` (a matrix that `int8_activations_fit`, on the CPU) the integer kernels."""
    return (_INT8_ACTIVATION_KERNELS if int8_activations else _KERNELS)[fmt.name](x, qweight, params, fmt)


def expert_linear(
    x: torch.Tensor, w: dict, name: str, fmt: QuantFormat | None, transposed: bool, int8_activations: bool = False
) -> torch.Tensor:
    """x [M, K] -> [M, N] with the record's matrix `name`.

    Float records keep the module's own orientation (`transposed`: stored [K, N], as gpt-oss does);
    quantized records are always stored [N, K] (the converter transposes before quantizing)."""
    if fmt is None:
        weight = w[name]
        return x @ weight if transposed else F.linear(x, weight)
    return quantized_matmul(x, w[f"{name}.qweight"], w[f"{name}.{fmt.params}"], fmt, int8_activations)


# -- int8 activations ------------------------------------------------------------------------------------

#: What `load` takes when not told (the test suite's exactness tests set "float").
DEFAULT_ACTIVATIONS = "auto"
#: "auto" takes int8 activations only when they are at least this much faster: a near tie is not worth
#: their rounding, and keeps the choice from flipping between runs on a noisy machine.
INT8_ACTIVATIONS_MARGIN = 1.2


def int8_activations_fit(fmt: QuantFormat | None, n: int, k: int) -> bool:
    """Whether a quantized [N, K] matrix of `fmt` can run the int8-activation kernels: int8 weights with K a
    multiple of 32, or the int4 family in the portable layout with K a multiple of 64 and N of 8 (every
    real model's widths are)."""
    if fmt is None or not fmt.portable:
        return False
    if fmt.name == "int8":
        return k % 32 == 0
    return k % 64 == 0 and n % 8 == 0


@functools.lru_cache(maxsize=16)
def measure_activations(fmt: QuantFormat, n: int, k: int, repeats: int = 20) -> tuple[float, float]:
    """(int8-activation ms, float-activation ms) of one token through a random [N, K] matrix of `fmt` on this
    machine, with the threads the model will use: what "auto" decides by (a few ms, once per shape)."""
    g = torch.Generator().manual_seed(0)
    record = pack(quantize(torch.randn(n, k, generator=g), fmt), fmt, "w")
    qweight, params = record["w.qweight"], record[f"w.{fmt.params}"]
    fast = cpu_record(record, fmt)["w.qweight"]  # torch's layout for the float-activation kernel
    x = torch.randn(1, k, generator=g)
    return (
        fastest_ms(lambda: quantized_matmul(x, qweight, params, fmt, True), repeats),
        fastest_ms(lambda: quantized_matmul(x, fast, params, fmt, False), repeats),
    )


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


def choose_activations(choice: str | None, shapes: list[tuple[QuantFormat, int, int]], on_gpu: bool) -> tuple[bool, str]:
    """(int8 activations or not, why) for a model whose quantized matrices are `shapes` (format, N, K), from
    the user's `choice` (ACTIVATIONS; None: DEFAULT_ACTIVATIONS). "auto" measures the largest one
    (`measure_activations`)."""
    choice = DEFAULT_ACTIVATIONS if choice is None else choice
    if choice not in ACTIVATIONS:
        raise UsageError(f"activations must be one of {', '.join(ACTIVATIONS)}, not {choice!r}")
    fitting = [(fmt, n, k) for fmt, n, k in shapes if int8_activations_fit(fmt, n, k)]
    if choice == "float":
        return False, "float activations, as chosen"
    if on_gpu:
        return False, "float activations: the model runs on a GPU"
    if not fitting:
        return False, "float activations: no quantized matrix here that the int8-activation kernels take"
    # formats torch has no kernel for: their float path dequantizes each matrix at every matmul
    kernelless = sorted({fmt.name for fmt, _, _ in fitting if not fmt.torch_kernel})
    if _compiled() is None:
        if choice == "int8":
            why = fused_build.unavailable_reason() or "turned off in this process"
            raise UsageError(f"--activations int8 needs the compiled kernels, which are off: {why}")
        if kernelless:  # a cliff worth naming: each of their matrices is dequantized per call
            return False, (
                f"float activations: no compiled kernels, so the {', '.join(kernelless)} weights are dequantized at every "
                "matmul (about 100x slower); install a C++ compiler, or convert with --experts-dtype int4"
            )
        return False, "float activations: no compiled kernels"
    loops = f"; {_compiled().lowbit_isa('')} loops"  # the variant this CPU runs (lowbit_dot.h)
    if choice == "int8":
        return True, "int8 activations, as chosen" + loops
    if kernelless:  # their float path dequantizes every matrix it multiplies: several times slower than either
        return True, f"int8 activations: the only fast kernel for {', '.join(kernelless)} weights" + loops
    fmt, n, k = max(fitting, key=lambda shape: shape[1] * shape[2])
    # At most 4096 x 8192 (32 MiB of float32 to quantize from): an LM head of 129k rows would take
    # seconds to make, and the speed per row does not depend on the row count. 8192 keeps K a multiple
    # of every group size.
    n, k = min(n, 4096), min(k, 8192)
    integer, floating = measure_activations(fmt, n, k)
    ratio = floating / integer
    if ratio >= INT8_ACTIVATIONS_MARGIN:
        return True, f"int8 activations: {ratio:.1f}x float's speed on a {n}x{k} {fmt.name} matrix here" + loops
    return False, f"float activations: int8 ones measured {ratio:.2f}x their speed here (under {INT8_ACTIVATIONS_MARGIN}x)"


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

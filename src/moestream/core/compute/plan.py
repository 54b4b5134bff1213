"""Every kernel choice, made once at load: what computes each matmul of the model on this machine.

- The activations of the CPU's low-bit matmuls (`choose_activations`): int8 ones (the compiled kernels of
  native/lowbit_dot.h) or float ones, from the user's choice or measured on the model's largest quantized
  matrix. Where int8 ones run, each plan records the variant of their loops that each of its matrices
  runs (`isa`: AVX-512 VNNI, AVX2 or portable), as the C++'s own dispatch decides it (`lowbit_variant`):
  the CPU's best (capped by MOESTREAM_LOWBIT_ISA, native/fused_build.py) where its loop takes the shape.
- Each MoE layer's experts (`ExpertsPlan`): int8 activations or not (every matrix must fit them), what a
  record needs where it lands (the supply runs it on the I/O thread), and the fused one-token kernel per
  activation dtype, or why there is none.
- Each resident quantized linear (`LinearPlan`, set on every `dense.QuantizedLinear` by `plan_linears`):
  int8 activations or not, and whether the compiled attention kernels can run it.

The engine, the dense layers and the fused kernels call their plan and decide nothing; fastpaths.py reports
the plans. The kernels themselves are kernels.py's (one per format and device), fused.py's (each installed
only after its agreement check) and the C++'s, whose one format dispatch (native/matmuls.h, `project`)
computes what `compiled_format` admits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from ...choices import ACTIVATIONS
from ...conversion.quant import QuantFormat, pack, quantize
from ...conversion.store import DTYPES
from ...errors import UsageError
from ...native import fused_build
from . import fused, kernels, row_buckets
from .dense import QuantizedLinear
from .repack import RecordPreparer
from .row_buckets import BUCKETED_DTYPES

#: What `load` takes when not told (the test suite's exactness tests set "float").
DEFAULT_ACTIVATIONS = "auto"
#: "auto" takes int8 activations only when they are at least this much faster: a near tie is not worth
#: their rounding, and keeps the choice from flipping between runs on a noisy machine.
INT8_ACTIVATIONS_MARGIN = 1.2
#: A prefill's rows per matmul where "auto" also measures (a 4,096-token piece routes about 256 tokens to each
#: of 128 experts at top-8; 32 is enough for the blocked loops of native/lowbit_gemm.h and quick to time).
PREFILL_ROWS = 32


def int8_activations_fit(fmt: QuantFormat | None, n: int, k: int) -> bool:
    """Whether a quantized [N, K] matrix of `fmt` can run the int8-activation kernels: int8 weights with K a
    multiple of 32, or the int4 family in the portable layout with K a multiple of 64 and N of 8 (every
    real model's widths are)."""
    if fmt is None or not fmt.portable:
        return False
    if fmt.name == "int8":
        return k % 32 == 0
    return k % 64 == 0 and n % 8 == 0


def compiled_format(fmt: QuantFormat | None, int8_activations: bool) -> str | None:
    """None where the C++ (native/matmuls.h, `project`) computes a matrix of `fmt` as kernels.py does: int8
    and int4 always, int6 and the table formats with int8 activations; else why not, in a few words."""
    if fmt is None:
        return "float records"
    if fmt.name in ("int4", "int8") or int8_activations and (fmt.name == "int6" or fmt.table is not None):
        return None
    if fmt.name == "int6" or fmt.table is not None:
        return f"{fmt.name} records in float activations"
    return f"{fmt.name} records"  # int3, int2


# -- the activations -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _timing_matrix(fmt: QuantFormat, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random [N, K] matrix of `fmt` for `measure_activations`: its codes and params as stored, and its codes in
    torch's layout for the float-activation kernel. Made once for both timings of a choice (seconds for the
    largest), and let go once the choice is made (`choose_activations`)."""
    g = torch.Generator().manual_seed(0)
    record = pack(quantize(torch.randn(n, k, generator=g), fmt), fmt, "w")
    return record["w.qweight"], record[f"w.{fmt.params}"], kernels.cpu_record(record, fmt)["w.qweight"]


@functools.lru_cache(maxsize=16)
def measure_activations(fmt: QuantFormat, n: int, k: int, rows: int = 1, repeats: int = 20) -> tuple[float, float]:
    """(int8-activation ms, float-activation ms) of `rows` tokens through a random [N, K] matrix of `fmt` on
    this machine, with the threads the model will use: what "auto" decides by (a few ms, once per shape)."""
    qweight, params, fast = _timing_matrix(fmt, n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    return (
        kernels.fastest_ms(lambda: kernels.quantized_matmul(x, qweight, params, fmt, True), repeats),
        kernels.fastest_ms(lambda: kernels.quantized_matmul(x, fast, params, fmt, False), repeats),
    )


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
    if fused_build.extension() is None:
        if choice == "int8":
            why = fused_build.unavailable_reason() or "turned off in this process"
            raise UsageError(f"--activations int8 needs the compiled kernels, which are off: {why}")
        if kernelless:  # a cliff worth naming: each of their matrices is dequantized per call
            return False, (
                f"float activations: no compiled kernels, so the {', '.join(kernelless)} weights are dequantized at every "
                "matmul (about 100x slower); install a C++ compiler, or convert with --experts-dtype int4"
            )
        return False, "float activations: no compiled kernels"
    if choice == "int8":
        return True, "int8 activations, as chosen"
    if kernelless:  # their float path dequantizes every matrix it multiplies: several times slower than either
        return True, f"int8 activations: the only fast kernel for {', '.join(kernelless)} weights"
    fmt, n, k = max(fitting, key=lambda shape: shape[1] * shape[2])
    # At most 4096 x 8192 (32 MiB of float32 to quantize from): an LM head of 129k rows would take
    # seconds to make, and the speed per row does not depend on the row count. 8192 keeps K a multiple
    # of every group size.
    n, k = min(n, 4096), min(k, 8192)
    try:
        return _choose_by_speed(fmt, n, k)
    finally:
        _timing_matrix.cache_clear()  # (up to 32 MiB of codes, not kept once the choice is made)


def _choose_by_speed(fmt: QuantFormat, n: int, k: int) -> tuple[bool, str]:
    """The "auto" choice by the two kinds' speeds: at one token, then, where that is a near tie, a prompt's rows."""
    integer, floating = measure_activations(fmt, n, k)
    ratio = floating / integer
    if ratio >= INT8_ACTIVATIONS_MARGIN:
        return True, f"int8 activations: {ratio:.1f}x float's speed on a {n}x{k} {fmt.name} matrix here"
    # Not enough at one token: a prompt's rows may still gain (the blocked loops), which is where a long
    # prompt's minutes go, as long as decode loses nothing.
    integer, floating = measure_activations(fmt, n, k, PREFILL_ROWS, 3)
    prefill = floating / integer
    measured = f"{prefill:.1f}x float's speed at {PREFILL_ROWS} rows (a prompt), {ratio:.2f}x at one token on a {n}x{k} {fmt.name} matrix here"
    if prefill >= INT8_ACTIVATIONS_MARGIN and ratio >= 1.0:
        return True, f"int8 activations: {measured}"
    return False, f"float activations: int8 ones measured {measured} (under {INT8_ACTIVATIONS_MARGIN}x, or slower at one token)"


# -- the experts ---------------------------------------------------------------------------------------------


@dataclass
class ExpertsPlan:
    layer: object  # the store's LayerSpec: the record's layout and format
    int8_activations: bool  # the matmuls take int8 activations and read the records as stored
    preparer: object | None  # what turns a record, as read, into its kernels' layout (None: used as stored)
    one_token_off: str | None  # why no fused one-token kernel can run this layer (None: one may, per module)
    isa: str | None = None  # the int8-activation loops' variant(s) its matrices run (None: float activations)
    one_token: dict = field(default_factory=dict)  # activation dtype -> the fused kernel's arguments, or None
    bucketed_rows: bool = False  # float records' matmuls run at bucketed row counts (row_buckets.py)
    matmuls: dict = field(default_factory=dict)  # matrix name -> its kernel (x, record, transposed) -> y, bound at load

    @property
    def fmt(self) -> QuantFormat | None:
        return self.layer.quantization

    def linear(self, x: torch.Tensor, record: dict, name: str, transposed: bool) -> torch.Tensor:
        """x [M, K] -> [M, N] with the record's matrix `name`, through the kernel bound for it at load."""
        return self.matmuls[name](x, record, transposed)

    def one_token_kernel(self, module: nn.Module, x: torch.Tensor) -> tuple | None:
        """The fused one-token experts kernel's arguments for this layer and x's dtype, or None: decided once
        per dtype (load resolves the model's compute dtype)."""
        if self.one_token_off is not None:  # (a GPU, a device tier, or a format the C++ does not compute)
            return None
        if x.dtype not in self.one_token:
            self.one_token[x.dtype] = fused.experts_call(module, self.layer, x.dtype, self.int8_activations)
        return self.one_token[x.dtype]

    def prefill_kernel(self, module: nn.Module, x: torch.Tensor) -> tuple | None:
        """The fused kernel for many tokens through this layer's experts (`experts_prefill`, then the same
        arguments as `one_token_kernel`'s), or None where the one-token kernel cannot run either."""
        arguments = self.one_token_kernel(module, x)
        return None if arguments is None else (fused_build.extension().experts_prefill, *arguments[1:])

    def one_token_reason(self, module: nn.Module, x: torch.Tensor) -> str | None:
        """Why `one_token_kernel` gives None for x (None: it gives the kernel)."""
        if self.one_token_kernel(module, x) is not None:
            return None
        if self.one_token_off is not None:
            return self.one_token_off
        return "a gate the kernel does not compute" if fused_build.extension() is not None else "no compiled kernels"


def takes_int8_activations(layer) -> bool:
    """Whether every quantized matrix of an expert layer's records fits the int8-activation kernels."""
    if layer.quantization is None:
        return False
    return all(int8_activations_fit(layer.quantization, n, k) for n, k in layer.quantized_matrices)


def record_preparer(fmt: QuantFormat | None, layout, cpu_kernels: bool, int8_activations: bool = False):
    """What makes a layer's records, as read, into the bytes its kernels take (called on the I/O thread
    with the record's tensors), or None where they take them as stored: float and int8 records, the formats
    torch has no kernel for (`QuantFormat.torch_kernel`), a GPU, int8-activation kernels, and a version 3
    store's records (already in this machine's kernel layout, `kernels.check_packing`)."""
    if not kernels.repacked_for_torch(fmt) or not cpu_kernels or int8_activations or not fmt.portable:
        return None
    return RecordPreparer(fmt, [t.name for t in layout.tensors if t.name.endswith(".qweight")])


def _record_matmuls(layer, int8_activations: bool, on_gpu: bool, dtype: torch.dtype, bucketed: bool) -> dict:
    """Each matrix of a layer's records -> its kernel (x, record, transposed) -> y, chosen now."""
    fmt = layer.quantization
    if fmt is None:
        matmul = row_buckets.bucketed_linear if bucketed else kernels.float_matmul
        return {t.name: functools.partial(_float_record_matmul, matmul, t.name) for t in layer.layout.tensors}
    matmuls = {}
    for t in layer.layout.tensors:
        if t.name.endswith(".qweight"):
            name, k = t.name.removesuffix(".qweight"), t.shape[1] * 8 // fmt.bits
            kernel = kernels.matmul_kernel(fmt, int8_activations, on_gpu, dtype, k)
            matmuls[name] = functools.partial(_quantized_record_matmul, kernel, t.name, f"{name}.{fmt.params}")
    return matmuls


def _float_record_matmul(matmul, name: str, x: torch.Tensor, record: dict, transposed: bool) -> torch.Tensor:
    return matmul(x, record[name], transposed=transposed)


def _quantized_record_matmul(kernel, qweight: str, params: str, x: torch.Tensor, record: dict, transposed: bool) -> torch.Tensor:
    return kernel(x, record[qweight], record[params])  # (stored [N, K] whatever the module's orientation)


def experts_plans(
    layers, cpu_kernels: bool, int8_activations: bool, tiered: bool = False, dtype: torch.dtype = torch.float32
) -> list[ExpertsPlan]:
    """Per MoE layer of a store: int8 activations where asked for, on the CPU's kernels, and every matrix
    fits them; the record preparer that goes with that choice; whether a fused one-token kernel may run it
    (the CPU's kernels, no device tier, a format the C++ computes); and each matrix's kernel, bound for the
    model's compute `dtype` (quantized records compute in it; float ones in their own)."""
    plans = []
    for layer in layers:
        integer = int8_activations and cpu_kernels and takes_int8_activations(layer)
        preparer = record_preparer(layer.quantization, layer.layout, cpu_kernels, integer)
        off = "a device tier" if tiered else None if cpu_kernels else "a GPU"
        isa = loops_variant(layer.quantization, layer.quantized_matrices) if integer else None
        one_token_off = off or compiled_format(layer.quantization, integer)
        bucketed = (
            cpu_kernels and layer.quantization is None and any(DTYPES[t.dtype] in BUCKETED_DTYPES for t in layer.layout.tensors)
        )  # bf16 and fp16 records compute in their dtype, through oneDNN
        matmuls = _record_matmuls(layer, integer, not cpu_kernels, dtype, bucketed)
        plans.append(ExpertsPlan(layer, integer, preparer, one_token_off, isa, bucketed_rows=bucketed, matmuls=matmuls))
    return plans


def loops_variant(fmt: QuantFormat, matrices) -> str:
    """The variant(s) of the int8-activation loops that the [N, K] `matrices` of `fmt` run, as the C++'s
    dispatch decides (native/lowbit_dot.h, `int4_variant` / `int8_variant`): one name, or several joined."""
    ext = fused_build.extension()
    names = {ext.lowbit_variant(fmt.bits, fmt.group_size or 0, k) for _, k in matrices}
    return ", ".join(sorted(names))


# -- the resident linears ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinearPlan:
    """How one resident quantized linear computes: its format's kernel, with int8 activations or not."""

    fmt: QuantFormat
    int8_activations: bool = False
    compiled: int | None = None  # the C++'s code for `matmul` (kernels.compiled_kernel; None: the C++ does not run it)
    isa: str | None = None  # the int8-activation loops' variant it runs (None: float activations)
    matmul: object = None  # (x, qweight, params) -> y: its kernel, bound at load (kernels.matmul_kernel)


def plan_linears(model: nn.Module, int8_activations: bool, cpu_kernels: bool, dtype: torch.dtype = torch.float32) -> None:
    """Give every QuantizedLinear of `model` its plan: int8 activations where asked for, on the CPU's
    kernels, and its matrix fits them; its kernel bound for the model's compute `dtype`."""
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            fmt = module.fmt
            n, k = module.out_features, module.in_features
            integer = int8_activations and cpu_kernels and int8_activations_fit(fmt, n, k)
            isa = loops_variant(fmt, [(n, k)]) if integer else None
            matmul = kernels.matmul_kernel(fmt, integer, not cpu_kernels, dtype, k)
            compiled = kernels.compiled_kernel(matmul) if cpu_kernels and compiled_format(fmt, integer) is None else None
            module.plan = LinearPlan(fmt, integer, compiled, isa, matmul)

"""`moestream bench --kernels`: each experts matmul a store's shapes need, timed on this machine against its
memory bandwidth (what llama.cpp's `test-backend-ops perf` tells of its kernels).

A decode step multiplies one token by every matrix it touches once, so each matmul streams its weights
from memory and its speed is bounded by the memory bandwidth: the share of it a kernel reaches says how
much faster it could get. Each distinct (format, rows, columns) of the store's expert records is timed with
the kernels the engine would run (the int8-activation kernels on the bytes as stored, where they fit; torch's
own kernel on its layout, where it has one; a float matmul for float records), on random weights of the
record's layout, one token of random activations, over enough copies that the weights come from memory, not
from the CPU's caches. The bandwidth is torch's sum over a buffer as large, on the same threads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..conversion.store import DTYPES, Store
from .compute import kernels, plan

ROTATION_BYTES = 1 << 30  # weights cycled through per kernel: above any CPU's last-level cache here (480 MiB)
MAX_COPIES = 4096  # tiny matrices: enough calls to time, without a Python loop of millions
ROUNDS = 3  # passes over the copies; the fastest counts (the machine is shared and noisy)


@dataclass
class KernelTiming:
    kernel: str  # what ran: "int8 activations", "torch int4 kernel", "float matmul", ...
    format: str  # the record's format ("float" for float records)
    shape: tuple[int, int]  # (N, K): the matrix's rows and columns (K the input width)
    weight_bytes: int  # the matrix's bytes, scales included: what one call streams
    microseconds: float  # per call, one token
    gb_per_second: float  # weight_bytes / time
    share_of_memory: float  # of the machine's measured memory bandwidth


@dataclass
class KernelReport:
    store: str
    threads: int
    memory_gb_per_second: float
    rotation_bytes: int
    kernels: list[KernelTiming]

    def table(self) -> str:
        lines = [
            f"store {self.store}; {self.threads} threads; memory bandwidth (torch's sum over "
            f"{self.rotation_bytes / 2**30:.2f} GiB): {self.memory_gb_per_second:.1f} GB/s",
            f"{'kernel':<26} {'format':<14} {'N x K':>12} {'MB':>7} {'us/call':>9} {'GB/s':>7} {'of memory':>9}",
        ]
        for k in self.kernels:
            lines.append(
                f"{k.kernel:<26} {k.format:<14} {f'{k.shape[0]}x{k.shape[1]}':>12} {k.weight_bytes / 1e6:>7.2f} "
                f"{k.microseconds:>9.1f} {k.gb_per_second:>7.1f} {k.share_of_memory:>9.0%}"
            )
        return "\n".join(lines)


def memory_bandwidth(nbytes: int = ROTATION_BYTES) -> float:
    """Bytes/s of torch's float32 sum over `nbytes` (the fastest of ROUNDS), on torch's threads."""
    buffer = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    return buffer.numel() * 4 / (kernels.fastest_ms(buffer.sum, ROUNDS) / 1e3)


# The int8 peak's matmul: [M, K] x [K, N], large enough that torch's int8 GEMM (oneDNN: AMX tiles or
# VNNI where the CPU has them) runs at its best, small enough to time in a second on two cores.
PEAK_SHAPE = (1024, 4096, 4096)


def int8_peak_ops_per_second(shape: tuple[int, int, int] = PEAK_SHAPE) -> float | None:
    """This CPU's int8 matmul speed on torch's threads, in ops/s (a multiply and an add count two): torch's
    own int8 GEMM (`torch._int_mm`, int8 x int8 -> int32) on random matrices, the fastest of ROUNDS. It is
    the yardstick a prefill's matmuls are held against; None where torch has no int8 matmul on this CPU."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=g)
    try:
        torch._int_mm(a, b)
    except (RuntimeError, NotImplementedError):
        return None
    return 2 * m * k * n / (kernels.fastest_ms(lambda: torch._int_mm(a, b), ROUNDS) / 1e3)


def expert_matrix_weights(layer) -> int:
    """Weights one expert of `layer` multiplies a token by (rows x columns over its matrices)."""
    return sum(rows * cols for _, (rows, cols) in _matrices(layer))


def time_kernels(store_dir, rotation_bytes: int = ROTATION_BYTES) -> KernelReport:
    """Every distinct expert matrix of the store, timed with each kernel the engine may run it with."""
    store = Store(store_dir)
    bandwidth = memory_bandwidth(rotation_bytes)
    seen, timings = set(), []
    for layer in store.manifest.layers:
        for name, shape in _matrices(layer):
            label = _format_label(layer, name)
            if (label, shape) in seen:
                continue
            seen.add((label, shape))
            for kernel, record, call in _variants(layer, name, shape):
                timings.append(_time(kernel, label, shape, record, call, rotation_bytes, bandwidth))
    return KernelReport(str(store_dir), torch.get_num_threads(), bandwidth / 1e9, rotation_bytes, timings)


def _matrices(layer) -> list[tuple[str, tuple[int, int]]]:
    """(matrix name, (N, K)) of a record: its quantized matrices, or its float weights (2-D, no biases)."""
    if layer.quantization is not None:
        names = [t.name.removesuffix(".qweight") for t in layer.layout.tensors if t.name.endswith(".qweight")]
        return list(zip(names, layer.quantized_matrices))
    return [(t.name, tuple(t.shape)) for t in layer.layout.tensors if len(t.shape) == 2]


def _format_label(layer, name: str) -> str:
    """The matrix's storage: "int4-g64", "int8", or a float record's dtype."""
    fmt = layer.quantization
    if fmt is None:
        return next(t.dtype for t in layer.layout.tensors if t.name == name)
    return fmt.name if fmt.name == "int8" else f"{fmt.name}-g{fmt.group_size}"


def _random_record(layer) -> dict[str, torch.Tensor]:
    """A record of the layer's layout with random contents (codes over their whole range, small scales)."""
    g = torch.Generator().manual_seed(0)
    record = {}
    for t in layer.layout.tensors:
        dtype = DTYPES[t.dtype]
        if dtype in (torch.uint8, torch.int8):
            low, high = (0, 256) if dtype == torch.uint8 else (-127, 128)
            record[t.name] = torch.randint(low, high, t.shape, dtype=dtype, generator=g)
        else:
            record[t.name] = (torch.rand(t.shape, generator=g) * 0.02 + 0.001).to(dtype)
    return record


def _variants(layer, name: str, shape: tuple[int, int]):
    """(kernel name, the matrix's tensors, call(x, tensors)) for each kernel the engine may run it with."""
    fmt = layer.quantization
    record = _random_record(layer)
    if fmt is None:
        weight = record[name]
        yield "float matmul", {name: weight}, lambda x, w: F.linear(x.to(weight.dtype), w[name])
        return
    n, k = shape
    stored = {part: record[f"{name}.{part}"] for part in ("qweight", fmt.params)}
    if plan.int8_activations_fit(fmt, n, k):
        yield "int8 activations", stored, lambda x, w: kernels.quantized_matmul(x, w["qweight"], w[fmt.params], fmt, True)
    if fmt.torch_kernel and fmt.portable:
        prepared = kernels.cpu_record({f"{name}.{p}": t for p, t in stored.items()}, fmt)
        torch_layout = {p: prepared[f"{name}.{p}"] for p in stored}
        label = f"torch {fmt.name} kernel"
        yield label, torch_layout, lambda x, w: kernels.quantized_matmul(x, w["qweight"], w[fmt.params], fmt, False)


def _time(kernel: str, fmt: str, shape, record: dict, call, rotation_bytes: int, bandwidth: float) -> KernelTiming:
    """One call's time over `record`'s copies cycled through (the fastest of ROUNDS passes, after an untimed
    one: the compiled kernels' load and first-call costs left out), its rate and its share of `bandwidth`."""
    nbytes = sum(t.numel() * t.element_size() for t in record.values())
    copies = max(1, min(MAX_COPIES, rotation_bytes // max(1, nbytes)))
    pool = [{p: t.clone() for p, t in record.items()} for _ in range(copies)]
    x = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def one_pass() -> None:
        for w in pool:
            call(x, w)

    with torch.inference_mode():
        seconds = kernels.fastest_ms(one_pass, ROUNDS) / 1e3 / copies
    rate = nbytes / seconds
    return KernelTiming(kernel, fmt, tuple(shape), nbytes, seconds * 1e6, rate / 1e9, rate / bandwidth)

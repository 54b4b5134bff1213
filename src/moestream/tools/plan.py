"""`moestream plan`: what a model costs before it is downloaded, from its config.json alone.

The byte counts are exact, not estimated: transformers builds the model from the config on the meta
device (no memory), and the sizes come from the same code the converter uses to lay records out
(`skeleton.expert_parameters`, `quant.expert_record_specs`, `store.RecordLayout`), so `plan` and
`inspect` on the converted store agree to the byte (tests/test_plan.py).

The speed is a forecast. Per decoded token:
    read time    = expert bytes missed per token / disk bandwidth
    compute time = what one token costs with every expert cached
    serial       = read + compute   (the runtime reads a layer's misses only once its router has run,
                                     and the next layer waits for them: this is the expected figure)
    overlapped   = max(read, compute)  (the bound if reads were perfectly hidden behind compute)
The hit rate comes from a trace replayed through the real cache (simulate.py) when one is given, else
from a stated prior: routing as uniform as a random model's (hit rate = cached share of experts).
Compute is given (`--compute MS`) or measured on this machine (`--compute measure`): the model's config
cut after its first and after its fourth MoE layer, random weights, converted at the planned format,
decoded with every expert cached; the difference gives one MoE layer's cost, extrapolated to the depth.
Without either, compute is bounded below by streaming the active weights at the measured memory
bandwidth, which makes the forecast an upper bound on tokens/s.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..choices import GPU_HEADROOM, PLAN_OVERHEAD
from ..conversion.quant import group_for
from ..conversion.sizes import ModelSizes, expert_format
from ..conversion.skeleton import build_skeleton, experts_modules, model_dtype
from ..core.supply.policies import DEFAULT_POLICY
from ..errors import UsageError
from ..units import format_bytes, parse_bytes

# Besides resident weights and the expert cache a process holds the Python/torch/transformers runtime
# (about 330-370 MiB measured; docs/BENCHMARKS.md), activations and the KV cache of a short context.
DISK_PROBE_BYTES = 256 * 2**20


def read_config(path: str | os.PathLike):
    """A transformers config from a config.json file, a checkpoint directory or a store directory."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json" if (path / "manifest.json").is_file() else path / "config.json"
    if not path.is_file():
        raise UsageError(f"{path} does not exist; pass a config.json, a checkpoint directory or a store")
    try:
        raw = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({e})") from None
    if path.name == "manifest.json" and isinstance(raw, dict):
        raw = raw.get("model_config")
    if not isinstance(raw, dict):
        raise UsageError(f"{path} is not a JSON object")
    raw = dict(raw)
    # The store holds decoded experts and resident floats, whatever format the checkpoint ships (FP8,
    # MXFP4): the source's quantization does not shape the model moestream builds.
    raw.pop("quantization_config", None)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise UsageError(f"{path}: model_type {model_type!r} is not known to this transformers version; upgrade transformers")
    if "auto_map" in raw:
        raise UsageError(f"{path} names custom modeling code (auto_map); moestream runs only transformers' own model definitions")
    try:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    except Exception as e:  # config classes validate with their own error types
        raise UsageError(f"{path} is not a valid {model_type} config ({e})") from None


# -- machine measurements ---------------------------------------------------------------------------------


def measure_disk_reads(
    directory: str | os.PathLike,
    stride_bytes: int,
    top_k: int,
    threads: int = 4,
    probe_bytes: int = DISK_PROBE_BYTES,
    rounds: int = 40,
) -> dict[int, float]:
    """Seconds to read m random records issued together and all waited for, m = 1..top_k: what one decode
    call with m misses waits for (the engine's reader, `threads` I/O threads, O_DIRECT).

    Measured on a temporary file written in `directory`, flushed to disk and dropped from the page cache
    first, so the reads come from the device. Small records are dominated by latency, not bandwidth: a
    few reads issued together run far below what a deep queue of the same reads reaches, and decoding
    never has that deep a queue (docs/DECISIONS.md, "The I/O floor from the run's own reads"). A filesystem
    that refuses O_DIRECT (tmpfs) would measure memory, so it is refused."""
    from ..core.supply.reader import RecordReader

    record = max(4096, min(stride_bytes, 64 * 2**20))
    count = max(4 * top_k, probe_bytes // record)
    fd, name = tempfile.mkstemp(prefix=".moestream-disk-probe-", dir=directory)
    try:
        block, left = os.urandom(2**20), count * record
        with os.fdopen(fd, "wb") as f:
            while left > 0:
                left -= f.write(block[: min(left, len(block))])
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        rng = random.Random(0)
        buffers = [mmap.mmap(-1, record) for _ in range(top_k)]
        reader = RecordReader([Path(name)], threads, direct=True)
        try:
            if not reader.direct:
                raise UsageError(
                    f"{directory} does not support O_DIRECT reads (tmpfs?), so a probe would measure memory; "
                    "pass --disk-bandwidth with the disk's speed, e.g. 3GB/s"
                )
            times: dict[int, list[float]] = {m: [] for m in range(1, top_k + 1)}
            budget = max(rounds, count // max(1, top_k))  # read about the whole file once, spread over m
            for n in range(budget):
                m = 1 + n % top_k
                offsets = rng.sample(range(count), m)
                start = time.perf_counter()
                futures = [reader.submit(0, o * record, record, memoryview(buffers[i])) for i, o in enumerate(offsets)]
                for future in futures:
                    future.result()
                times[m].append(time.perf_counter() - start)
            return {m: float(np.median(t)) for m, t in times.items()}
        finally:
            reader.close()
    finally:
        os.unlink(name)


def measure_memory_bandwidth(nbytes: int = 256 * 2**20) -> float:
    """Bytes/s of summing a large bf16 tensor (best of 3): how fast this machine streams weights."""
    x = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def parse_bandwidth(text: str) -> float:
    """ "3GB/s", "1.5GiB/s", "800MB/s" -> bytes/s."""

    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2]
    try:
        value = parse_bytes(body)
    except UsageError:
        raise UsageError(f"cannot read the bandwidth {text!r}: write e.g. 3GB/s or 1.5GiB/s, or auto") from None
    if value <= 0:
        raise UsageError(f"the bandwidth must be positive: {text!r}")
    return float(value)


def _reduced_config(config, moe_layers: int):
    """The config cut after its `moe_layers`-th MoE layer (per-layer lists cut to match)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model = build_skeleton(config, torch.float32)
    indices = sorted({int(n.split(".layers.")[1].split(".")[0]) for n, _ in experts_modules(model) if ".layers." in n})
    if len(indices) < moe_layers:
        raise UsageError(f"cannot measure compute: the model has {len(indices)} MoE layers")
    n, keep = config.num_hidden_layers, indices[moe_layers - 1] + 1
    raw = config.to_dict()
    for key, value in list(raw.items()):
        if isinstance(value, list) and len(value) == n:
            raw[key] = value[:keep]
    raw["num_hidden_layers"] = keep
    for key in ("quantization_config", "_experts_implementation", "architectures"):
        raw.pop(key, None)
    return CONFIG_MAPPING[config.model_type].from_dict(raw), len(indices)


def measure_compute(
    config, bits: int, group_size: int | None = None, tokens: int = 24, workdir=None, dense_dtype: str = "float"
) -> dict:
    """Seconds per decoded token with every expert cached, for the whole model, measured on this machine.

    Builds the config cut after its first MoE layer and after its fourth (or last), with random weights,
    converts each at the planned expert format and decodes `tokens` tokens greedily after a pass that
    fills the cache (best of three: the machine may be shared). The difference is what MoE layers cost;
    per-token time = base + moe_layers x per-layer cost.

    Also measured, on the deeper cut: what a miss costs the model thread beyond waiting for its read
    (submitting it, the I/O threads' CPU and GIL time on a two-core box, allocating and evicting a slot,
    viewing the bytes), by decoding again with a cache of one layer's experts: (time per token - time
    waiting for reads - all-hits time) / misses per token. For small experts this is of the order of the
    reads themselves (docs/DECISIONS.md, "plan: a miss costs the model thread besides its read")."""
    from transformers import AutoModelForCausalLM

    from ..conversion.convert import convert
    from ..conversion.synthetic import save_checkpoint
    from ..core.loading import close, load
    from ..generation.serving import timed

    _, _, name = expert_format(bits, group_for(f"int{bits}", group_size))
    _, total_moe = _reduced_config(config, 1)
    depths = sorted({1, min(4, total_moe)})
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="moestream-plan-", dir=workdir) as tmp:
        for m in depths:
            small, _ = _reduced_config(config, m)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(small, dtype=model_dtype(config)).eval()
            ckpt = save_checkpoint(model, Path(tmp) / f"hf{m}")
            del model
            store = convert(
                ckpt,
                Path(tmp) / f"store{m}",
                "bf16" if bits == 16 else f"int{bits}",
                group_size=group_size,
                dense_dtype=dense_dtype,
                progress=False,
            )
            sizes = ModelSizes.of_config(small, bits, group_size, dense_dtype)
            loaded, _ = load(store, sizes.all_experts_budget)
            ids = torch.randint(0, int(small.vocab_size), (1, 8), generator=torch.Generator().manual_seed(0))
            timed(loaded, ids, tokens)  # fills the cache with every expert these tokens need
            seconds[m] = min(1.0 / timed(loaded, ids, tokens).decode_tokens_per_second for _ in range(3))
            close(loaded)
            if m == depths[-1]:
                miss_cost = _miss_cost(store, sizes, ids, tokens, seconds[m])
    first, last = depths[0], depths[-1]
    layer = max(0.0, (seconds[last] - seconds[first]) / (last - first)) if last > first else 0.0
    return {
        "seconds_per_token": seconds[first] + (total_moe - first) * layer,
        "measured": {m: seconds[m] for m in depths},
        "per_moe_layer": layer,
        "format": name,
        "seconds_per_miss": miss_cost,
    }


def _miss_cost(store, sizes: ModelSizes, ids, tokens: int, all_hits_seconds: float) -> float:
    """Model-thread seconds a miss costs besides the wait for its read (best of three decodes)."""
    from .bench import run_moestream

    best = float("inf")
    for _ in range(3):
        run, _ = run_moestream(store, sizes.minimum_budget, ids, tokens, "misses", prefetch="off")
        steps = max(1, tokens - 1)
        misses = run.decode_bytes_read / sizes.stride_bytes / steps
        if misses:
            best = min(best, (run.seconds_per_token - run.decode_wait_seconds / steps - all_hits_seconds) / misses)
    return max(0.0, best) if best != float("inf") else 0.0


# -- the plan --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    sizes: ModelSizes
    memory_bytes: int
    overhead_bytes: int
    cache_bytes: int  # what the budget leaves for the expert cache (may be negative: does not fit)
    disk_bandwidth: float | None
    disk_source: str
    hit_rates: dict[str, float] = field(default_factory=dict)  # policy -> hit rate (trace), or {"prior": x}
    hit_source: str = ""
    bytes_missed_per_token: float = 0.0
    compute_seconds: float | None = None
    compute_source: str = ""
    policy: str = DEFAULT_POLICY
    notes: list[str] = field(default_factory=list)
    miss_calls_per_token: dict[int, float] = field(default_factory=dict)  # m -> layer calls per token missing m experts
    read_batches: dict[int, float] | None = None  # m -> measured seconds to read m records at once
    miss_seconds: float = 0.0  # model-thread cost of one miss besides waiting for its read (measured)

    @property
    def fits(self) -> bool:
        return self.cache_bytes >= self.sizes.minimum_budget

    @property
    def minimum_memory(self) -> int:
        return self.sizes.resident_bytes + self.overhead_bytes + self.sizes.minimum_budget

    @property
    def cache_slots(self) -> int:
        return self.sizes.cache_slots(self.cache_bytes)

    @property
    def read_seconds(self) -> float | None:
        """Read time per token. Measured batches: each layer call waits for its m misses, read together.
        A given bandwidth: bytes / bandwidth (no latency, so an optimistic figure for small records)."""
        if self.read_batches:
            top = max(self.read_batches)
            return sum(
                n * (self.read_batches.get(m) or self.read_batches[top] * m / top)
                for m, n in self.miss_calls_per_token.items()
                if m
            )
        if self.disk_bandwidth is None:
            return None
        return self.bytes_missed_per_token / self.disk_bandwidth

    @property
    def misses_per_token(self) -> float:
        return sum(m * n for m, n in self.miss_calls_per_token.items())

    def tokens_per_second(self) -> tuple[float, float] | None:
        """(serial, overlapped): the expected rate and the bound with reads fully hidden. Both carry each
        miss's own CPU cost (`miss_seconds`): hiding a read's latency does not hide that."""
        if self.read_seconds is None or self.compute_seconds is None:
            return None
        compute = self.compute_seconds + self.misses_per_token * self.miss_seconds
        serial = self.read_seconds + compute
        overlapped = max(self.read_seconds, compute)
        return 1.0 / serial if serial else float("inf"), 1.0 / overlapped if overlapped else float("inf")

    def to_json(self) -> dict:
        s = self.sizes
        rates = self.tokens_per_second()
        return {
            "model_type": s.model_type,
            "expert_format": s.expert_format,
            "resident_bytes": s.resident_bytes,
            "expert_bytes": s.expert_payload_bytes,
            "experts": s.experts,
            "moe_layers": s.moe_layers,
            "top_k": s.top_k,
            "record_bytes": s.stride_bytes,
            "weights_per_expert": s.weights_per_expert,
            "nominal_bytes_per_expert": s.nominal_bytes_per_expert,
            "reads_per_token": s.experts_per_token,
            "worst_case_bytes_per_token": s.worst_case_bytes_per_token,
            "memory_bytes": self.memory_bytes,
            "overhead_bytes": self.overhead_bytes,
            "cache_bytes": self.cache_bytes,
            "cache_slots": self.cache_slots,
            "fits": self.fits,
            "minimum_memory_bytes": self.minimum_memory,
            "policy": self.policy,
            "hit_rates": self.hit_rates,
            "hit_source": self.hit_source,
            "bytes_missed_per_token": self.bytes_missed_per_token,
            "disk_bandwidth": self.disk_bandwidth,
            "disk_source": self.disk_source,
            "read_batches_seconds": self.read_batches,
            "miss_calls_per_token": self.miss_calls_per_token,
            "read_seconds_per_token": self.read_seconds,
            "compute_seconds_per_token": self.compute_seconds,
            "compute_source": self.compute_source,
            "miss_seconds": self.miss_seconds,
            "misses_per_token": self.misses_per_token,
            "tokens_per_second": {"expected": rates[0], "overlapped_bound": rates[1]} if rates else None,
            "notes": self.notes,
        }

    def table(self, title: str) -> str:
        s = self.sizes
        gib = s.nominal_bytes_per_expert
        rows = [
            ("model", f"{title} ({s.model_type}), resident weights in {s.dtype}, experts as {s.expert_format}"),
            ("resident weights", format_bytes(s.resident_bytes)),
            (
                "experts",
                f"{format_bytes(s.expert_payload_bytes)} in {s.experts} records ({s.moe_layers} MoE layers x {s.experts_per_layer})",
            ),
            (
                "per expert",
                f"{format_bytes(s.stride_bytes)} as stored ({s.weights_per_expert / 1e6:.1f}M weights; "
                f"{format_bytes(gib)} at {s.bits} bits without scales)",
            ),
            ("expert reads per token", f"{s.experts_per_token} ({s.top_k} per layer x {s.moe_layers} layers)"),
            (
                "worst case per token",
                f"{format_bytes(s.worst_case_bytes_per_token)} read (every expert a miss; "
                f"{format_bytes(gib * s.experts_per_token)} at {s.bits} bits without scales)",
            ),
            (
                "memory",
                f"{format_bytes(self.memory_bytes)} = resident + {format_bytes(self.overhead_bytes)} runtime overhead + expert cache",
            ),
        ]
        if not self.fits:
            rows.append(
                (
                    "DOES NOT FIT",
                    f"the resident weights and the runtime take {format_bytes(s.resident_bytes + self.overhead_bytes)}, "
                    f"and the cache needs at least {format_bytes(s.minimum_budget)} ({s.top_k} experts): "
                    f"the minimum is --memory {format_bytes(self.minimum_memory).replace(' ', '')}",
                )
            )
            return _rows(rows + [("note", n) for n in self.notes])
        rows.append(
            (
                "expert cache",
                f"{format_bytes(self.cache_bytes)}: {self.cache_slots} experts ({min(1.0, self.cache_slots / s.experts):.1%} of all)",
            )
        )
        rates = ", ".join(f"{p} {h:.1%}" for p, h in self.hit_rates.items())
        rows.append(("expected hit rate", f"{rates} ({self.hit_source})"))
        rows.append(("expected read per token", f"{format_bytes(self.bytes_missed_per_token)} ({self.policy})"))
        if self.disk_bandwidth is not None:
            rows.append(("disk", f"{self.disk_bandwidth / 1e9:.2f} GB/s ({self.disk_source})"))
            if self.read_batches:
                batches = ", ".join(f"{m}: {t * 1e3:.2f} ms" for m, t in self.read_batches.items())
                rows.append(("reads of a layer call", f"{batches} (m records read together)"))
            calls = sum(n for m, n in self.miss_calls_per_token.items() if m)
            rows.append(("reads per token", f"{self.read_seconds * 1e3:.1f} ms ({calls:.1f} layer calls with misses per token)"))
        if self.compute_seconds is not None:
            rows.append(("compute, all hits", f"{self.compute_seconds * 1e3:.1f} ms per token ({self.compute_source})"))
            if self.miss_seconds:
                rows.append(
                    (
                        "cost of a miss",
                        f"{self.miss_seconds * 1e3:.2f} ms of CPU besides its read (measured here), x {self.misses_per_token:.1f} "
                        f"misses per token = {self.misses_per_token * self.miss_seconds * 1e3:.1f} ms",
                    )
                )
        rates = self.tokens_per_second()
        if rates:
            rows.append(
                (
                    "expected decode",
                    f"{rates[0]:.2f} tokens/s (reads then compute), up to {rates[1]:.2f} if reads were fully hidden",
                )
            )
        return _rows(rows + [("note", n) for n in self.notes])


def _rows(rows) -> str:
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"  {name:<{width}}  {value}" for name, value in rows)


def make_plan(
    sizes: ModelSizes,
    memory: int,
    *,
    overhead: int,
    trace=None,
    policy: str = DEFAULT_POLICY,
    disk_bandwidth: float | None = None,
    disk_source: str = "",
    read_batches: dict[int, float] | None = None,
    compute_seconds: float | None = None,
    compute_source: str = "",
) -> Plan:
    plan = Plan(
        sizes,
        memory,
        overhead,
        memory - sizes.resident_bytes - overhead,
        disk_bandwidth,
        disk_source,
        compute_seconds=compute_seconds,
        compute_source=compute_source,
        policy=policy,
        read_batches=read_batches,
    )
    if not plan.fits:
        return plan
    slots = plan.cache_slots
    if trace is not None:
        from .simulate import BELADY, replay

        shape = (trace.layers, int(trace.layer_experts.max()), trace.top_k)
        if shape != (sizes.moe_layers, sizes.experts_per_layer, sizes.top_k):
            raise UsageError(
                f"the trace is of a model with {shape[0]} MoE layers x {shape[1]} experts, top-{shape[2]}; this config has "
                f"{sizes.moe_layers} x {sizes.experts_per_layer}, top-{sizes.top_k}: record a trace of this model"
            )
        strides = np.array(sizes.layer_stride_bytes, dtype=np.int64)
        results = {
            p: replay(trace, max(slots, trace.top_k), p, strides) for p in dict.fromkeys([policy, "lru", "lfu", "arc", BELADY])
        }
        decode = results[policy].decode_tokens > 0  # the forecast is of decoding: prompt calls are left out
        plan.hit_rates = {p: r.decode_hit_rate if decode else r.hit_rate for p, r in results.items()}
        what = f"{results[policy].decode_tokens} decoded tokens" if decode else f"{trace.tokens} tokens"
        plan.hit_source = f"replayed from the trace: {what}, {slots} slots"
        plan.bytes_missed_per_token = results[policy].decode_bytes_per_token if decode else results[policy].bytes_per_token
        r = results[policy]
        if decode:
            plan.miss_calls_per_token = {m: n / r.decode_tokens for m, n in enumerate(r.decode_miss_calls)}
        else:  # no decode calls in the trace: spread its misses as evenly as the layers allow
            per_call = r.misses / max(1, trace.calls)
            plan.miss_calls_per_token = {max(1, round(per_call)): sizes.moe_layers * min(1.0, per_call)}
    else:
        share = min(1.0, slots / sizes.experts)
        plan.hit_rates = {"prior": share}
        plan.hit_source = (
            "prior: uniform routing, hit rate = cached share of experts; trained models route more concentrated, pass --trace"
        )
        plan.bytes_missed_per_token = (1 - share) * sizes.experts_per_token * sizes.stride_bytes
        k = sizes.top_k  # each of a layer's k experts misses independently: binomial misses per call
        plan.miss_calls_per_token = {
            m: sizes.moe_layers * math.comb(k, m) * (1 - share) ** m * share ** (k - m) for m in range(k + 1)
        }
    return plan


def bandwidth_compute_bound(sizes: ModelSizes, memory_bandwidth: float) -> float:
    """Seconds per token to stream the weights one token touches once: the resident weights but the input
    embedding (one row of it is read), and its experts. A lower bound on compute for large models; small
    models spend far longer in per-layer overheads."""
    active = sizes.resident_bytes - sizes.embedding_bytes + sizes.top_k * sum(sizes.layer_payload_bytes)
    return active / memory_bandwidth


def plan_from_args(
    path: str,
    memory: str,
    *,
    cache: str | None = None,
    bits: int = 16,
    group_size: int | None = None,
    dense_dtype: str = "float",
    overhead: str = PLAN_OVERHEAD,
    trace_path: str | None = None,
    policy: str = DEFAULT_POLICY,
    disk_bandwidth: str | None = None,
    disk_dir: str = ".",
    compute: str = "bandwidth",
    io_threads: int = 4,
) -> tuple[Plan, str]:
    """What `moestream plan` does: sizes, then the cache, hit rate, disk and compute it was asked for."""
    from ..core.supply.policies import policy_class
    from .trace import Trace

    policy_class(policy)  # an unknown name fails before any work
    config = read_config(path)
    sizes = ModelSizes.of_config(config, bits, group_size, dense_dtype)
    title = Path(path).parent.name if Path(path).name == "config.json" else Path(path).name.removesuffix(".json")
    memory_bytes, overhead_bytes = parse_bytes(memory), parse_bytes(overhead)
    if cache is not None:  # the cache budget itself: the memory is what it implies
        memory_bytes = sizes.resident_bytes + overhead_bytes + parse_bytes(cache)
    if memory_bytes - sizes.resident_bytes - overhead_bytes < sizes.minimum_budget:  # nothing to measure
        return make_plan(sizes, memory_bytes, overhead=overhead_bytes, policy=policy), title
    notes = []
    disk, disk_source, batches = None, "", None
    if disk_bandwidth == "auto":
        batches = measure_disk_reads(disk_dir, sizes.stride_bytes, sizes.top_k, io_threads)
        disk = sizes.top_k * min(sizes.stride_bytes, 64 * 2**20) / batches[sizes.top_k]
        disk_source = (
            f"measured: {sizes.top_k} random {format_bytes(min(sizes.stride_bytes, 64 * 2**20))} O_DIRECT reads at once "
            f"on {io_threads} threads, temporary file in {Path(disk_dir).resolve()}"
        )
    elif disk_bandwidth:
        disk, disk_source = parse_bandwidth(disk_bandwidth), "given"
    else:
        notes.append("no tokens/s forecast without a disk speed: pass --disk-bandwidth 3GB/s (or auto to measure the disk here)")
    seconds, source, miss_seconds = None, "", 0.0
    if compute == "measure":
        measured = measure_compute(config, bits, group_size, dense_dtype=dense_dtype)
        seconds, miss_seconds = measured["seconds_per_token"], measured["seconds_per_miss"]
        source = "measured here: " + ", ".join(
            f"{t * 1e3:.1f} ms with {m} MoE layer{'s' if m > 1 else ''}" for m, t in measured["measured"].items()
        )
        source += f", extrapolated to {sizes.moe_layers}"
    elif compute == "bandwidth":
        bandwidth = measure_memory_bandwidth()
        seconds = bandwidth_compute_bound(sizes, bandwidth)
        source = (
            f"lower bound: the active weights streamed once at {bandwidth / 1e9:.1f} GB/s memory bandwidth; per-layer "
            "overheads come on top (small models are far slower), use --compute measure"
        )
    elif compute != "none":
        try:
            seconds, source = float(compute) / 1e3, "given"
        except ValueError:
            raise UsageError(f"--compute {compute!r}: write measure, bandwidth, none or milliseconds per token") from None
    trace = Trace.load(trace_path) if trace_path else None
    plan = make_plan(
        sizes,
        memory_bytes,
        overhead=overhead_bytes,
        trace=trace,
        policy=policy,
        disk_bandwidth=disk,
        disk_source=disk_source,
        read_batches=batches,
        compute_seconds=seconds,
        compute_source=source,
    )
    plan.miss_seconds = miss_seconds
    plan.notes += notes
    return plan, title


#: VRAM beyond the resident weights and the expert cache that a --gpu plan sets aside: what a GPU run keeps.
GPU_OVERHEAD = GPU_HEADROOM


def gpu_split(sizes: ModelSizes, gpu_bytes: int, memory_bytes: int, overhead_bytes: int) -> dict:
    """How a --device cuda run splits: VRAM = resident + GPU_OVERHEAD + VRAM expert cache; RAM = the
    runtime overhead + the host expert cache (the resident weights live on the GPU)."""
    vram_cache = gpu_bytes - sizes.resident_bytes - GPU_OVERHEAD
    host_cache = memory_bytes - overhead_bytes
    return {
        "gpu_bytes": gpu_bytes,
        "fits": vram_cache >= sizes.minimum_budget and host_cache >= sizes.minimum_budget,
        "minimum_gpu_bytes": sizes.resident_bytes + GPU_OVERHEAD + sizes.minimum_budget,
        "vram_cache_bytes": max(0, vram_cache),
        "vram_cache_experts": min(sizes.experts, sizes.cache_slots(max(0, vram_cache))),
        "host_cache_bytes": max(0, host_cache),
        "host_cache_experts": min(sizes.experts, sizes.cache_slots(max(0, host_cache))),
    }


def gpu_text(split: dict, sizes: ModelSizes) -> str:
    if not split["fits"]:
        return (
            f"with --device cuda on {format_bytes(split['gpu_bytes'])} of VRAM: DOES NOT FIT; the resident weights "
            f"({format_bytes(sizes.resident_bytes)}), {format_bytes(GPU_OVERHEAD)} for KV cache and activations and the "
            f"smallest expert cache need {format_bytes(split['minimum_gpu_bytes'])} of VRAM (and --memory must leave "
            f"{format_bytes(sizes.minimum_budget)} for the host cache)"
        )
    return (
        f"with --device cuda on {format_bytes(split['gpu_bytes'])} of VRAM: resident weights {format_bytes(sizes.resident_bytes)} "
        f"+ {format_bytes(GPU_OVERHEAD)} KV cache and activations + --gpu-memory {format_bytes(split['vram_cache_bytes'])} "
        f"({split['vram_cache_experts']} experts) in VRAM; --memory {format_bytes(split['host_cache_bytes'])} "
        f"({split['host_cache_experts']} experts) of page-locked RAM below it"
    )

"""`moestream bench`: how close decoding runs to the disk's speed limit, measured in one run.

When most of a model lives on disk, a token costs the expert bytes that miss the cache divided by the
disk's bandwidth, plus the compute that is not hidden behind those reads. This module measures both
sides in the same run and on the same files, and reports their ratio:

- disk bandwidth: the run's own decode reads replayed right after it (same records, same order, the
  same batches of one layer call's misses, O_DIRECT, the engine's reader and thread count), so the floor
  is what this disk gives for exactly these bytes, not a datasheet or a deep-queue probe;
- all-hits compute per token, measured: with a budget that holds every expert when the experts fit in
  memory; otherwise on the steps of a short pass under the run's own budget that missed nothing (the
  same text fed twice, the second time timed step by step); only where no step hit everything,
  estimated as decode time minus the time the model thread waited for reads (and said so);
- two floors per token: serial, missed bytes / that bandwidth + all-hits compute (no read hidden), and
  overlapped, the larger of the two (every read hidden behind compute, or the reverse);
- a third, per decode step: each step's own read bytes at the rate this run's reads had while any was in
  flight, or its all-hits compute, the larger, averaged over the steps. Decoding cannot read a token's
  experts before the token exists, so a step that reads more than its compute can hide is bound by the
  disk whatever the other steps leave idle: on text, steps read from nothing (a repeated token) to several
  times the average, and the averaged floor above is out of any decoder's reach;
- efficiency = floor / measured time per token, against each (1.0 = at that limit).

With `--text` the decode follows the text (teacher forcing: the tokens after the prompt are the text's,
whatever the model says), on moestream and the peers alike, so a synthetic model routes as text does;
without it, random prompt ids and greedy tokens.

`--squeeze` makes the machine behave like a smaller one: a helper process allocates and touches that
much anonymous memory for the duration (there is no swap, so the pages stay resident). `--compare`
runs the peers a user would otherwise use on the same checkpoint, prompt and memory, each in its own
process: transformers fully loaded (the all-hits ceiling, when it fits) and transformers + accelerate
disk offload (`device_map="auto"`, `max_memory`, `offload_folder`); `--compare-gguf` adds llama.cpp
(llama-cpp-python, installed separately) on a GGUF conversion of the same checkpoint, mmap'd: the OS page
cache is its expert cache, so only `--squeeze` gives it the same memory.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from queue import Empty

import torch

from ..conversion.sizes import ModelSizes, routed_top_k
from ..conversion.store import Store
from ..core.kernel_timing import PEAK_SHAPE, KernelReport, expert_matrix_weights, int8_peak_ops_per_second
from ..core.memory import page_cache_bytes, peak_rss_bytes, reset_peak_rss
from ..core.supply.reader import RecordReader
from ..errors import UsageError
from ..generation.generate import Timing
from ..generation.serving import timed
from ..units import format_bytes, parse_bytes


@dataclass
class RunResult:
    """One generation: what a user sees (tokens/s, TTFT) and what explains it (bytes, waits)."""

    name: str
    prompt_tokens: int
    new_tokens: int
    ttft_seconds: float
    decode_tokens_per_second: float
    peak_rss_bytes: int
    hit_rate: float | None = None
    decode_bytes_read: int | None = None
    decode_wait_seconds: float | None = None
    note: str = ""
    fast_paths: str = ""  # moestream's: which fast paths ran and why others did not (core/fastpaths.py)
    read_ahead: dict | None = None  # moestream's: the decode's speculative reads (`read_ahead_of`)
    decode_step_bytes: list[int] | None = None  # moestream's: bytes of the reads each decode step started
    decode_read_busy_seconds: float | None = None  # moestream's: decode time with at least one read in flight
    prefill_bytes_read: int | None = None  # moestream's: expert bytes read before the first token
    matmul_weights_per_token: int | None = None  # moestream's: weights a token is multiplied by

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prompt tokens over the time to the first token (the prompt's one forward pass, and its reads)."""
        return self.prompt_tokens / self.ttft_seconds if self.ttft_seconds else 0.0

    @property
    def prefill_ops_per_second(self) -> float:
        """The prefill's matmul work per second: 2 ops (a multiply and an add) per weight and prompt token."""
        return 2 * (self.matmul_weights_per_token or 0) * self.prefill_tokens_per_second

    @property
    def seconds_per_token(self) -> float:
        return 1.0 / self.decode_tokens_per_second if self.decode_tokens_per_second else float("inf")

    @staticmethod
    def of(name: str, prompt_tokens: int, timing: Timing, peak_rss: int, **measured) -> "RunResult":
        """A run's speeds as generate.Timing defines them (the same for moestream and every peer)."""
        return RunResult(
            name,
            prompt_tokens,
            timing.new_tokens,
            timing.time_to_first_token,
            timing.decode_tokens_per_second,
            peak_rss,
            **measured,
        )


@dataclass
class BenchReport:
    store: str
    memory_bytes: int
    squeeze_bytes: int
    disk_bandwidth_bytes_per_second: float
    moestream: RunResult
    all_hits_seconds_per_token: float
    all_hits_measured: bool  # False: estimated as decode time minus read waits
    all_hits_how: str  # how it was measured (or estimated), in words
    bytes_missed_per_token: float
    floor_seconds_per_token: float  # serial: missed bytes / bandwidth + all-hits compute
    efficiency: float  # floor / measured
    overlapped_floor_seconds_per_token: float  # the larger of the two parts: every read hidden
    overlapped_efficiency: float
    read_busy_bytes_per_second: float  # the decode's read bytes over its time with a read in flight
    per_step_floor_seconds_per_token: float  # mean over decode steps of max(all-hits, step bytes / that rate)
    per_step_efficiency: float
    teacher_forced: bool  # the decode followed --text
    store_page_cache_bytes: int
    peers: list[RunResult] = field(default_factory=list)
    int8_peak_ops_per_second: float | None = None  # this CPU's int8 matmul speed (kernel_timing), None: none

    @property
    def prefill_share_of_int8_peak(self) -> float | None:
        """The prefill's matmul work per second (2 ops per weight and token) over the CPU's int8 peak."""
        r = self.moestream
        if not self.int8_peak_ops_per_second or not r.matmul_weights_per_token:
            return None
        return r.prefill_ops_per_second / self.int8_peak_ops_per_second

    def table(self) -> str:
        r = self.moestream
        lines = [
            f"store {self.store}, --memory {format_bytes(self.memory_bytes)}"
            + (f", squeeze {format_bytes(self.squeeze_bytes)}" if self.squeeze_bytes else ""),
            "disk bandwidth (this run's decode reads replayed, O_DIRECT, in the engine's batches): "
            + (f"{self.disk_bandwidth_bytes_per_second / 1e9:.2f} GB/s" if self.disk_bandwidth_bytes_per_second else "none read"),
            f"decode: {'teacher-forced through --text' if self.teacher_forced else 'greedy after random prompt ids'}",
            f"expert bytes missed per decoded token: {self.bytes_missed_per_token / 1e6:.2f} MB; hit rate {r.hit_rate:.1%}",
            f"all-hits compute per token: {self.all_hits_seconds_per_token * 1e3:.1f} ms ({self.all_hits_how})",
            f"floor per token, reads then compute: {self.floor_seconds_per_token * 1e3:.1f} ms (efficiency {self.efficiency:.2f}); "
            f"reads hidden behind compute: {self.overlapped_floor_seconds_per_token * 1e3:.1f} ms "
            f"(efficiency {self.overlapped_efficiency:.2f}); measured {r.seconds_per_token * 1e3:.1f} ms",
            _per_step_line(self),
            _prefill_line(self),
            f"page cache held by the store after the run: {format_bytes(self.store_page_cache_bytes)}",
            _read_ahead_line(r.read_ahead),
            r.fast_paths,
            "",
            f"{'engine':<34} {'decode tok/s':>12} {'TTFT s':>8} {'peak RSS':>10}  note",
        ]
        for run in [r] + self.peers:
            lines.append(
                f"{run.name:<34} {run.decode_tokens_per_second:>12.2f} {run.ttft_seconds:>8.2f} "
                f"{format_bytes(run.peak_rss_bytes):>10}  {run.note}"
            )
        for peer in self.peers:
            if peer.decode_tokens_per_second:
                lines.append(
                    f"moestream / {peer.name}: {r.decode_tokens_per_second / peer.decode_tokens_per_second:.2f}x decode tokens/s"
                )
        return "\n".join(lines)


def _prefill_line(report: BenchReport) -> str:
    r = report.moestream
    line = (
        f"prefill: {r.prompt_tokens} tokens at {r.prefill_tokens_per_second:.1f} tok/s, {r.prefill_ops_per_second / 1e9:.1f} "
        f"GOP/s of matmuls (2 x {(r.matmul_weights_per_token or 0) / 1e9:.3f} G weights a token)"
    )
    share = report.prefill_share_of_int8_peak
    line += (
        f", {share:.1%} of this CPU's int8 peak ({report.int8_peak_ops_per_second / 1e9:.0f} GOP/s: torch's int8 GEMM "
        f"on {'x'.join(map(str, PEAK_SHAPE))})"
        if share is not None
        else "; torch has no int8 GEMM on this CPU to hold it against"
    )
    if r.prefill_bytes_read:
        line += f"; its time includes reading {r.prefill_bytes_read / 1e6:.0f} MB of experts (a budget that holds them times compute alone)"
    return line


def matmul_weights_per_token(model, manifest) -> int:
    """Weights one token is multiplied by: every linear layer that stays resident (attention, routers,
    shared experts; not the LM head, which a prompt needs at its last position only) and the routed top-k
    experts of each MoE layer."""
    dense = 0
    for name, module in model.named_modules():
        if name.endswith("lm_head") or "Embedding" in type(module).__name__:  # (a lookup, not a matmul)
            continue
        weight = getattr(module, "weight", None)
        if hasattr(module, "in_features") and hasattr(module, "out_features"):  # linear, float or quantized
            dense += module.in_features * module.out_features
        elif isinstance(weight, torch.Tensor) and weight.dim() == 2:  # a router that is not an nn.Linear
            dense += weight.numel()
    top_k = routed_top_k(manifest.model_config)
    return dense + top_k * sum(expert_matrix_weights(layer) for layer in manifest.layers)


def _per_step_line(report: BenchReport) -> str:
    steps = report.moestream.decode_step_bytes
    if not steps or not report.read_busy_bytes_per_second:
        return "per decode step: no reads"
    return (
        f"per decode step, its own reads hidden behind compute: {report.per_step_floor_seconds_per_token * 1e3:.1f} ms "
        f"(efficiency {report.per_step_efficiency:.2f}), at the {report.read_busy_bytes_per_second / 1e9:.2f} GB/s "
        f"this run's reads had while in flight; the steps read {min(steps) / 1e6:.0f} to {max(steps) / 1e6:.0f} MB"
    )


def per_step_floor(step_bytes: list[int], all_hits: float, bandwidth: float) -> float:
    """Seconds per token when every step's reads hide behind its compute or its compute behind its reads,
    whichever is longer, but no read moves to another step (the token a step decodes, and so its experts,
    is known only once the step before it ends)."""
    if not step_bytes:
        return all_hits
    return sum(max(all_hits, b / bandwidth if bandwidth else 0.0) for b in step_bytes) / len(step_bytes)


def _read_ahead_line(read_ahead: dict | None) -> str:
    if read_ahead is None or read_ahead["mode"] == "off":
        return "read-ahead: off"
    r = read_ahead
    wasted = f"{r['wasted'] / r['useful']:.2f}" if r["useful"] else "-"
    return (
        f"read-ahead (--prefetch {r['mode']}, {'on' if r['speculating'] else 'off'} at the end): in the decode "
        f"{r['issued']} reads issued, {r['useful']} used, {r['wasted']} wasted ({wasted} per used one); "
        f"its guesses' precision {r['precision']:.0%}, recall {r['recall']:.0%}"
    )


def replay_reads(store: Store, reads: list[tuple[int, int, int]], threads: int = 4) -> float:
    """Bytes/s of reading these (file_index, offset, length) records again with O_DIRECT through the
    engine's reader, in the batches the engine issued them: consecutive reads of one file (one layer
    call's misses) go out together and are all waited for, then the next batch, as in decoding.

    Replaying the run's own reads, not a synthetic probe, matters twice over: small records are bound by
    latency (a deep queue of small reads is much faster than the 1..top_k reads of a decode step), and
    virtual disks cache recently read blocks on the host (the same bytes read again come faster than
    cold ones; docs/DECISIONS.md, "The I/O floor from the run's own reads"), so only the same bytes in the same order make a fair yardstick. The
    replay comes right after the run, so any host cache favours it: the floor errs low, efficiency with it.
    """
    batches: list[list[tuple[int, int, int]]] = []
    for read in reads:
        if batches and batches[-1][0][0] == read[0]:
            batches[-1].append(read)
        else:
            batches.append([read])
    widest = max((len(b) for b in batches), default=0)
    stride = store.manifest.max_record_stride
    buffers = [mmap.mmap(-1, stride) for _ in range(widest)]  # page-aligned, as O_DIRECT needs
    reader = RecordReader([store.path(layer.file) for layer in store.manifest.layers], threads, direct=True)
    try:
        start = time.perf_counter()
        for batch in batches:
            futures = [reader.submit(i, off, length, memoryview(buffers[n])[:length]) for n, (i, off, length) in enumerate(batch)]
            for future in futures:
                future.result()
        seconds = time.perf_counter() - start
    finally:
        reader.close()
    return sum(length for _, _, length in reads) / seconds if reads else 0.0


class Squeeze:
    """A helper process holding `nbytes` of touched anonymous memory, so the machine acts smaller."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.process = None

    def __enter__(self):
        if self.nbytes:
            code = (
                "import mmap,sys\n"
                f"m = mmap.mmap(-1, {self.nbytes})\n"
                "step = 1 << 20\n"
                f"for i in range(0, {self.nbytes}, step): m[i:i + step] = b'\\x01' * min(step, {self.nbytes} - i)\n"
                "print('ready', flush=True)\n"
                "sys.stdin.read()\n"
            )
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            if self.process.stdout.readline().strip() != "ready":
                raise UsageError(f"--squeeze {format_bytes(self.nbytes)}: the helper could not hold that much memory")
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.kill()
            self.process.wait()


def _prompt_ids(tokenizer, vocab: int, prompt_tokens: int, new_tokens: int, text: str | None) -> tuple[torch.Tensor, list | None]:
    """(prompt ids [1, P], the decode's forced tokens or None): a text's first P tokens and the
    `new_tokens` after them, or random ids and greedy decoding."""
    if text:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: prompt_tokens + new_tokens]
        if len(ids) < prompt_tokens + new_tokens:
            raise UsageError(
                f"--text has only {len(ids)} tokens, and --prompt-tokens {prompt_tokens} with --new-tokens {new_tokens} "
                f"follow {prompt_tokens + new_tokens}; pass a longer text or fewer tokens"
            )
        return torch.tensor([ids[:prompt_tokens]]), ids[prompt_tokens:]
    return torch.randint(0, vocab, (1, prompt_tokens), generator=torch.Generator().manual_seed(0)), None


def run_moestream(store_dir, memory: int, ids, new_tokens: int, name: str, trace_out=None, forced=None, **load_kwargs):
    """Load the store under `memory` and time one generation of exactly `new_tokens` after `ids`
    (serving.timed: greedy, or the `forced` tokens); returns (RunResult with the decode part's hit rate, bytes
    read, read waits, bytes per step and time with a read in flight; the (file, offset, length) of every
    decode read). `load_kwargs` go to moestream.load."""
    from ..core.loading import close, load
    from ..core.runtime import runtime_of
    from .trace import start_recording, stop_recording

    reset_peak_rss()
    model, _ = load(store_dir, memory, **load_kwargs)
    runtime = runtime_of(model)
    weights = matmul_weights_per_token(model, runtime.store.manifest)
    at_first: dict = {}

    def first_token() -> None:
        at_first.update(runtime.stats(), reads=runtime.record_reads())  # from here on the reads are decode's

    recorder = start_recording(model) if trace_out else None  # this run's routing, for simulate/plan --trace
    result = timed(model, ids, new_tokens, forced=forced, on_first_token=first_token)
    decode_reads = at_first["reads"].stop() if "reads" in at_first else None
    if recorder is not None:
        stop_recording(model)
        recorder.trace(prompt_tokens=int(ids.shape[1])).save(trace_out)
    stats = runtime.stats()
    close(model)
    decode_hits = stats["hits"] - at_first.get("hits", 0)
    decode_misses = stats["misses"] - at_first.get("misses", 0)
    run = RunResult.of(
        name,
        int(ids.shape[1]),
        result.timing,
        peak_rss_bytes(),
        hit_rate=decode_hits / max(1, decode_hits + decode_misses),
        decode_bytes_read=stats["bytes_read"] - at_first.get("bytes_read", 0),
        decode_wait_seconds=stats["wait_seconds"] - at_first.get("wait_seconds", 0.0),
        fast_paths=runtime.fast_paths(),
        read_ahead=read_ahead_of(at_first.get("prefetch"), stats["prefetch"]),
        decode_step_bytes=decode_reads.step_bytes() if decode_reads else [],
        decode_read_busy_seconds=decode_reads.busy_seconds if decode_reads else 0.0,
        prefill_bytes_read=at_first.get("bytes_read", 0),
        matmul_weights_per_token=weights,
    )
    return run, decode_reads.reads if decode_reads else []


def read_ahead_of(before: dict | None, after: dict | None) -> dict | None:
    """The read-ahead of the decode, from the prefetcher's reports at its first token and at its end: its
    mode, whether it was speculating at the end, reads issued, used and wasted during the decode, and its
    guesses' precision and recall over the run. None without a prefetcher."""
    if after is None:
        return None
    counts = {name: after[name] - (before or {}).get(name, 0) for name in ("issued", "useful", "wasted")}
    return {
        "mode": after["mode"],
        "speculating": after["speculating"],
        **counts,
        "precision": after["precision"],
        "recall": after["recall"],
    }


def _llama_cpp_decode(gguf_path: str, ids: list, new_tokens: int, forced: list | None = None) -> Timing:
    """llama.cpp (llama-cpp-python) on a GGUF file, mmap'd, from the same prompt ids, greedy or taking the
    `forced` tokens. Its own loop (llama.cpp is not a transformers model), timed by the same definition (`Timing`) as
    serving.stream."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=gguf_path, n_ctx=len(ids[0]) + new_tokens + 8, n_threads=torch.get_num_threads(), use_mmap=True, verbose=False
    )

    def choose(i: int) -> int:
        return forced[i] if forced is not None else llm.sample(temp=0.0)

    start = time.perf_counter()
    llm.eval(ids[0])
    token = choose(0)
    first = time.perf_counter()
    for i in range(1, new_tokens):
        llm.eval([token])
        token = choose(i)
    return Timing(start, first, time.perf_counter(), new_tokens)


def _peer(kind: str, checkpoint: str, memory: int, ids: list, new_tokens: int, forced: list | None, queue) -> None:
    """A peer in its own process (its own peak RSS, no memory shared with the others)."""
    try:
        reset_peak_rss()
        if kind == "llama.cpp":
            timing = _llama_cpp_decode(checkpoint, ids, new_tokens, forced)
            queue.put({"timing": timing, "rss": peak_rss_bytes()})
            return
        from transformers import AutoModelForCausalLM

        if kind == "transformers":
            model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
        else:
            offload = tempfile.mkdtemp(prefix="moestream-offload-")
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint, local_files_only=True, device_map="auto", max_memory={"cpu": memory}, offload_folder=offload
            ).eval()
        queue.put({"timing": timed(model, ids, new_tokens, forced=forced).timing, "rss": peak_rss_bytes()})
    except Exception as e:  # a peer that cannot run is reported, not fatal
        queue.put({"error": f"{type(e).__name__}: {e}"})


def _run_peer(kind: str, checkpoint: str, memory: int, ids: torch.Tensor, new_tokens: int, forced: list | None) -> RunResult:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peer, args=(kind, checkpoint, memory, ids.tolist(), new_tokens, forced, queue))
    process.start()
    result = None
    while result is None:
        try:
            result = queue.get(timeout=1.0)
        except Empty:
            if not process.is_alive():  # died without a word (a crash in native code, killed for memory)
                result = {"error": f"the process exited with code {process.exitcode} before reporting"}
    process.join()
    name = {
        "transformers": "transformers (fully loaded)",
        "accelerate": "transformers + accelerate offload",
        "llama.cpp": "llama.cpp (GGUF, mmap)",
    }[kind]
    if "error" in result:
        return RunResult(name, int(ids.shape[1]), new_tokens, 0.0, 0.0, 0, note=f"did not run: {result['error'][:120]}")
    return RunResult.of(name, int(ids.shape[1]), result["timing"], result["rss"])


def _memory_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def bench(
    store_dir: str | os.PathLike,
    memory: str | int = "4GiB",
    *,
    prompt_tokens: int = 32,
    new_tokens: int = 32,
    squeeze: str | int = 0,
    compare: str | None = None,
    compare_gguf: str | None = None,
    text: str | None = None,
    trace_out: str | None = None,
    **load_kwargs,
) -> BenchReport:
    from ..core.loading import load_tokenizer

    budget, squeeze_bytes = parse_bytes(memory), parse_bytes(squeeze)
    store = Store(store_dir)
    if new_tokens < 2:
        raise UsageError("--new-tokens must be at least 2: decode speed is measured after the first token")
    with Squeeze(squeeze_bytes):
        tokenizer = load_tokenizer(store.directory) if text else None
        ids, forced = _prompt_ids(tokenizer, int(store.manifest.model_config["vocab_size"]), prompt_tokens, new_tokens, text)
        run, reads = run_moestream(store_dir, budget, ids, new_tokens, "moestream", trace_out, forced, **load_kwargs)
        bandwidth = replay_reads(store, reads, load_kwargs.get("io_threads", 4))
        missed_per_token = run.decode_bytes_read / max(1, new_tokens - 1)
        # All-hits compute: with every expert cached when that fits comfortably, else on the steps that hit
        # everything under the run's budget, else (no such step) estimated.
        sizes = ModelSizes.of_store(store.manifest)
        if sizes.expert_stride_bytes < 0.5 * _memory_available():
            warm = _run_all_hits(store_dir, sizes.all_experts_budget, ids, new_tokens, forced)
            all_hits, how = warm.seconds_per_token, "measured, every expert cached"
        else:
            all_hits, how = _all_hit_steps(store_dir, budget, ids, forced, load_kwargs)
        measured = all_hits is not None
        if not measured:
            all_hits = max(0.0, run.seconds_per_token - run.decode_wait_seconds / max(1, new_tokens - 1))
            how = "estimated: decode time minus read waits; " + how
        reading = missed_per_token / bandwidth if bandwidth else 0.0
        floor, overlapped = reading + all_hits, max(reading, all_hits)
        busy, step_bytes = run.decode_read_busy_seconds, run.decode_step_bytes or []
        read_rate = sum(step_bytes) / busy if busy else 0.0
        per_step = per_step_floor(step_bytes, all_hits, read_rate)
        cached = sum(page_cache_bytes(store.path(layer.file)) for layer in store.manifest.layers)
        peers = []
        if compare:
            ckpt_bytes = sum(p.stat().st_size for p in Path(compare).glob("*.safetensors"))
            if ckpt_bytes < 0.8 * _memory_available():
                peers.append(_run_peer("transformers", compare, budget, ids, new_tokens, forced))
            else:
                peers.append(
                    RunResult(
                        "transformers (fully loaded)",
                        prompt_tokens,
                        new_tokens,
                        0,
                        0,
                        0,
                        note=f"skipped: {format_bytes(ckpt_bytes)} does not fit in available memory",
                    )
                )
            peers.append(_run_peer("accelerate", compare, budget, ids, new_tokens, forced))
        if compare_gguf:
            peers.append(_run_peer("llama.cpp", compare_gguf, budget, ids, new_tokens, forced))
    return BenchReport(
        store=str(store_dir),
        memory_bytes=budget,
        squeeze_bytes=squeeze_bytes,
        disk_bandwidth_bytes_per_second=bandwidth,
        moestream=run,
        all_hits_seconds_per_token=all_hits,
        all_hits_measured=measured,
        all_hits_how=how,
        bytes_missed_per_token=missed_per_token,
        floor_seconds_per_token=floor,
        efficiency=floor / run.seconds_per_token if run.seconds_per_token else 0.0,
        overlapped_floor_seconds_per_token=overlapped,
        overlapped_efficiency=overlapped / run.seconds_per_token if run.seconds_per_token else 0.0,
        read_busy_bytes_per_second=read_rate,
        per_step_floor_seconds_per_token=per_step,
        per_step_efficiency=per_step / run.seconds_per_token if run.seconds_per_token else 0.0,
        teacher_forced=forced is not None,
        store_page_cache_bytes=cached,
        peers=peers,
        int8_peak_ops_per_second=int8_peak_ops_per_second(),
    )


def _run_all_hits(store_dir, budget: int, ids, new_tokens: int, forced=None) -> RunResult:
    """All-hits decode: one load, a pass that fills the cache, then the timed pass on the same prompt."""
    from ..core.loading import close, load

    model, _ = load(store_dir, budget)
    timed(model, ids, new_tokens, forced=forced)  # fills the cache with every expert this prompt and decode need
    result = timed(model, ids, new_tokens, forced=forced)
    close(model)
    return RunResult.of("all hits", int(ids.shape[1]), result.timing, peak_rss_bytes())


# Decode steps of the short pass that measures all-hits compute when the experts do not all fit: few, so
# that the experts of all of them fit in a small budget together.
ALL_HIT_PROBE_STEPS = 8


def _all_hit_steps(store_dir, budget: int, ids, forced, load_kwargs: dict) -> tuple[float | None, str]:
    """All-hits compute per token when not every expert fits: a one-token prompt and the ALL_HIT_PROBE_STEPS
    tokens after it (the run's own: its prompt's, then its decode's) fed twice under `budget`, teacher-forced
    through the one loop; the second time each step is timed from the logits before it to its own, and the
    steps that missed no expert are the measurement (their median).
    -> (seconds, how), or (None, why not) where no step hit everything."""
    from ..core.loading import close, load
    from ..core.runtime import runtime_of
    from ..generation.serving import teacher_forced

    tokens = ids[0].tolist() + list(forced or [])
    probe = tokens[: 1 + ALL_HIT_PROBE_STEPS]
    model, _ = load(store_dir, budget, **load_kwargs)
    runtime = runtime_of(model)
    marks: list[tuple[float, int]] = []  # after each forward pass: (time, misses so far)

    def mark(_logits) -> None:
        misses = runtime.stats()["misses"]
        marks.append((time.perf_counter(), misses))

    try:
        teacher_forced(model, probe, prefill=1, on_logits=mark)  # the first time reads what the steps need
        marks.clear()
        teacher_forced(model, probe, prefill=1, on_logits=mark)
    finally:
        close(model)
    # (the first pass has no step before it: an empty KV cache, timed from nothing)
    seconds = [t - t0 for (t0, m0), (t, m) in zip(marks, marks[1:]) if m == m0]
    if not seconds:
        return None, f"no step of a {len(probe)}-token pass fed twice under --memory hit every expert"
    seconds.sort()
    how = f"measured on the {len(seconds)} of {len(probe) - 1} steps that hit every expert, fed twice under --memory"
    return seconds[len(seconds) // 2], how


def write_json(report: BenchReport | KernelReport, path: str) -> None:
    Path(path).write_text(json.dumps(asdict(report), indent=1))

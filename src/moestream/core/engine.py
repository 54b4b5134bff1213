"""Serve a loaded model's experts from disk through the cache: the streaming experts function.

One decode step, as a reader follows it:
1. the input embedding's pre-hook calls `ExpertEngine.start_step`: the step hooks and the cache policy
   hear that a forward pass begins (the policy gets its token ids), and hash-routed layers' experts are
   read ahead (their ids alone determine them);
2. transformers runs embeddings, attention, norms and the router (upstream code, unchanged);
3. the router's top-k goes to the experts module, whose forward is `streaming_experts_forward` below
   (registered in transformers' ExpertsInterface as "moestream", and set as each module's own forward
   at load, which skips the interface's lookup per call);
4. `ExpertEngine.run` groups the tokens by expert and hands the experts to the scheduler
   (scheduler.py), which looks them up, starts reads for the misses into free (or evicted) slots through
   `submit`, has the hits computed while the reads are in flight, then each miss as soon as its read lands;
5. per-(token, k) outputs are summed in a fixed order, so the numbers never depend on what was cached.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers.integrations.moe import ExpertsInterface

from ..choices import VERIFY_MODES
from ..conversion.sizes import ModelSizes
from ..conversion.store import DTYPES, Store
from ..errors import ExpertReadError, UsageError
from ..units import format_bytes
from . import fused, kernels, scheduler
from .cache import Entry, ExpertCache, State
from .kernels import expert_linear
from .memory import peak_rss_bytes
from .policies import DEFAULT_POLICY, make_policy
from .reader import RecordReader

IMPLEMENTATION = "moestream"
# A read that has not finished after this long means a stalled disk or network filesystem: the step
# fails with an error instead of hanging the program.
READ_TIMEOUT_SECONDS = 60.0
# A prompt at least this long shows a progress bar over the MoE layers (on a terminal): its reads can
# take seconds per layer when little of it is cached.
PREFILL_PROGRESS_TOKENS = 256
# One token's experts share one gate only when their first matmul's width is a multiple of this. torch's
# elementwise CPU kernels run whole blocks of up to 64 elements (two AVX-512 vectors of bf16) through the
# vector function and the tail of a row through the scalar one, whose exp can differ in the last bit; rows
# stacked into one tensor move the tails, unless no row has one. (A gate of width I over 2I: I a multiple
# of 64.) Real experts' widths are (768, 1408, 2048, 2880); tiny test models' are not.
SHARED_GATE_WIDTH = 128


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # summed over I/O threads
    wait_seconds: float = 0.0  # time the model thread spent blocked on this layer's reads
    verify_seconds: float = 0.0  # checksum time on the I/O threads (not on the model thread)
    prepare_seconds: float = 0.0  # records turned into the kernels' layout on the I/O threads (repack.py)
    evictions: int = 0  # this layer's experts pushed out of the cache
    device_hits: int = 0  # of the hits, those found in the device tier (device_tier.py), computed at once
    rerouted: int = 0  # choices the router made that cache-aware routing replaced (routing.py)


class ExpertEngine:
    """The streaming side of a loaded model: store, reader, cache, statistics; runs every experts call.

    Every method runs on the thread that runs the model, except `stats`, which any thread may call: it
    takes the same lock as each experts call, so it never sees a call half done."""

    def __init__(
        self,
        store: Store,
        budget_bytes: int,
        io_threads: int = 4,
        direct_io: bool = True,
        verify: str = "first",
        read_timeout: float = READ_TIMEOUT_SECONDS,
        policy: str = DEFAULT_POLICY,
        cpu_kernels: bool = True,
        int8_activations: bool = False,
    ):
        """cpu_kernels: the experts compute with the CPU's kernels (the CPU, or a CPU stand-in device); False
        on a GPU, whose kernels read the stored layout. int8_activations: quantized layers whose matrices
        the int8-activation kernels take run them (kernels.py), reading records as stored; the others'
        int4-family records are repacked into torch's CPU layout as they land."""
        if verify not in VERIFY_MODES:
            raise UsageError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.store = store
        self.verify = verify
        self.read_timeout = read_timeout
        self.lock = threading.Lock()
        self._verified: set[tuple[int, int]] = set()  # records whose checksum matched since load
        self.layers = store.manifest.layers
        sizes = ModelSizes.of_store(store.manifest)
        slot, top_k, minimum = sizes.stride_bytes, sizes.top_k, sizes.minimum_budget
        if budget_bytes < minimum:
            raise UsageError(
                f"a memory budget of {format_bytes(budget_bytes)} cannot hold the {top_k} experts one token needs "
                f"in one layer ({format_bytes(slot)} each); the minimum is {format_bytes(minimum)} "
                f"({minimum} bytes). Pass --memory {format_bytes(minimum).replace(' ', '')} or more."
            )
        self.cache = ExpertCache(budget_bytes, slot, make_policy(policy, sizes.layer_experts), on_evict=self._evicted)
        self.reader = RecordReader([store.path(layer.file) for layer in self.layers], io_threads, direct_io)
        self.layer_stats = [LayerStats() for _ in self.layers]
        # Each layer's record tensors' dtypes by name (float records compute in their own dtype).
        self.record_dtypes = [{t.name: DTYPES[t.dtype] for t in layer.layout.tensors} for layer in self.layers]
        # Per layer: whether its experts' matmuls take int8 activations, and what turns its records into its
        # kernels' layout as they land, or None (kernels.py).
        self.int8_activations = [
            int8_activations and cpu_kernels and _takes_int8_activations(layer) for layer in self.layers
        ]  # fmt: skip
        self.preparers = [
            kernels.record_preparer(layer.quantization, layer.layout, cpu_kernels, integer)
            for layer, integer in zip(self.layers, self.int8_activations)
        ]
        self.trace = None  # a trace.TraceRecorder while routing is being recorded
        self.prefetcher = None  # a prefetch.Prefetcher, set by load()
        # Told when a forward pass starts (`start_step(tokens)`) and when an experts call ends
        # (`end_layer(layer)`): the prefetcher's clock, the prefill progress bar.
        self.step_hooks: list = [PrefillProgress(len(self.layers))]
        self._ahead: list[Entry] = []  # reads ahead of need that may still be READING_AHEAD
        self.tier = None  # a device_tier.DeviceTier above the host cache, set by load(device="cuda")
        self._one_token_kernels: dict[tuple[int, torch.dtype], tuple | None] = {}  # `one_token_kernel`
        self.fast_paths: list = []  # fastpaths.survey's findings, made by load()

    def _evicted(self, entry: Entry) -> None:
        self.layer_stats[entry.key[0]].evictions += 1
        if entry.state is State.UNUSED:
            self.prefetcher.record_use(entry.key[0], False)

    # -- one forward pass -------------------------------------------------------------------------------

    def embedding_pre_hook(self, module, args) -> None:
        """The input embedding's forward pre-hook: its input is the forward pass's token ids."""
        if args and isinstance(args[0], torch.Tensor):
            self.start_step(args[0])

    def start_step(self, input_ids: torch.Tensor) -> None:
        """A forward pass begins (the input embedding's pre-hook): tell the hooks, and read the experts of
        hash-routed layers, which the ids alone determine, before any layer runs."""
        with self.lock:
            for hook in self.step_hooks:
                hook.start_step(input_ids.numel())
            token_ids = input_ids.reshape(-1).tolist()
            if self.trace is not None:
                self.trace.start_step(token_ids)
            self.cache.policy.on_step(token_ids)  # before any read of this step, as a replay tells it
            if self.prefetcher is not None:
                for layer, experts in self.prefetcher.exact(input_ids).items():
                    self._read_ahead(layer, experts, exact=True)

    def run(
        self, module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """One experts call: `hidden` [T, H], the router's `top_k_index` and `top_k_weights` [T, k] -> [T, H]."""
        with self.lock:
            if self.trace is not None:
                self.trace.record(layer, top_k_index, top_k_weights)
            tokens, k = top_k_index.shape
            single = tokens == 1  # decode: no sort, no tensors of positions; expert -> its choice j
            if single:
                rows = dict(sorted(zip(top_k_index.reshape(-1).tolist(), range(k))))
                single = len(rows) == k  # an expert chosen twice (no router does) takes the general path
            if not single:
                flat = top_k_index.reshape(-1)
                order = torch.argsort(flat, stable=True)
                ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
                rows, start = {}, 0
                for e, c in zip(ids.tolist(), counts.tolist()):
                    rows[e] = order[start : start + c]  # positions t*k + j routed to expert e
                    start += c
            self.cache.reclaim()
            self._collect_ahead()
            on_device = self._device_lookup(layer, rows)
            call = scheduler.lookup(self.cache, layer, [e for e in rows if e not in on_device] if on_device else rows)
            stats = self.layer_stats[layer]
            stats.hits += call.hits + len(on_device)
            stats.device_hits += len(on_device)
            stats.misses += call.misses
            if self.prefetcher is not None:
                for _ in call.used_ahead:
                    self.prefetcher.record_use(layer, True)
                self.prefetcher.observe(layer, list(rows))
            io = _LayerCall(self, module, layer, hidden, rows, top_k_weights, tokens, k, single)
            try:
                if on_device:  # first: their slots then wait only on queued work
                    self._compute(io, [(e, entry.tensors) for e, entry in on_device.items()])
                    for entry in on_device.values():
                        self.tier.done_with(entry)
                call.run(io)
            finally:
                for hook in self.step_hooks:
                    hook.end_layer(layer)
            return io.result()

    # -- reads ------------------------------------------------------------------------------------------

    def submit(self, entry: Entry, priority: bool = True) -> None:
        """The one path of every read: fill `entry`'s slot with its record, checked against its checksum
        when --verify asks. priority=False puts it on the reader's speculative queue."""
        layer, e = entry.key
        spec = self.layers[layer]
        check = self.verify == "always" or (self.verify == "first" and entry.key not in self._verified)
        expected = (spec.layout.nbytes, spec.checksums[e]) if check else None
        memory = self.cache.slot_memory(entry.slot)
        prepare = self.preparers[layer]
        after = (
            None if prepare is None else functools.partial(prepare, self.record_views(layer, self.cache.slot_tensor(entry.slot)))
        )
        entry.read = self.reader.submit(
            layer, spec.offsets[e], spec.layout.stride, memory, expected, speculative=not priority, after=after
        )

    def _read_ahead(self, layer: int, experts: list[int], exact: bool = False) -> None:
        """Start reads of `layer`'s likely experts into slots the policy gives up (never a pinned or loading
        one); on the speculative queue unless `exact` (certain to be used: a hash-routed layer)."""
        for e in experts:
            if (layer, e) in self.cache:
                continue
            entry = self.cache.allocate((layer, e), State.READING_AHEAD)
            if entry is None:
                return
            self.submit(entry, priority=exact)
            self._ahead.append(entry)
            self.prefetcher.stats[layer].issued += 1

    def _collect_ahead(self) -> None:
        """Book the reads ahead of need that have landed (cache bookkeeping happens on this thread only)."""
        pending = []
        for entry in self._ahead:
            if entry.state is not State.READING_AHEAD:
                continue  # claimed by a call that needed it, which finishes the read itself
            if not entry.read.done():
                pending.append(entry)
                continue
            try:
                self.finish_read(entry)
            except ExpertReadError:
                self.prefetcher.record_use(entry.key[0], False)  # discarded; a demand read will retry and report
        self._ahead = pending

    def finish_read(self, entry: Entry) -> None:
        """A read is over: book it and make the slot's tensors, or discard the entry and raise."""
        layer = entry.key[0]
        spec = self.layers[layer]
        try:
            result = entry.read.result()
        except BaseException as error:
            self.cache.discard(entry)  # its bytes are partial or damaged: they must never be computed with
            if isinstance(error, ExpertReadError):
                where = f"layer {layer} ({spec.module}), expert {entry.key[1]}"
                raise type(error)(f"{where}: {error}") from error
            raise
        if self.verify != "off":
            self._verified.add(entry.key)
        stats = self.layer_stats[layer]
        stats.bytes_read += spec.layout.stride
        stats.read_seconds += result.seconds
        stats.verify_seconds += result.verify_seconds
        stats.prepare_seconds += result.prepare_seconds
        entry.tensors = self.record_views(layer, self.cache.slot_tensor(entry.slot))
        entry.read = None
        entry.state = State.UNUSED if entry.state is State.READING_AHEAD else State.READY

    def landed(self, layer: int, in_flight: list[Entry], oldest_only: bool) -> list[Entry]:
        t0 = time.perf_counter()
        if oldest_only:
            done, _ = wait([in_flight[0].read], timeout=self.read_timeout)
        else:
            done, _ = wait([entry.read for entry in in_flight], timeout=self.read_timeout, return_when=FIRST_COMPLETED)
        self.layer_stats[layer].wait_seconds += time.perf_counter() - t0
        if not done:
            stalled = sorted(entry.key[1] for entry in in_flight)
            raise ExpertReadError(
                f"no read of layer {layer}'s experts {stalled} finished within {self.read_timeout:g} s "
                f"from {self.store.path(self.layers[layer].file)}: the disk is stalled or failing"
            )
        return [entry for entry in in_flight if entry.read in done]

    def abandon(self, in_flight: list[Entry]) -> None:
        """Never leave a half-read slot in the cache, and never hand out a slot that a still-running read
        may yet write into."""
        for entry in in_flight:
            entry.read.cancel()
            if entry.read.done():
                self.cache.discard(entry)
            else:
                self.cache.park(entry)

    # -- compute ----------------------------------------------------------------------------------------

    def _device_lookup(self, layer: int, rows) -> dict[int, Entry]:
        """The call's experts found in the device tier (pinned), by id; none without one."""
        if self.tier is None:
            return {}
        self.tier.release()
        found = {}
        for e in rows:
            entry = self.tier.lookup(layer, e)
            if entry is not None:
                found[e] = entry
        return found

    def compute(self, call: _LayerCall, entries: list[Entry]) -> None:
        """Experts whose host entries are ready, computed where the model runs: from the host slots on the
        CPU, or each from a device slot it is first copied into (device_tier.py)."""
        if self.tier is None:
            self._compute(call, [(entry.key[1], entry.tensors) for entry in entries])
            return
        for entry in entries:
            staged = self.tier.stage(entry, self.cache, self.cache.slot_tensor(entry.slot), self.layers[call.layer].layout.nbytes)
            try:
                self._compute(call, [(entry.key[1], staged.tensors)])
            finally:
                self.tier.done_with(staged)
                self.tier.release()  # copies that are over give their host slots back to this call's misses

    def record_views(self, layer: int, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """A record's tensors as views into the bytes of a slot holding it (host or device memory)."""
        return {
            t.name: raw[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
            for t in self.layers[layer].layout.tensors
        }

    def one_token_kernel(self, module, layer: int, x: torch.Tensor) -> tuple | None:
        """The fused one-token experts kernel for this layer and activation dtype (fused.one_token_experts
        decides; remembered per layer and dtype), or None."""
        key = (layer, x.dtype)
        if key not in self._one_token_kernels:
            self._one_token_kernels[key] = fused.one_token_experts(
                module, self.layers[layer], x, self.tier is not None, self.int8_activations[layer]
            )
        return self._one_token_kernels[key]

    def _compute(self, call: _LayerCall, experts: list[tuple[int, dict[str, torch.Tensor]]]) -> None:
        """Experts (id, record tensors) on the tokens routed to them, with the module's own gate/activation
        semantics. With one token, quantized experts run through the fused kernel where it applies
        (`one_token_kernel`), one call for all of them; otherwise experts computed together share one gate
        over their stacked rows where that gives the same bits (`SHARED_GATE_WIDTH`): the gate is row-wise,
        and at decode the small ops between the matmuls cost as much as the matmuls (docs/BENCHMARKS.md)."""
        if call.single and call.fused is not None:
            kernel, (q1, p1, q2, p2), bits, group, integer = call.fused
            experts = sorted(experts, key=lambda item: call.rows[item[0]])  # in k order
            whole = len(experts) == call.k  # every choice at once: the kernel also sums them, as `result` would
            out = kernel(call.x, [w[q1] for _, w in experts], [w[p1] for _, w in experts],
                         [w[q2] for _, w in experts], [w[p2] for _, w in experts], bits, group, integer,
                         call.weights if whole else None)  # fmt: skip
            if whole:
                call.total = out
            else:
                for j, (expert, _) in enumerate(experts):
                    call.ys[call.rows[expert]] = out[j : j + 1]
            return
        if call.single:
            hs = [_first_matmul(call, call.x, w) for _, w in experts]
            if len(hs) > 1 and hs[0].shape[-1] % SHARED_GATE_WIDTH == 0:
                stacked = _gate(call.module, torch.cat(hs))
                hs = [stacked[j : j + 1] for j in range(len(hs))]
            else:
                hs = [_gate(call.module, h) for h in hs]
            for (expert, w), h in zip(experts, hs):
                # weighted and summed in k order once every expert is done (`result`)
                call.ys[call.rows[expert]] = _second_matmul(call, h, w)
            return
        for expert, w in experts:
            pos = call.rows[expert]
            y = _second_matmul(call, _gate(call.module, _first_matmul(call, call.x[pos // call.k], w)), w)
            call.out[pos] = (y * call.weights[pos, None]).to(call.out.dtype)

    # -- reporting --------------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self.lock:
            return self._stats()

    def _stats(self) -> dict:
        layers = [asdict(s) for s in self.layer_stats]
        hits = sum(s["hits"] for s in layers)
        misses = sum(s["misses"] for s in layers)
        return {
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
            "bytes_read": sum(s["bytes_read"] for s in layers),
            "read_seconds": sum(s["read_seconds"] for s in layers),
            "wait_seconds": sum(s["wait_seconds"] for s in layers),
            "verify_seconds": sum(s["verify_seconds"] for s in layers),
            "prepare_seconds": sum(s["prepare_seconds"] for s in layers),
            "verify": self.verify,
            "evictions": sum(s["evictions"] for s in layers),
            "rerouted": sum(s["rerouted"] for s in layers),
            "cache_slots": self.cache.capacity,
            "cache_policy": self.cache.policy.name,
            "cache_budget_bytes": self.cache.budget_bytes,
            "cached_experts": len(self.cache),
            "direct_io": self.reader.direct,
            "device_hits": sum(s["device_hits"] for s in layers),
            "device_cache_slots": self.tier.capacity if self.tier is not None else 0,
            "device_cache_budget_bytes": self.tier.cache.budget_bytes if self.tier is not None else 0,
            "device_cached_experts": len(self.tier.cache) if self.tier is not None else 0,
            "device_waits": self.tier.waits if self.tier is not None else 0,
            "prefetch": self.prefetcher.report() if self.prefetcher is not None else None,
            "fast_paths": [asdict(p) for p in self.fast_paths],
            "peak_rss_bytes": peak_rss_bytes(),
            "layers": layers,
        }

    def reset_stats(self) -> None:
        with self.lock:
            self.layer_stats = [LayerStats() for _ in self.layers]

    def close(self) -> None:
        if self.tier is not None:
            self.tier.drain()
        self.reader.close()


class _LayerCall:
    """The engine side of one experts call, as the scheduler drives it (scheduler.CallIO), and its output.

    Each (token t, choice j) output lands in its own row, so the sum over j runs in the same order
    whichever experts were cached and whenever their reads landed. One token (decode): the experts'
    outputs are kept as they are and weighted and summed at the end, in three ops. Several: each expert
    writes its weighted output into rows t*k + j of `out` [T*k, H]."""

    __slots__ = (
        "engine", "module", "layer", "hidden", "rows", "weights", "k", "single", "x", "fmt", "int8", "first", "ys",
        "out", "fused", "total",
    )  # fmt: skip

    def __init__(self, engine: ExpertEngine, module, layer: int, hidden, rows, top_k_weights, tokens: int, k: int, single: bool):
        self.engine, self.module, self.layer, self.hidden, self.rows, self.k = engine, module, layer, hidden, rows, k
        self.single = single
        spec = engine.layers[layer]
        self.fmt = spec.quantization
        self.int8 = engine.int8_activations[layer]  # the matmuls take int8 activations (kernels.py)
        self.first = "gate_up_proj" if module.has_gate else "up_proj"
        # Float records compute in their own dtype, quantized ones in the model's activation dtype: cast once
        # per call, not per expert.
        dtype = hidden.dtype if self.fmt else engine.record_dtypes[layer][self.first]
        self.x = hidden if hidden.dtype == dtype else hidden.to(dtype)
        if single and not self.x.is_contiguous():  # the general path's gather copies; the kernels need rows
            self.x = self.x.contiguous()
        # The fused one-token kernel computes in the hidden states' dtype (quantized records), as `result` sums.
        self.fused = engine.one_token_kernel(module, layer, self.x) if single and self.x.dtype == hidden.dtype else None
        self.total = None  # the result itself, when the fused kernel computed every choice at once
        if self.single:
            self.weights = top_k_weights.reshape(k, 1)
            self.ys = [None] * k
        else:
            self.weights = top_k_weights.reshape(-1)
            self.out = hidden.new_empty(tokens * k, hidden.shape[-1])  # every row is written once

    def result(self) -> torch.Tensor:
        """[T, H]: the weighted outputs summed over k, in k order."""
        if self.total is not None:
            return self.total
        dtype = self.hidden.dtype
        if self.single:
            out = torch.cat(self.ys)  # [k, H]; cat upcasts (exactly) to a common dtype
            # In place where the result keeps out's dtype: computed in the promoted dtype (float32 router
            # weights) and rounded once, as (out * weights).to(dtype) is, with one op and buffer less.
            out = out.mul_(self.weights) if out.dtype == dtype else (out * self.weights).to(dtype)
            return out.view(1, self.k, -1).sum(dim=1)
        return self.out.view(-1, self.k, self.out.shape[-1]).sum(dim=1).to(dtype)

    def start_read(self, entry: Entry) -> None:
        self.engine.submit(entry)

    def demand_issued(self) -> None:
        prefetcher = self.engine.prefetcher
        if prefetcher is not None:
            self.engine._read_ahead(self.layer + 1, prefetcher.predict(self.layer, self.hidden))

    def landed(self, in_flight: list[Entry], oldest_only: bool) -> list[Entry]:
        return self.engine.landed(self.layer, in_flight, oldest_only)

    def finish_read(self, entry: Entry) -> None:
        self.engine.finish_read(entry)

    def compute(self, entries: list[Entry]) -> None:
        self.engine.compute(self, entries)

    def abandon(self, in_flight: list[Entry]) -> None:
        self.engine.abandon(in_flight)

    def make_room(self) -> bool:
        tier = self.engine.tier
        return tier is not None and tier.wait_oldest()


class PrefillProgress:
    """A progress bar over the MoE layers for a long prompt (on a terminal only): its reads can take
    seconds per layer when little of it is cached."""

    def __init__(self, layers: int):
        self.layers = layers
        self.bar = None

    def start_step(self, tokens: int) -> None:
        if tokens >= PREFILL_PROGRESS_TOKENS:
            self.bar = tqdm(total=self.layers, desc=f"prefill {tokens} tokens", unit="layer", disable=None, leave=False)

    def end_layer(self, layer: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if layer == self.layers - 1:
                self.bar.close()
                self.bar = None


def _first_matmul(call: _LayerCall, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    h = expert_linear(x, w, call.first, call.fmt, call.module.is_transposed, call.int8)
    return h + w[call.first + "_bias"] if call.module.has_bias else h


def _gate(module, h: torch.Tensor) -> torch.Tensor:
    return module._apply_gate(h) if module.has_gate else module.act_fn(h)


def _second_matmul(call: _LayerCall, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    module = call.module
    y = expert_linear(h, w, "down_proj", call.fmt, module.is_transposed, call.int8)
    if module.has_bias:
        y = y + w["down_proj_bias"]
    return module.post_expert_norm(y) if module.has_post_expert_norm else y


def _takes_int8_activations(layer) -> bool:
    """Whether every quantized matrix of a layer's records fits the int8-activation kernels."""
    if layer.quantization is None:
        return False
    return all(kernels.int8_activations_fit(layer.quantization, n, k) for n, k in layer.quantized_matrices)


def streaming_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ExpertsInterface entry point: transformers calls this instead of its own experts math."""
    return self._moestream_engine.run(self, self._moestream_layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Make "moestream" an experts implementation transformers can dispatch to (idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, streaming_experts_forward)

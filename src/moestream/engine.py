"""Serve a loaded model's experts from disk through the cache: the streaming experts function.

One decode step, as a reader follows it:
1. transformers runs embeddings, attention, norms and the router (upstream code, unchanged);
2. the router's top-k goes to the experts module, whose forward transformers dispatches through its
   ExpertsInterface to `streaming_experts_forward` below (registered as "moestream");
3. `ExpertEngine.run` splits the needed experts into cache hits and misses, queues reads for the misses
   into free (or evicted) cache slots, computes the hits while the reads are in flight, then computes
   each miss as soon as its own read lands;
4. per-(token, k) outputs are summed in a fixed order, so the numbers never depend on what was cached.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers.integrations.moe import ExpertsInterface

from .cache import Entry, ExpertCache
from .policies import DEFAULT_POLICY, make_policy
from .errors import ExpertReadError, StoreError, UsageError
from .kernels import expert_linear
from .memory import peak_rss_bytes
from .reader import RecordReader
from .store import DTYPES, Store
from .units import format_bytes

IMPLEMENTATION = "moestream"
# When expert records are checked against their manifest checksums (docs/FORMAT.md, "Verification"):
# "first": the first time each record is read by this process (the default: damage on disk is caught
# before the bytes are used, and re-reads of an evicted expert cost no hashing); "always": every read;
# "off": never.
VERIFY_MODES = ("first", "always", "off")
# A read that has not finished after this long means a stalled disk or network filesystem: the step
# fails with an error instead of hanging the program.
READ_TIMEOUT_SECONDS = 60.0
# A prompt at least this long shows a progress bar over the MoE layers (on a terminal): its reads can
# take seconds per layer when little of it is cached.
PREFILL_PROGRESS_TOKENS = 256


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0  # summed over I/O threads
    wait_seconds: float = 0.0  # time the model thread spent blocked on this layer's reads
    verify_seconds: float = 0.0  # checksum time on the I/O threads (not on the model thread)
    evictions: int = 0  # this layer's experts pushed out of the cache


class ExpertEngine:
    """The streaming side of a loaded model: store, reader, cache and statistics."""

    def __init__(
        self,
        store: Store,
        budget_bytes: int,
        io_threads: int = 4,
        direct_io: bool = True,
        verify: str = "first",
        read_timeout: float = READ_TIMEOUT_SECONDS,
        policy: str = DEFAULT_POLICY,
    ):
        if verify not in VERIFY_MODES:
            raise UsageError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.store = store
        self.verify = verify
        self.read_timeout = read_timeout
        self._verified: set[tuple[int, int]] = set()  # records whose checksum matched since load
        self._stalled: list[tuple] = []  # (future, slot) of reads abandoned while still running
        self.layers = store.manifest.layers
        slot = store.manifest.max_record_stride
        config = store.manifest.model_config
        top_k = int(config.get("num_experts_per_tok") or config.get("moe_topk") or 1)
        minimum = top_k * slot
        if budget_bytes < minimum:
            raise UsageError(
                f"a memory budget of {format_bytes(budget_bytes)} cannot hold the {top_k} experts one token needs "
                f"in one layer ({format_bytes(slot)} each); the minimum is {format_bytes(minimum)} "
                f"({minimum} bytes). Pass --memory {format_bytes(minimum).replace(' ', '')} or more."
            )
        self.cache = ExpertCache(budget_bytes, slot, make_policy(policy), on_evict=self._count_eviction)
        self.reader = RecordReader([store.path(layer.file) for layer in self.layers], io_threads, direct_io)
        self.layer_stats = [LayerStats() for _ in self.layers]
        self.trace = None  # a trace.TraceRecorder while routing is being recorded
        self.prefetcher = None  # a prefetch.Prefetcher, set by load()
        self._speculative: dict = {}  # future -> Entry of speculative reads in flight
        self._unused_prefetch: set = set()  # keys loaded speculatively and not used yet
        self._prefill_bar = None

    def _count_eviction(self, key) -> None:
        self.layer_stats[key[0]].evictions += 1
        if key in self._unused_prefetch:
            self._unused_prefetch.discard(key)
            self.prefetcher.record_use(key[0], False)

    # -- one experts call -------------------------------------------------------------------------------

    def run(self, module, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.trace is not None:
            self.trace.record(layer, top_k_index, top_k_weights)
        tokens, k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        ids, counts = torch.unique_consecutive(flat[order], return_counts=True)
        rows, start = {}, 0
        for e, c in zip(ids.tolist(), counts.tolist()):
            rows[e] = order[start : start + c]  # positions t*k + j routed to expert e
            start += c
        out = hidden.new_zeros(tokens * k, hidden.shape[-1])
        weights = top_k_weights.reshape(-1)
        stats = self.layer_stats[layer]
        self._reclaim_stalled_slots()
        self._collect_speculative()
        if layer == 0 and tokens >= PREFILL_PROGRESS_TOKENS:
            self._prefill_bar = tqdm(total=len(self.layers), desc=f"prefill {tokens} tokens", unit="layer", disable=None, leave=False)

        ready: list[Entry] = []
        waiting: list[int] = []
        in_flight: dict = {}
        for e in rows:
            entry = self.cache.lookup((layer, e))
            if entry is not None:
                stats.hits += 1
                if entry.loading is not None:  # a speculative read still in flight: now a demand read, pinned
                    del self._speculative[entry.loading]
                    in_flight[entry.loading] = entry
                    self.prefetcher.record_use(layer, True)
                    continue
                if entry.key in self._unused_prefetch:
                    self._unused_prefetch.discard(entry.key)
                    self.prefetcher.record_use(layer, True)
                entry.pins += 1
                ready.append(entry)
            else:
                stats.misses += 1
                waiting.append(e)
        if self.prefetcher is not None:
            if layer == 0:
                self.prefetcher.start_step(tokens)
            self.prefetcher.observe(layer, list(rows))
        # The order of lookups, allocations and unpinning below decides what the policy sees and what is
        # evicted; simulate.replay repeats it step for step, so that the offline simulator's hit counts
        # equal these exactly. Change both together (tests/test_simulate.py checks they agree).
        try:
            self._issue_reads(layer, waiting, in_flight)
            if not waiting and self.prefetcher is not None:  # demand first: speculate only once it is all issued
                self._speculate(layer + 1, self.prefetcher.predict(layer, hidden))
            while ready:  # hits compute while the misses are read
                self._compute(module, ready[-1], hidden, rows, weights, k, out)
                ready.pop().pins -= 1
            self._issue_reads(layer, waiting, in_flight)  # the hits' slots are evictable now
            while in_flight or waiting:
                if not in_flight:
                    raise UsageError(
                        f"the expert cache ({self.cache.capacity} slots) has no free slot for layer {layer}; "
                        "raise --memory"
                    )
                t0 = time.perf_counter()
                if waiting:
                    # Reads still wait for slots: the slots they get depend on which experts are computed
                    # (unpinned) by then, so take completions in issue order to make evictions independent of
                    # I/O timing (reads of equal size finish nearly in order anyway).
                    done, _ = wait([next(iter(in_flight))], timeout=self.read_timeout)
                else:
                    done, _ = wait(in_flight, timeout=self.read_timeout, return_when=FIRST_COMPLETED)
                stats.wait_seconds += time.perf_counter() - t0
                if not done:
                    stalled = sorted(entry.key[1] for entry in in_flight.values())
                    raise ExpertReadError(
                        f"no read of layer {layer}'s experts {stalled} finished within {self.read_timeout:g} s "
                        f"from {self.store.path(self.layers[layer].file)}: the disk is stalled or failing"
                    )
                for future in done:
                    entry = in_flight.pop(future)
                    self._finish_read(layer, entry, future)
                    self._compute(module, entry, hidden, rows, weights, k, out)
                    entry.pins -= 1
                # Slots freed by the experts just computed take the reads that did not fit before.
                self._issue_reads(layer, waiting, in_flight)
        finally:
            # Only reached with work left after an error: never leave a half-read slot in the cache, and
            # never hand out a slot that a still-running read may yet write into.
            for future, entry in in_flight.items():
                future.cancel()
                if future.done():
                    self.cache.discard(entry.key)
                else:
                    self._stalled.append((future, self.cache.discard(entry.key, reuse_slot=False)))
            for entry in ready:
                entry.pins -= 1
            if self._prefill_bar is not None:
                self._prefill_bar.update(1)
                if layer == len(self.layers) - 1:
                    self._prefill_bar.close()
                    self._prefill_bar = None
        return out.view(tokens, k, -1).sum(dim=1).to(hidden.dtype)

    def _issue_reads(self, layer: int, waiting: list[int], in_flight: dict) -> None:
        spec = self.layers[layer]
        while waiting:
            entry = self.cache.allocate((layer, waiting[0]))
            if entry is None:
                return  # every slot is pinned by this call: wait for a computation to release one
            e = waiting.pop(0)
            entry.pins = 1
            check = self.verify == "always" or (self.verify == "first" and (layer, e) not in self._verified)
            expected = (spec.layout.nbytes, spec.checksums[e]) if check else None
            memory = self.cache.slot_memory(entry.slot)
            entry.loading = self.reader.submit(layer, spec.offsets[e], spec.layout.stride, memory, expected)
            in_flight[entry.loading] = entry

    def prefetch_exact(self, input_ids: torch.Tensor) -> None:
        """A forward pass begins: read the experts of hash-routed layers, known from the ids alone."""
        if self.prefetcher is not None:
            for layer, experts in self.prefetcher.exact(input_ids).items():
                self._speculate(layer, experts, exact=True)

    def _speculate(self, layer: int, experts: list[int], exact: bool = False) -> None:
        """Start reads of `layer`'s likely experts into slots the policy gives up; low-priority unless
        `exact` (the experts are certain to be used: a hash-routed layer)."""
        spec = self.layers[layer] if layer < len(self.layers) else None
        for e in experts:
            if (layer, e) in self.cache:
                continue
            entry = self.cache.allocate((layer, e))  # never a pinned or loading slot
            if entry is None:
                return
            entry.pins = 1  # until the read lands: nobody may evict a slot that is being written
            check = self.verify == "always" or (self.verify == "first" and (layer, e) not in self._verified)
            expected = (spec.layout.nbytes, spec.checksums[e]) if check else None
            memory = self.cache.slot_memory(entry.slot)
            entry.loading = self.reader.submit(layer, spec.offsets[e], spec.layout.stride, memory, expected, speculative=not exact)
            self._speculative[entry.loading] = entry
            self.prefetcher.stats[layer].issued += 1

    def _collect_speculative(self) -> None:
        """Book the speculative reads that have landed (cache bookkeeping happens on this thread only)."""
        for future in [f for f in self._speculative if f.done()]:
            entry = self._speculative.pop(future)
            try:
                self._finish_read(entry.key[0], entry, future)
            except ExpertReadError:
                self.prefetcher.record_use(entry.key[0], False)  # discarded; a demand read will retry and report
                continue
            entry.pins -= 1
            self._unused_prefetch.add(entry.key)

    def _reclaim_stalled_slots(self) -> None:
        if self._stalled:
            still = []
            for future, slot in self._stalled:
                if future.done():
                    self.cache.release_slot(slot)
                else:
                    still.append((future, slot))
            self._stalled = still

    def _finish_read(self, layer: int, entry: Entry, future) -> None:
        spec = self.layers[layer]
        try:
            result = future.result()
        except BaseException as error:
            self.cache.discard(entry.key)  # its bytes are partial or damaged: they must never be computed with
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
        raw = self.cache.slot_tensor(entry.slot)
        entry.tensors = {
            t.name: raw[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape) for t in spec.layout.tensors
        }
        entry.loading = None

    def _compute(self, module, entry: Entry, hidden, rows, weights, k: int, out: torch.Tensor) -> None:
        """One expert on the tokens routed to it, with the module's own gate/activation semantics."""
        idx = rows[entry.key[1]]
        w = entry.tensors
        fmt = self.layers[entry.key[0]].quantization
        first = "gate_up_proj" if module.has_gate else "up_proj"
        # Float records compute in their own dtype; quantized ones in the model's activation dtype.
        x = hidden[idx // k].to(hidden.dtype if fmt else w[first].dtype)
        h = expert_linear(x, w, first, fmt, module.is_transposed)
        if module.has_bias:
            h = h + w[first + "_bias"]
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        y = expert_linear(h, w, "down_proj", fmt, module.is_transposed)
        if module.has_bias:
            y = y + w["down_proj_bias"]
        if module.has_post_expert_norm:
            y = module.post_expert_norm(y)
        out[idx] = (y * weights[idx, None]).to(out.dtype)

    # -- reporting --------------------------------------------------------------------------------------

    def stats(self) -> dict:
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
            "verify": self.verify,
            "evictions": sum(s["evictions"] for s in layers),
            "cache_slots": self.cache.capacity,
            "cache_policy": self.cache.policy.name,
            "cache_budget_bytes": self.cache.budget_bytes,
            "cached_experts": len(self.cache),
            "direct_io": self.reader.direct,
            "prefetch": self.prefetcher.report() if self.prefetcher is not None else None,
            "peak_rss_bytes": peak_rss_bytes(),
            "layers": layers,
        }

    def reset_stats(self) -> None:
        self.layer_stats = [LayerStats() for _ in self.layers]

    def close(self) -> None:
        self.reader.close()


def streaming_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The ExpertsInterface entry point: transformers calls this instead of its own experts math."""
    return self._moestream_engine.run(self, self._moestream_layer, hidden_states, top_k_index, top_k_weights)


def register() -> None:
    """Make "moestream" an experts implementation transformers can dispatch to (idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, streaming_experts_forward)

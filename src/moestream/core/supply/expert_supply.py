"""Expert supply: a layer's experts made ready in memory, each handed over as it lands.

The engine (engine.py) computes; this part answers "make these experts of this layer ready, and give me
each one as it is": the expert cache (cache.py) and its policy, the reader (reader.py) with the records'
checksums, reads ahead of need (the prefetcher, prefetch.py), the device tier above the host cache
(device_tier.py), and the statistics of all that. Its collaborators are given at construction.

A miss, top to bottom (`provide`):
1. `cache.start_call` finds the call's experts in the cache: hits are pinned, misses wait for a slot;
2. `cache.Call.run` allocates a slot per miss (the policy picks a victim) and starts its read here
   (`start_read`: an aligned read into the slot on an I/O thread, checksummed there; the record put into
   its kernels' layout there too, where they need another), hands the hits to the engine's `compute`
   while the reads are in flight, then waits for reads (`landed`), books each (`finish_read`) and hands
   it over; a read that fails or stalls is never left cached half-written (`abandon`).
The order of the cache's operations is cache.py's alone, so the simulator replays it exactly.

Statistics are counted under their own lock, held only while a counter changes or is read: `snapshot`
never waits for a read in flight.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import asdict, dataclass

import torch

from ...choices import VERIFY_MODES
from ...conversion.sizes import ModelSizes
from ...conversion.store import DTYPES, Store
from ...errors import ExpertReadError, ReadsInterrupted, UsageError
from ...units import format_bytes
from ..devices import Device
from .cache import Entry, ExpertCache, State, start_call
from .device_tier import DeviceTier
from .policies import DEFAULT_POLICY, make_policy
from .reader import RecordReader

# A read that has not finished after this long means a stalled disk or network filesystem: the step
# fails with an error instead of hanging the program.
READ_TIMEOUT_SECONDS = 60.0
# How often a wait for reads looks whether it was interrupted.
WAIT_SLICE_SECONDS = 0.25

#: What the engine computes with: experts as (expert id, record tensors), ready and pinned.
Compute = Callable[[list[tuple[int, dict[str, torch.Tensor]]]], None]


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


def check_budget(store: Store, budget_bytes: int) -> ModelSizes:
    """The store's sizes, if `budget_bytes` holds the experts one token needs in one layer; else a usage
    error that names the minimum."""
    sizes = ModelSizes.of_store(store.manifest)
    slot, top_k, minimum = sizes.stride_bytes, sizes.top_k, sizes.minimum_budget
    if budget_bytes < minimum:
        raise UsageError(
            f"a memory budget of {format_bytes(budget_bytes)} cannot hold the {top_k} experts one token needs "
            f"in one layer ({format_bytes(slot)} each); the minimum is {format_bytes(minimum)} "
            f"({minimum} bytes). Pass --memory {format_bytes(minimum).replace(' ', '')} or more."
        )
    return sizes


class ExpertSupply:
    """A store's experts under a byte budget: the cache, the reader, reads ahead of need, the device tier.

    `provide` and `start_step` run on the thread that runs the model; `snapshot` on any thread."""

    def __init__(
        self,
        store: Store,
        budget_bytes: int,
        io_threads: int = 4,
        direct_io: bool = True,
        verify: str = "first",
        read_timeout: float = READ_TIMEOUT_SECONDS,
        policy: str = DEFAULT_POLICY,
        preparers: list | None = None,
        prefetcher=None,
        device: Device | None = None,
        device_budget: int = 0,
    ):
        """preparers: per layer, what turns a record as read into its kernels' layout on the I/O thread, or
        None (plan.record_preparer). prefetcher: a prefetch.Prefetcher (reads ahead of need), or None.
        device, device_budget: an accelerator whose memory holds a tier of `device_budget` bytes of experts
        above the host cache (the host slots are pinned for its copies), or None."""
        if verify not in VERIFY_MODES:
            raise UsageError(f"verify must be one of {', '.join(VERIFY_MODES)}, not {verify!r}")
        self.store = store
        self.verify = verify
        self.read_timeout = read_timeout
        self._interrupted = threading.Event()  # set: every wait for a read ends at once (interrupt_waits)
        self._verified: set[tuple[int, int]] = set()  # records whose checksum matched since load
        self.layers = store.manifest.layers
        sizes = check_budget(store, budget_bytes)
        slot = sizes.stride_bytes
        self.stats_lock = threading.Lock()
        self.layer_stats = [LayerStats() for _ in self.layers]
        self.cache = ExpertCache(budget_bytes, slot, make_policy(policy, sizes.layer_experts), on_evict=self._evicted)
        self.reader = RecordReader([store.path(layer.file) for layer in self.layers], io_threads, direct_io)
        self.preparers = preparers if preparers is not None else [None] * len(self.layers)
        self.prefetcher = prefetcher
        self.tier = None
        if device is not None:
            device.pin(self.cache._arena_tensor)  # the tier's copies read the host slots
            self.tier = DeviceTier(device, device_budget, slot, make_policy(policy, sizes.layer_experts), self.record_views)
        self._ahead: list[Entry] = []  # reads ahead of need that may still be READING_AHEAD

    def _evicted(self, entry: Entry) -> None:
        with self.stats_lock:
            self.layer_stats[entry.key[0]].evictions += 1
        if entry.state is State.UNUSED:
            self.prefetcher.record_use(entry.key[0], False)

    # -- a forward pass and an experts call -------------------------------------------------------------

    def start_step(self, token_ids: list[int], input_ids: torch.Tensor) -> None:
        """A forward pass begins: the policy hears its tokens before any read of this step (as a replay
        tells it), and the experts of hash-routed layers, which the ids alone determine, are read."""
        self.cache.policy.on_step(token_ids)
        if self.prefetcher is not None:
            for layer, experts in self.prefetcher.exact(input_ids).items():
                self._read_ahead(layer, experts, exact=True)

    def provide(self, layer: int, experts: list[int], hidden: torch.Tensor, compute: Compute) -> None:
        """Make `experts` (distinct, ascending ids) of `layer` ready and hand them to `compute` as they are:
        those in the device tier at once, then the host cache's hits while the misses are read, then each
        miss as its read lands. `hidden`: the call's input, from which the prefetcher predicts the next
        layer's experts once every miss is on its way."""
        if self._interrupted.is_set():  # a stopping model ends its step at the next layer, before it pins a slot
            raise ReadsInterrupted("the forward pass was interrupted: the model is stopping")
        self.cache.reclaim()
        self._collect_ahead()
        on_device = self._device_lookup(layer, experts)
        call = start_call(self.cache, layer, [e for e in experts if e not in on_device] if on_device else experts)
        with self.stats_lock:
            stats = self.layer_stats[layer]
            stats.hits += call.hits + len(on_device)
            stats.device_hits += len(on_device)
            stats.misses += call.misses
        if self.prefetcher is not None:
            for _ in call.used_ahead:
                self.prefetcher.record_use(layer, True)
            self.prefetcher.observe(layer, experts)
        if on_device:  # first: their slots then wait only on queued work
            compute([(e, entry.tensors) for e, entry in on_device.items()])
            for entry in on_device.values():
                self.tier.done_with(entry)

        read_ahead = None if self.prefetcher is None else functools.partial(self._read_ahead_after, layer, hidden)
        call.run(self, functools.partial(self._hand_over, compute), read_ahead)

    def _read_ahead_after(self, layer: int, hidden: torch.Tensor) -> None:
        """Every miss of `layer` is on its way: read ahead the next layer's likely experts."""
        self._read_ahead(layer + 1, self.prefetcher.predict(layer, hidden))

    def _hand_over(self, compute: Compute, entries: list[Entry]) -> None:
        """Ready host entries to `compute`: as they are on the CPU, or each through a device slot it is first
        copied into (device_tier.py)."""
        if self.tier is None:
            compute([(entry.key[1], entry.tensors) for entry in entries])
            return
        for entry in entries:
            layer = entry.key[0]
            staged = self.tier.stage(entry, self.cache, self.cache.slot_tensor(entry.slot), self.layers[layer].layout.nbytes)
            try:
                compute([(entry.key[1], staged.tensors)])
            finally:
                self.tier.done_with(staged)
                self.tier.release()  # copies that are over give their host slots back to this call's misses

    def _device_lookup(self, layer: int, experts: list[int]) -> dict[int, Entry]:
        """The call's experts found in the device tier (pinned), by id; none without one."""
        if self.tier is None:
            return {}
        self.tier.release()
        found = {}
        for e in experts:
            entry = self.tier.lookup(layer, e)
            if entry is not None:
                found[e] = entry
        return found

    # -- reads (cache.CallIO) ----------------------------------------------------------------------------

    def start_read(self, entry: Entry, priority: bool = True) -> None:
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

    def landed(self, in_flight: list[Entry], oldest_only: bool) -> list[Entry]:
        """Block until a read of `in_flight` (its first, if `oldest_only`) is over; those that are. A read
        that takes longer than `read_timeout` is an error naming the file."""
        layer = in_flight[0].key[0]
        t0 = time.perf_counter()
        done = self._first_done([in_flight[0].read] if oldest_only else [entry.read for entry in in_flight])
        with self.stats_lock:
            self.layer_stats[layer].wait_seconds += time.perf_counter() - t0
        if not done:
            stalled = sorted(entry.key[1] for entry in in_flight)
            raise ExpertReadError(
                f"no read of layer {layer}'s experts {stalled} finished within {self.read_timeout:g} s "
                f"from {self.store.path(self.layers[layer].file)}: the disk is stalled or failing"
            )
        return [entry for entry in in_flight if entry.read in done]

    def _first_done(self, reads: list) -> set:
        """Wait up to `read_timeout` for one of `reads` to be over; those that are (empty: none in time). In
        slices, so that interrupt_waits() ends the wait within one slice rather than at the timeout."""
        t0 = time.perf_counter()
        done: set = set()
        while not done and (left := self.read_timeout - (time.perf_counter() - t0)) > 0:
            if self._interrupted.is_set():
                raise ReadsInterrupted("the wait for expert reads was interrupted: the model is stopping")
            done, _ = wait(reads, timeout=min(left, WAIT_SLICE_SECONDS), return_when=FIRST_COMPLETED)
        return done

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
        with self.stats_lock:
            stats = self.layer_stats[layer]
            stats.bytes_read += spec.layout.stride
            stats.read_seconds += result.seconds
            stats.verify_seconds += result.verify_seconds
            stats.prepare_seconds += result.prepare_seconds
        entry.tensors = self.record_views(layer, self.cache.slot_tensor(entry.slot))
        entry.read = None
        entry.state = State.UNUSED if entry.state is State.READING_AHEAD else State.READY

    def abandon(self, in_flight: list[Entry]) -> None:
        """Never leave a half-read slot in the cache, and never hand out a slot that a still-running read
        may yet write into."""
        for entry in in_flight:
            entry.read.cancel()
            if entry.read.done():
                self.cache.discard(entry)
            else:
                self.cache.park(entry)

    def make_room(self) -> bool:
        if self.tier is not None and self.tier.wait_oldest():
            return True
        # Slots that stalled reads still hold (parked) come back when those reads end: wait for one, as for a
        # read of this call, rather than tell the user to raise a budget that was enough.
        parked = self.cache.parked
        if not parked:
            return False
        if not self._first_done([entry.read for entry in parked]):
            raise ExpertReadError(
                f"{len(parked)} of the expert cache's slots are held by reads the disk has not finished for "
                f"{self.read_timeout:g} s: the disk is stalled or failing"
            )
        self.cache.reclaim()
        return True

    # -- reads ahead of need -----------------------------------------------------------------------------

    def _read_ahead(self, layer: int, experts: list[int], exact: bool = False) -> None:
        """Start reads of `layer`'s likely experts into slots the policy gives up (never a pinned or loading
        one); on the speculative queue unless `exact` (certain to be used: a hash-routed layer)."""
        for e in experts:
            if (layer, e) in self.cache:
                continue
            entry = self.cache.allocate((layer, e), State.READING_AHEAD)
            if entry is None:
                return
            self.start_read(entry, priority=exact)
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

    # -- records and statistics ----------------------------------------------------------------------------

    def record_views(self, layer: int, raw: torch.Tensor) -> dict[str, torch.Tensor]:
        """A record's tensors as views into the bytes of a slot holding it (host or device memory)."""
        return {
            t.name: raw[t.offset : t.offset + t.nbytes].view(DTYPES[t.dtype]).view(t.shape)
            for t in self.layers[layer].layout.tensors
        }

    def count_rerouted(self, layer: int, choices: int) -> None:
        with self.stats_lock:
            self.layer_stats[layer].rerouted += choices

    def snapshot(self) -> dict:
        """The supply's statistics, overall and per layer; waits for no read."""
        with self.stats_lock:
            layers = [asdict(s) for s in self.layer_stats]
        hits = sum(s["hits"] for s in layers)
        misses = sum(s["misses"] for s in layers)
        tier = self.tier
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
            "device_cache_slots": tier.capacity if tier is not None else 0,
            "device_cache_budget_bytes": tier.cache.budget_bytes if tier is not None else 0,
            "device_cached_experts": len(tier.cache) if tier is not None else 0,
            "device_waits": tier.waits if tier is not None else 0,
            "prefetch": self.prefetcher.report() if self.prefetcher is not None else None,
            "layers": layers,
        }

    def reset_stats(self) -> None:
        with self.stats_lock:
            self.layer_stats = [LayerStats() for _ in self.layers]

    def interrupt_waits(self, interrupted: bool = True) -> None:
        """While interrupted, a wait for reads raises ReadsInterrupted instead of waiting, and so does the next
        layer's `provide` (any thread may call this): a server that stops ends a step held by a stalled disk at
        once, not at the read timeout, and a long prefill step within one layer. The reads themselves go on;
        `abandon` keeps their slots out of use. interrupted=False: compute and wait again."""
        if interrupted:
            self._interrupted.set()
        else:
            self._interrupted.clear()

    def close(self) -> None:
        if self.tier is not None:
            self.tier.drain()
        self.reader.close()

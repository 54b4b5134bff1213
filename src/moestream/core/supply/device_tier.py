"""The accelerator tier of the expert cache: experts in device memory (VRAM), above the host tier.

With `load(device="cuda")` an expert lives in up to two tiers, each with its own byte budget and its own
policy object: device slots (`--gpu-memory`) and the host cache (`--memory`, cache.py, its arena
page-locked), with the disk below both. An experts call first looks each expert up here. A device hit
computes at once. A device miss goes through the host cache's call (cache.py) as on CPU (a host hit, or a read
from disk into a host slot); once the host entry is ready, `stage` copies it into a device slot on the
copy queue and the kernel runs on that slot: that is the promotion. An expert evicted from the device
tier is dropped there; the host tier keeps or drops its own copy by its own policy.

Slot lifetimes, so that no buffer is reused while queued work may still touch it:
- a device slot is pinned from its lookup or staging until the event recorded after the kernels that
  read it has completed (`done_with`, then `release`);
- a host slot is pinned from its copy's start until the copy's event has completed;
- an entry is evictable only when unpinned (cache.py's rule), so a slot whose event is still pending is
  never handed out. When every device slot is pinned by pending work, `stage` waits for the oldest
  event rather than reuse one early.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from ..devices import Device, Event
from .cache import Entry, ExpertCache, State


class DeviceTier:
    def __init__(
        self,
        device: Device,
        budget_bytes: int,
        slot_bytes: int,
        policy,
        views: Callable[[int, torch.Tensor], dict[str, torch.Tensor]],
    ):
        """`views(layer, raw)`: the record's tensors as views into a slot's bytes `raw`."""
        self.device = device
        self.cache = ExpertCache(budget_bytes, slot_bytes, policy, arena=False)
        self.slots = device.empty(max(self.cache.capacity, 1) * slot_bytes)
        self.views = views
        self.pending: deque[tuple[Event, Entry, ExpertCache]] = deque()  # pins held until each event is over
        self.hits = 0
        self.waits = 0  # times every device slot was held by pending work and `stage` had to wait

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    def release(self) -> None:
        """Unpin the entries whose events have completed (cheap: called before each experts call)."""
        pending = self.pending
        kept = deque()
        while pending:
            event, entry, cache = pending.popleft()
            if event.query():
                cache.unpin(entry)
            else:
                kept.append((event, entry, cache))
        self.pending = kept

    def wait_oldest(self) -> bool:
        """Block on the oldest pending event, then release what is over; False if nothing is pending."""
        if not self.pending:
            return False
        event, entry, cache = self.pending.popleft()
        event.synchronize()
        cache.unpin(entry)
        self.waits += 1
        self.release()
        return True

    def lookup(self, layer: int, expert: int) -> Entry | None:
        """The device entry of (layer, expert), pinned, or None."""
        entry = self.cache.lookup((layer, expert))
        if entry is None:
            return None
        self.cache.pin(entry)
        self.hits += 1
        return entry

    def stage(self, host: Entry, host_cache: ExpertCache, raw_host: torch.Tensor, nbytes: int) -> Entry:
        """Copy a ready host entry's first `nbytes` (its slot `raw_host`) into a device slot; returns the
        device entry, pinned, its tensors ready for kernels queued after this call."""
        key = host.key
        entry = self.cache.allocate(key, State.READY)
        while entry is None:  # every slot is held by queued work: wait for the oldest, never reuse early
            if not self.wait_oldest():
                raise RuntimeError("every device slot is pinned with no work queued on it (a bookkeeping error)")
            entry = self.cache.allocate(key, State.READY)
        self.cache.pin(entry)
        start = entry.slot * self.cache.slot_bytes
        raw = self.slots[start : start + self.cache.slot_bytes]
        copied = self.device.copy(raw[:nbytes], raw_host[:nbytes])
        host_cache.pin(host)  # the copy reads the host slot until `copied` completes
        self.pending.append((copied, host, host_cache))
        entry.tensors = self.views(key[0], raw)
        return entry

    def done_with(self, entry: Entry) -> None:
        """The kernels reading `entry` are queued: it stays pinned until an event after them completes."""
        self.pending.append((self.device.record(), entry, self.cache))

    def drain(self) -> None:
        """Wait for every pending event and unpin (closing, or after an error)."""
        while self.pending:
            event, entry, cache = self.pending.popleft()
            event.synchronize()
            cache.unpin(entry)

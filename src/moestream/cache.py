"""A byte-budgeted cache of expert records: fixed-size slots in one arena, pins, a pluggable policy.

The cache owns memory and decides what to evict (with a policy from policies.py). It does not know files
or models: the runtime asks for a slot, has the reader fill it, and pins what it computes with. All
bookkeeping happens on the thread that runs the model; I/O threads only write bytes into slots they were
handed. The offline simulator (simulate.py) drives the same class without an arena.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .policies import LRUPolicy

Key = Hashable  # (layer, expert) in the runtime


@dataclass
class Entry:
    key: Key
    slot: int
    pins: int = 0
    loading: Future | None = None  # set while the record is being read into the slot
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # views into the slot, once loaded


class ExpertCache:
    def __init__(
        self,
        budget_bytes: int,
        slot_bytes: int,
        policy=None,
        on_evict: Callable[[Key], None] | None = None,
        arena: bool = True,
    ):
        """arena=False: bookkeeping only, no slot memory (the simulator replays routing with it)."""
        self.slot_bytes = slot_bytes
        self.on_evict = on_evict
        self.capacity = budget_bytes // slot_bytes
        self.budget_bytes = budget_bytes
        self.policy = policy or LRUPolicy()
        self.policy.attach(self.capacity)
        self._entries: dict[Key, Entry] = {}
        self._free: list[int] = list(range(self.capacity - 1, -1, -1))
        self._arena = self._arena_tensor = None
        if arena:
            # One anonymous mapping: page-aligned (O_DIRECT needs it) and committed by the OS only as slots
            # are first filled, so resident memory grows with use up to the budget, never beyond.
            self._arena = mmap.mmap(-1, max(self.capacity, 1) * slot_bytes)
            self._arena_tensor = torch.frombuffer(self._arena, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        """Whether `key` has a slot (loaded or loading), without counting as a use."""
        return key in self._entries

    def lookup(self, key: Key) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self.policy.on_hit(key)
        return entry

    def allocate(self, key: Key) -> Entry | None:
        """A slot for `key`, evicting an unpinned entry if needed; None when every slot is pinned."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.policy.victim(lambda k: self._entries[k].pins == 0, key)
            if victim is None:
                return None
            slot = self._entries.pop(victim).slot
            self.policy.on_remove(victim)
            if self.on_evict is not None:
                self.on_evict(victim)
        entry = Entry(key, slot)
        self._entries[key] = entry
        self.policy.on_insert(key)
        return entry

    def discard(self, key: Key, reuse_slot: bool = True) -> int | None:
        """Forget an entry whose read failed: its slot holds no valid bytes.

        reuse_slot=False keeps the slot out of the free list and returns it: a read that has not finished
        may still write into it, so the caller hands it back with `release_slot` once that read is over.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.policy.on_remove(key)
        if reuse_slot:
            self._free.append(entry.slot)
        return entry.slot

    def release_slot(self, slot: int) -> None:
        self._free.append(slot)

    def slot_memory(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._arena)[start : start + self.slot_bytes]

    def slot_tensor(self, slot: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self._arena_tensor[start : start + self.slot_bytes]

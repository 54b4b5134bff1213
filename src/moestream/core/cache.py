"""A byte-budgeted cache of expert records: fixed-size slots in one arena, entry states, pins, a policy.

The cache owns memory and decides what to evict (with a policy from policies.py). It does not know files
or models: the scheduler (scheduler.py) asks it for a slot, the engine has the reader fill it, and whoever
computes with an entry pins it. All bookkeeping happens on the thread that runs the model; I/O threads
only write bytes into slots they were handed. The simulator (simulate.py) drives the same class without
an arena.

Invariants: an entry may be evicted only when it is unpinned and its bytes are complete (READY or
UNUSED), so no slot is ever handed out while a read may still write into it or a kernel reads it; a
parked slot (its read abandoned while still running) returns to the free list only once that read is over.
"""

from __future__ import annotations

import enum
import mmap
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .policies import LRUPolicy

Key = Hashable  # (layer, expert) in the engine


class State(enum.Enum):
    LOADING = "loading"  # a read the current call waits for is filling the slot
    READING_AHEAD = "reading-ahead"  # a read started before the record was needed (speculative or exact)
    READY = "ready"  # complete, checked bytes
    UNUSED = "speculative-unused"  # read ahead, complete, not looked up since
    STALLED = "stalled"  # its read was abandoned while still running: out of the cache, slot parked


EVICTABLE = (State.READY, State.UNUSED)


@dataclass(eq=False)
class Entry:
    key: Key
    slot: int
    state: State
    pins: int = 0  # computations that use the slot's bytes now
    read: Future | None = None  # the read filling the slot, while LOADING / READING_AHEAD / STALLED
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # views into the slot, once READY


class ExpertCache:
    def __init__(
        self,
        budget_bytes: int,
        slot_bytes: int,
        policy=None,
        on_evict: Callable[[Entry], None] | None = None,
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
        self.parked: list[Entry] = []  # STALLED entries whose slots wait for their reads to end
        self._arena = self._arena_tensor = None
        if arena:
            # One anonymous mapping: page-aligned (O_DIRECT needs it) and committed by the OS only as slots
            # are first filled, so resident memory grows with use up to the budget, never beyond.
            self._arena = mmap.mmap(-1, max(self.capacity, 1) * slot_bytes)
            self._arena_tensor = torch.frombuffer(self._arena, dtype=torch.uint8)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:
        """Whether `key` has a slot (in any state), without counting as a use."""
        return key in self._entries

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def free_slots(self) -> list[int]:
        return list(self._free)

    def lookup(self, key: Key) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self.policy.on_hit(key)
        return entry

    def allocate(self, key: Key, state: State) -> Entry | None:
        """A slot for `key`, evicting an evictable entry if needed; None when there is none."""
        if self._free:
            slot = self._free.pop()
        else:
            victim = self.policy.victim(self._evictable, key)
            if victim is None:
                return None
            evicted = self._entries.pop(victim)
            slot = evicted.slot
            self.policy.on_remove(victim)
            if self.on_evict is not None:
                self.on_evict(evicted)
        entry = Entry(key, slot, state)
        self._entries[key] = entry
        self.policy.on_insert(key)
        return entry

    def _evictable(self, key: Key) -> bool:
        entry = self._entries[key]
        return entry.pins == 0 and entry.state in EVICTABLE

    def pin(self, entry: Entry) -> None:
        entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        entry.pins -= 1

    def discard(self, entry: Entry) -> None:
        """Forget an entry whose read failed and is over: its slot holds no valid bytes."""
        if self._forget(entry):
            self._free.append(entry.slot)

    def park(self, entry: Entry) -> None:
        """Forget an entry whose read was abandoned while still running: the key may be read again into
        another slot, but this slot stays out of use until `reclaim` sees the read over."""
        if self._forget(entry):
            entry.state = State.STALLED
            self.parked.append(entry)

    def reclaim(self) -> None:
        """Free the parked slots whose reads have ended."""
        if self.parked:
            done = [entry for entry in self.parked if entry.read.done()]
            for entry in done:
                self.parked.remove(entry)
                self._free.append(entry.slot)

    def _forget(self, entry: Entry) -> bool:
        if self._entries.get(entry.key) is not entry:
            return False
        del self._entries[entry.key]
        self.policy.on_remove(entry.key)
        return True

    def slot_memory(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._arena)[start : start + self.slot_bytes]

    def slot_tensor(self, slot: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self._arena_tensor[start : start + self.slot_bytes]

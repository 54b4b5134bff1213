"""A byte-budgeted cache of expert records, and the order of its operations in one experts call.

The cache owns memory and decides what to evict (with a policy from policies.py): fixed-size slots in
one arena, entry states, pins. It does not know files or models. All bookkeeping happens on the thread
that runs the model; I/O threads only write bytes into slots they were handed.

What the cache evicts depends only on the order of its lookups, allocations and unpins in each experts
call, so that order lives here, once (`start_call`, `Call.run`). The expert supply (expert_supply.py) drives it
with real reads into real slots, handing the experts to the engine's compute; the simulator
(simulate.py) drives it without an arena, with reads that land at once. Because neither can reorder
anything, a replayed trace gets exactly the runtime's hits (tests/test_simulate.py).

Per call of layer L that needs the distinct experts E (ascending ids):
  1. `start_call`: tell the policy the call's experts (`on_call`), then look up each expert of E in
     order. A hit is pinned (or, if its read ahead of need is still in flight, becomes a demand read that
     the call waits for); a miss waits for a slot.
  2. `Call.run`: allocate slots for the misses in order while a slot can be had, starting each read;
     once every miss has a slot, say so (`demand_issued`: the supply then reads ahead for layer L+1).
     Compute the hits while the reads are in flight and unpin them, then allocate again (their slots may
     now be evicted). Then, while reads are in flight: take landed reads (in issue order while misses
     still wait for slots, so evictions never depend on I/O timing), compute and unpin each, allocate
     again.
  3. A call that needs more experts than the cache has unpinned slots runs in waves this way; one whose
     misses can get no slot at all with nothing in flight and no queued work holding slots
     (`CallIO.make_room`) is an error (the budget is too small).

Invariants: an entry may be evicted only when it is unpinned and its bytes are complete (READY or
UNUSED), so no slot is ever handed out while a read may still write into it or a kernel reads it; a
parked slot (its read abandoned while still running) returns to the free list only once that read is over.
"""

from __future__ import annotations

import enum
import mmap
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...errors import ExpertReadError, UsageError
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


# -- one experts call ---------------------------------------------------------------------------------


class CallIO(Protocol):
    """What one experts call needs from the side that does the reads."""

    def start_read(self, entry: Entry) -> None:
        """Begin filling `entry`'s slot with its record (entry is LOADING and pinned)."""

    def landed(self, in_flight: list[Entry], oldest_only: bool) -> list[Entry]:
        """Block until at least one read of `in_flight` (only its first, if `oldest_only`) is over; those."""

    def finish_read(self, entry: Entry) -> None:
        """Check a read that is over and make the entry READY; raise (having discarded it) if it failed."""

    def abandon(self, in_flight: list[Entry]) -> None:
        """The call failed with these reads in flight: they must not stay cached half-written."""

    def make_room(self) -> bool:
        """No slot can be had and no read is in flight: wait for queued work that holds slots (a copy to
        the device tier reading a host slot, a stalled read's parked slot) and release them; False if there
        is none."""


class Call:
    """One experts call between its lookups and its end: which experts hit, which wait for a read."""

    def __init__(self, cache: ExpertCache, layer: int):
        self.cache = cache
        self.layer = layer
        self.ready: list[Entry] = []  # hits, pinned
        self.waiting: deque[int] = deque()  # misses still without a slot, in lookup order
        self.in_flight: list[Entry] = []  # pinned, reads in issue order
        self.used_ahead: list[Entry] = []  # hits on reads made ahead of need (for the prefetcher's score)
        self.hits = 0
        self.misses = 0

    def run(self, io: CallIO, compute: Callable[[list[Entry]], None], demand_issued: Callable[[], None] | None = None) -> None:
        """The call's reads through `io`, and its experts (ready, pinned) to `compute` on the call's tokens:
        the hits together, then each miss as its read lands. `demand_issued` is called once every miss has a
        slot and a read: the moment to read ahead for the next layer."""
        cache, waiting, in_flight, ready = self.cache, self.waiting, self.in_flight, self.ready
        try:
            self._issue(io)
            if not waiting and demand_issued is not None:  # demand first: reading ahead only once every miss is on its way
                demand_issued()
            if ready:  # hits compute while the misses are read
                compute(ready)
            while ready:
                cache.unpin(ready.pop())
            self._issue(io)  # the hits' slots are evictable now
            while in_flight or waiting:
                if not in_flight and io.make_room():
                    self._issue(io)
                    continue
                if not in_flight:
                    raise UsageError(
                        f"the expert cache ({cache.capacity} slots) has no free slot for layer {self.layer}; raise --memory"
                    )
                for entry in io.landed(in_flight, oldest_only=bool(waiting)):
                    in_flight.remove(entry)
                    ready.append(entry)  # unpinned below, or by `finally` if its read or compute fails
                    try:
                        io.finish_read(entry)
                    except ExpertReadError:
                        if entry not in self.used_ahead:
                            raise
                        # A read made ahead of need failed (finish_read discarded it): its expert is read
                        # again on demand, and a guess never fails a token.
                        cache.unpin(ready.pop())
                        waiting.append(entry.key[1])
                        continue
                    compute([entry])
                    cache.unpin(ready.pop())
                self._issue(io)  # slots freed by the experts just computed take the reads that did not fit
        finally:
            # Only reached with work left after an error.
            if in_flight:
                io.abandon(in_flight)
                in_flight.clear()
            while ready:
                cache.unpin(ready.pop())

    def _issue(self, io: CallIO) -> None:
        while self.waiting:
            entry = self.cache.allocate((self.layer, self.waiting[0]), State.LOADING)
            if entry is None:
                return  # every slot is pinned or being written: wait for a computation to release one
            self.waiting.popleft()
            self.cache.pin(entry)
            self.in_flight.append(entry)
            io.start_read(entry)


def start_call(cache: ExpertCache, layer: int, experts) -> Call:
    """Step 1 of a call: look up `experts` (distinct, ascending ids) of `layer`."""
    call = Call(cache, layer)
    cache.policy.on_call(layer, experts)
    for e in experts:
        entry = cache.lookup((layer, e))
        if entry is None:
            call.waiting.append(e)
            continue
        if entry.state is State.READING_AHEAD:  # needed now: its read becomes this call's to wait for
            entry.state = State.LOADING
            cache.pin(entry)
            call.in_flight.append(entry)
            call.used_ahead.append(entry)
            continue
        if entry.state is State.UNUSED:
            entry.state = State.READY
            call.used_ahead.append(entry)
        cache.pin(entry)
        call.ready.append(entry)
    call.misses = len(call.waiting)
    call.hits = len(experts) - call.misses
    return call

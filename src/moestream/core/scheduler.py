"""The order of cache operations in one experts call, shared by the engine and the simulator.

What the cache evicts depends only on the order of its lookups, allocations and unpins, so that order
lives here, once. The expert supply (supply.py) drives it with real reads into real slots, handing the
experts to the engine's compute; the simulator (simulate.py) with reads that land at once. Because neither can reorder anything, a replayed trace gets
exactly the runtime's hits (tests/test_simulate.py).

Per call of layer L that needs the distinct experts E (ascending ids):
  1. `lookup`: tell the policy the call's experts (`on_call`), then look up each expert of E in order. A
     hit is pinned (or, if its read ahead of need is still in flight, becomes a demand read that the call
     waits for); a miss waits for a slot.
  2. `Call.run`: allocate slots for the misses in order while a slot can be had, starting each read;
     once every miss has a slot, say so (`demand_issued`: the supply then reads ahead for layer L+1). Compute
     the hits while the reads are in flight and unpin them, then allocate again (their slots may now be
     evicted). Then, while reads are in flight: take landed reads (in issue order while misses still wait
     for slots, so evictions never depend on I/O timing), compute and unpin each, allocate again.
  3. A call that needs more experts than the cache has unpinned slots runs in waves this way; one whose
     misses can get no slot at all with nothing in flight and no queued work holding slots
     (`CallIO.make_room`) is an error (the budget is too small).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from ..errors import UsageError
from .cache import Entry, ExpertCache, State


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
        the device tier reading a host slot) and release them; False if there is none."""


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
                    io.finish_read(entry)
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


def lookup(cache: ExpertCache, layer: int, experts) -> Call:
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

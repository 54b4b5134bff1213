"""Replay a routing trace through the expert cache offline: hit rate and bytes read per token, per policy
and budget, next to Belady's optimum.

The replay drives the runtime's own ExpertCache (without slot memory), its own policy objects and its
own call order (cache.py: `start_call`, `Call.run`), which alone decides the order of cache operations in an experts call; only
the reads differ: here they land at once, in issue order. So for the same trace, budget and policy, the
replay's hits equal the runtime's exactly (tests/test_simulate.py). That is for demand reads: a
speculative prefetch reads experts from predictions that a trace does not hold, so runs with prefetch on
are compared with prefetch off.

Belady's MIN (evict the entry whose next use is farthest away) needs the future, so it exists only here.
It runs under the same rules (demand reads, the call's experts pinned), which makes it the optimum for
those rules: no online policy can have more hits on the same trace and capacity.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from ..core.supply.cache import Entry, ExpertCache, State, start_call
from ..core.supply.policies import DEFAULT_POLICY, Policy, make_policy, policy_class
from ..errors import UsageError
from .trace import Trace

BELADY = "belady"


@dataclass(frozen=True)
class SimResult:
    policy: str
    slots: int
    slot_bytes: int
    hits: int
    misses: int
    bytes_read: int
    tokens: int
    # The same for decode calls only (one token per call), which is what decoding speed depends on.
    decode_hits: int = 0
    decode_misses: int = 0
    decode_bytes_read: int = 0
    decode_tokens: int = 0
    decode_miss_calls: tuple[int, ...] = ()  # [m]: decode calls (one layer, one token) that missed m experts

    @property
    def decode_hit_rate(self) -> float:
        total = self.decode_hits + self.decode_misses
        return self.decode_hits / total if total else 0.0

    @property
    def decode_bytes_per_token(self) -> float:
        return self.decode_bytes_read / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def budget_bytes(self) -> int:
        return self.slots * self.slot_bytes

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_read / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict:
        return {
            "policy": self.policy,
            "budget_bytes": self.budget_bytes,
            "slots": self.slots,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "bytes_read": self.bytes_read,
            "bytes_per_token": self.bytes_per_token,
            "decode_hit_rate": self.decode_hit_rate,
            "decode_bytes_per_token": self.decode_bytes_per_token,
        }


class BeladyPolicy(Policy):
    """MIN: evict the unpinned entry whose next use (an experts call index) is farthest in the future."""

    name = BELADY

    def __init__(self, next_use: list[dict[int, float]]):
        self.next_use = next_use  # per call: expert -> index of the next call of that layer that uses it
        self.now = 0  # the call being replayed, set by the replay loop
        self._current: dict = {}  # cached key -> its next use
        self._heap: list = []  # (-next use, seq, key); stale rows are skipped
        self._seq = 0

    def _touch(self, key) -> None:
        nxt = self.next_use[self.now][key[1]]
        self._current[key] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, key))
        if len(self._heap) > 4 * len(self._current) + 64:
            self._heap = [(-n, i, k) for i, (k, n) in enumerate(self._current.items(), start=self._seq + 1)]
            self._seq += len(self._heap)
            heapq.heapify(self._heap)

    on_hit = on_insert = _touch

    def on_remove(self, key) -> None:
        self._current.pop(key, None)

    def victim(self, evictable, incoming=None):
        skipped, chosen = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            key = item[2]
            if self._current.get(key) != -item[0]:
                continue  # stale row
            skipped.append(item)
            if evictable(key):
                chosen = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)
        return chosen


def next_uses(calls: list[tuple[int, tuple[int, ...]]]) -> list[dict[int, float]]:
    """For each call and each of its experts, the index of the next call that uses the same (layer, expert)."""
    out: list[dict[int, float]] = [{} for _ in calls]
    last: dict[tuple[int, int], float] = {}
    for c in range(len(calls) - 1, -1, -1):
        layer, experts = calls[c]
        row = out[c]
        for e in experts:
            row[e] = last.get((layer, e), math.inf)
            last[(layer, e)] = c
    return out


class InstantReads:
    """A call's I/O side for a replay: every read lands at once, in issue order; no compute."""

    def start_read(self, entry: Entry) -> None:
        pass

    def landed(self, in_flight: list[Entry], oldest_only: bool) -> list[Entry]:
        return [in_flight[0]]

    def finish_read(self, entry: Entry) -> None:
        entry.state = State.READY

    def abandon(self, in_flight: list[Entry]) -> None:
        pass

    def make_room(self) -> bool:
        return False


def _no_compute(entries: list[Entry]) -> None:
    pass


def replay(trace: Trace, slots: int, policy="lru", record_bytes: np.ndarray | None = None) -> SimResult:
    """Replay `trace` through a cache of `slots` records under `policy`: a POLICIES name, "belady", or a
    fresh policy object (a variant under study, as in docs/DECISIONS.md, "The forecast policy's signals").

    record_bytes: bytes read per miss of each layer (default: the trace's store); the slot size is their
    maximum, as in the runtime."""
    strides = trace.record_bytes if record_bytes is None else np.asarray(record_bytes)
    slot_bytes = int(strides.max())
    if slots < 1:
        raise UsageError("the cache needs at least one slot")
    calls = trace.call_experts
    belady = None
    if policy == BELADY:
        belady = BeladyPolicy(next_uses(calls))
        pol = belady
    elif isinstance(policy, str):
        pol = make_policy(policy, trace.layer_experts.tolist())
    else:
        pol, policy = policy, policy.name
    cache = ExpertCache(slots * slot_bytes, slot_bytes, pol, arena=False)
    io = InstantReads()
    hits = decode_hits = 0
    misses_per_layer = np.zeros(trace.layers, dtype=np.int64)
    decode_misses_per_layer = np.zeros(trace.layers, dtype=np.int64)
    decode = (trace.call_rows == 1).tolist()
    miss_calls = [0] * (int(trace.layer_experts.max()) + 1)
    step_starts = trace.step_starts
    for c, (layer, experts) in enumerate(calls):
        if belady is not None:
            belady.now = c
        if c in step_starts:  # as ExpertEngine.start_step tells it, before the step's first call
            pol.on_step(step_starts[c])
        call = start_call(cache, layer, experts)
        call.run(io, _no_compute)
        hits += call.hits
        misses_per_layer[layer] += call.misses
        if decode[c]:
            decode_hits += call.hits
            decode_misses_per_layer[layer] += call.misses
            miss_calls[call.misses] += 1
    misses = int(misses_per_layer.sum())
    return SimResult(
        policy=policy,
        slots=slots,
        slot_bytes=slot_bytes,
        hits=hits,
        misses=misses,
        bytes_read=int((misses_per_layer * strides.astype(np.int64)).sum()),
        tokens=trace.tokens,
        decode_hits=decode_hits,
        decode_misses=int(decode_misses_per_layer.sum()),
        decode_bytes_read=int((decode_misses_per_layer * strides.astype(np.int64)).sum()),
        decode_tokens=int(((trace.call_rows == 1) & (trace.call_layer == 0)).sum()),
        decode_miss_calls=tuple(miss_calls[: max([m for m, n in enumerate(miss_calls) if n] + [0]) + 1]),
    )


def minimum_slots(trace: Trace) -> int:
    """What the runtime accepts: one token's experts in one layer (ExpertEngine refuses less)."""
    return trace.top_k


def sweep(trace: Trace, budgets: list[int], policies: list[str], record_bytes: np.ndarray | None = None) -> list[list[SimResult]]:
    """One row per budget: the given policies, then Belady, at budget // slot slots."""
    for name in policies:
        policy_class(name)  # an unknown name fails before any replay
    strides = trace.record_bytes if record_bytes is None else np.asarray(record_bytes)
    slot = int(strides.max())
    rows = []
    for budget in budgets:
        slots = budget // slot
        if slots < minimum_slots(trace):
            raise UsageError(
                f"a budget of {budget} bytes holds {slots} experts of {slot} bytes; the runtime needs at least "
                f"{minimum_slots(trace)} (one token's experts in one layer): the minimum is {minimum_slots(trace) * slot} bytes"
            )
        rows.append([replay(trace, slots, p, strides) for p in [*policies, BELADY]])
    return rows


def parse_budgets(spec: str, trace: Trace) -> list[int]:
    """ "1GiB,2GiB" or "5%,10%" (of all the trace's expert records, in slots) -> byte budgets."""
    from ..units import parse_bytes

    slot = trace.slot_bytes
    records = int(trace.layer_experts.sum())
    budgets = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        if part.endswith("%"):
            try:
                fraction = float(part[:-1]) / 100
            except ValueError:
                raise UsageError(f"cannot read the budget {part!r}: write e.g. 10% or 1GiB") from None
            budgets.append(max(1, round(fraction * records)) * slot)
        else:
            budgets.append(parse_bytes(part))
    if not budgets:
        raise UsageError("--memory needs at least one budget, e.g. --memory 1GiB,2GiB or --memory 5%,10%,20%")
    return budgets


def shares_of_optimum(rows: list[list[SimResult]]) -> dict[str, list[float]]:
    """Each online policy's hits as a share of Belady's, per budget (rows from `sweep`)."""
    shares: dict[str, list[float]] = {}
    for row in rows:
        best = row[-1].hits
        for r in row[:-1]:
            shares.setdefault(r.policy, []).append(r.hits / best if best else 1.0)
    return shares


def closest_to_optimum(rows: list[list[SimResult]]) -> tuple[str, float]:
    """The online policy with the highest mean share of Belady's hits over the budgets."""
    means = {name: sum(v) / len(v) for name, v in shares_of_optimum(rows).items()}
    name = max(means, key=means.get)
    return name, means[name]


def table(trace: Trace, rows: list[list[SimResult]]) -> str:
    from ..units import format_bytes

    records = int(trace.layer_experts.sum())
    lines = [
        f"trace: {trace.describe()}; {format_bytes(trace.slot_bytes)} per expert read",
        f"{'budget':>10} {'experts':>14}  {'policy':<8} {'hit rate':>8} {'of optimum':>10} {'read/token':>11}",
    ]
    for row in rows:
        best = row[-1].hits
        for i, r in enumerate(row):
            budget = f"{format_bytes(r.budget_bytes):>10} {f'{r.slots} ({r.slots / records:.0%})':>14}" if i == 0 else " " * 25
            of_best = f"{r.hits / best:.2f}x" if best else "-"
            lines.append(f"{budget}  {r.policy:<8} {r.hit_rate:>8.1%} {of_best:>10} {format_bytes(r.bytes_per_token):>11}")
    shares = shares_of_optimum(rows)
    if shares:
        lines.append("share of Belady's hits, on average over these budgets:")
        for name, values in sorted(shares.items(), key=lambda item: -sum(item[1])):
            mark = "  (the default)" if name == DEFAULT_POLICY else ""
            lines.append(f"  {name:<8} {sum(values) / len(values):.2f}x  (lowest {min(values):.2f}x){mark}")
        name, score = closest_to_optimum(rows)
        lines.append(f"closest to the optimum: {name} ({score:.2f}x); the default policy is {DEFAULT_POLICY}")
    return "\n".join(lines)


def plot_grid(trace: Trace, budgets: list[int]) -> list[int]:
    """The budgets the hit-rate plot is drawn on: the requested ones plus a grid from the minimum to every
    expert cached, so that the curve has a shape whatever was asked."""
    records = int(trace.layer_experts.sum())
    slots = {b // trace.slot_bytes for b in budgets}
    slots |= {max(1, round(f * records)) for f in (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)}
    return sorted(s * trace.slot_bytes for s in slots if s >= minimum_slots(trace))

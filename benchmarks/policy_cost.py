"""What a cache policy itself costs the model thread: microseconds per call, per lookup, per eviction.

    python benchmarks/policy_cost.py benchmarks/traces/tiny-code-moe.npz --budget 8MiB
    python benchmarks/policy_cost.py benchmarks/traces/tiny-code-moe.npz --budget 10% --shape 48x128

The trace is replayed through the runtime's cache and scheduler (as `moestream simulate` does) with each
policy's methods timed: `on_step` (once per forward pass), `on_call` (once per experts call), `on_hit`
(per cached expert looked up),
`on_insert` / `on_remove`, and `victim` (per eviction). --shape LxE replays the trace's routing on a
model of L layers of E experts instead (the trace's layers and experts repeated: expert ids are offset per
copy), to see how the cost grows with the model (Qwen3-30B-A3B: 48x128; DeepSeek-V3: 58x256). Only the
policy's own time is counted, not the cache's or the scheduler's.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import numpy as np

from moestream.core import scheduler
from moestream.core.cache import ExpertCache
from moestream.core.policies import POLICIES, make_policy
from moestream.tools.simulate import InstantReads, parse_budgets
from moestream.tools.trace import Trace

METHODS = ("on_step", "on_call", "on_hit", "on_insert", "on_remove", "victim")


class Timed:
    """Forwards to a policy and adds up the time of each method."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name
        self.seconds, self.calls = defaultdict(float), defaultdict(int)
        for method in METHODS + ("attach",):
            setattr(self, method, self._timed(method, getattr(policy, method)))

    def _timed(self, method, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[method] += time.perf_counter() - t0
            self.calls[method] += 1
            return out

        return call


def widened(trace: Trace, layers: int, experts: int) -> tuple[list, dict]:
    """The trace's calls on a model of `layers` x `experts`: copies of its layers (and of its experts, with
    ids offset per copy, drawn per call so that the wider layer's experts all get used), and the steps'
    token ids at the calls that begin them (a decode trace: a step per pass over the layers)."""
    calls, starts, rng = [], {}, np.random.default_rng(0)
    base, width = trace.layers, int(trace.layer_experts.max())
    copies = max(1, experts // width)
    for token_start in range(0, len(trace.call_experts), base):
        block = trace.call_experts[token_start : token_start + base]
        if token_start in trace.step_starts:
            starts[len(calls)] = trace.step_starts[token_start]
        for layer in range(layers):
            _, ids = block[layer % len(block)]
            offset = width * int(rng.integers(copies))
            calls.append((layer, tuple(e + offset for e in ids)))
    return calls, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--budget", default="10%", help="a size (8MiB) or a share of all experts (10%%)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--shape", default=None, metavar="LxE", help="replay on L layers of E experts")
    parser.add_argument("--rounds", type=int, default=3, help="replays per policy; the fastest is shown")
    args = parser.parse_args()
    trace = Trace.load(args.trace)
    calls, starts, layer_experts = trace.call_experts, trace.step_starts, trace.layer_experts.tolist()
    slot = trace.slot_bytes
    slots = parse_budgets(args.budget, trace)[0] // slot
    if args.shape:
        layers, experts = (int(x) for x in args.shape.lower().split("x"))
        (calls, starts), layer_experts = widened(trace, layers, experts), [experts] * layers
        slots = round(slots / int(trace.layer_experts.sum()) * layers * experts)
    tokens = sum(1 for layer, _ in calls if layer == 0)
    print(
        f"{len(calls)} experts calls ({tokens} tokens), {len(layer_experts)} layers x {max(layer_experts)} experts, {slots} slots"
    )
    print(
        f"{'policy':<9} {'hit rate':>8} {'on_step':>9} {'on_call':>9} {'on_hit':>8} {'insert':>8} {'remove':>8} "
        f"{'victim':>8}   {'per token':>10}"
    )
    for name in args.policies.split(","):
        best = None
        for _ in range(args.rounds):
            timed = Timed(make_policy(name, layer_experts))
            cache, io, hits, misses = ExpertCache(slots, 1, timed, arena=False), InstantReads(), 0, 0
            for c, (layer, experts) in enumerate(calls):
                if c in starts:
                    timed.on_step(starts[c])
                call = scheduler.lookup(cache, layer, experts)
                call.run(io)
                hits, misses = hits + call.hits, misses + call.misses
            total = sum(timed.seconds[m] for m in METHODS)
            if best is None or total < best[0]:
                best = (total, timed, hits / (hits + misses))
        total, timed, hit_rate = best
        us = {m: 1e6 * timed.seconds[m] / max(1, timed.calls[m]) for m in METHODS}
        print(
            f"{name:<9} {hit_rate:>8.1%} {us['on_step']:>7.1f}us {us['on_call']:>7.1f}us {us['on_hit']:>6.1f}us "
            f"{us['on_insert']:>6.1f}us "
            f"{us['on_remove']:>6.1f}us {us['victim']:>6.1f}us   {1e3 * total / tokens:>7.3f} ms"
        )


if __name__ == "__main__":
    main()

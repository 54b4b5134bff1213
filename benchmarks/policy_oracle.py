"""How far the forecast policy is from what it could reach with perfect forecasts: replays in which the
policy is told which experts each layer's next call will use.

    python benchmarks/policy_oracle.py benchmarks/traces/*.npz

Variants (each the forecast, with the experts a layer's next call uses moved past every other cached
expert before each eviction, so they go last; ties by the forecast):
- `every layer`: told for all layers;
- `next layer only`: only for the layer that runs next (what a prefetcher can guess);
- `rest of this step`: only for the layers still to run in the current step (what the token tables
  approximate);
- `next step only`: only for the layers that already ran in this step.
Prints each variant's share of Belady's hits at 5, 10, 20 and 30% and their mean.
"""

import argparse

import numpy as np

from moestream.core.policies import ForecastPolicy
from moestream.tools.simulate import BELADY, parse_budgets, replay
from moestream.tools.trace import Trace

SCOPES = ("every layer", "next layer only", "rest of this step", "next step only")


class Told(ForecastPolicy):
    """The forecast, told the experts of some layers' next calls (`scope`)."""

    name = "told"

    def __init__(self, layer_experts, calls, scope: str):
        super().__init__(layer_experts)
        self.calls, self.scope, self.now = calls, scope, -1
        # after call c: for each layer, the experts of its next call (None past the end)
        upcoming, following = [None] * self.layers, []
        for layer, experts in reversed(calls):
            following.append(list(upcoming))
            upcoming[layer] = list(experts)
        self.following = following[::-1]

    def on_call(self, layer, experts):
        self.now += 1
        super().on_call(layer, experts)

    def _told(self, layer: int) -> bool:
        current = self.calls[self.now][0]
        return {
            "every layer": True,
            "next layer only": layer == (current + 1) % self.layers,
            "rest of this step": layer > current,
            "next step only": layer <= current,
        }[self.scope]

    def victim(self, evictable, incoming=None):
        saved = self._masked.copy()
        for layer, experts in enumerate(self.following[self.now]):
            if experts and self._told(layer):
                told = [e for e in experts if np.isfinite(self._masked[layer, e])]
                self._masked[layer, told] += 1e6
            self._update_min(layer)
        try:
            return super().victim(evictable, incoming)
        finally:
            self._masked[:] = saved
            for layer in range(self.layers):
                self._update_min(layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--budgets", default="5%,10%,20%,30%")
    args = parser.parse_args()
    for path in args.traces:
        trace = Trace.load(path)
        slot, layer_experts = int(trace.record_bytes.max()), trace.layer_experts.tolist()
        shares = {name: [] for name in ("forecast", *SCOPES)}
        for budget in parse_budgets(args.budgets, trace):
            slots = budget // slot
            optimum = replay(trace, slots, BELADY).hits
            shares["forecast"].append(replay(trace, slots, ForecastPolicy(layer_experts)).hits / optimum)
            for scope in SCOPES:
                shares[scope].append(replay(trace, slots, Told(layer_experts, trace.call_experts, scope)).hits / optimum)
        print(path.rsplit("/", 1)[-1])
        for name, values in shares.items():
            print(f"  {name:<18} " + " ".join(f"{v:.3f}" for v in values) + f"   mean {np.mean(values):.3f}", flush=True)


if __name__ == "__main__":
    main()

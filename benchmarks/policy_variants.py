"""Two variants of the `forecast` policy against it, on recorded traces: share of Belady's hits per budget.

    python benchmarks/policy_variants.py benchmarks/traces/*.npz

- `expected-next-use`: the victim is the cached expert whose next use is expected last, taking the layer
  cycle into account: with p its forecast probability of use at its layer's next call, d the calls until
  that call and L the layers, under a constant p the next use comes after d + L (1 - p) / p calls. (The
  earlier cycle weighting, p / d, lost on DeepSeek-V3; this one reduces to p alone for small p.)
- `per-layer-weights`: one weight vector of the online regression per layer instead of one shared.

Each variant is a subclass of ForecastPolicy registered for the simulator's replay (exact runtime order).
"""

import argparse

import numpy as np

import moestream.tools.simulate as simulate
from moestream.core.policies import POLICIES, ForecastPolicy
from moestream.tools.simulate import parse_budgets, shares_of_optimum, sweep
from moestream.tools.trace import Trace


class ExpectedNextUse(ForecastPolicy):
    name = "expected-next-use"

    def __init__(self, layer_experts):
        super().__init__(layer_experts)
        self._current = 0

    def on_call(self, layer, experts):
        self._current = layer
        super().on_call(layer, experts)

    def _victim_layer(self):
        layers = self.layers
        d = (np.arange(layers) - self._current) % layers
        d[d == 0] = layers  # the current layer's experts wait a whole cycle
        p = 1.0 / (1.0 + np.exp(-self._layer_min.astype(np.float64)))  # each layer's least likely expert
        wait = np.where(np.isfinite(self._layer_min), d + layers * (1 - p) / np.maximum(p, 1e-12), -np.inf)
        return int(wait.argmax())  # (all -inf: a layer with nothing cached, which victim() stops at)


class PerLayerWeights(ForecastPolicy):
    name = "per-layer-weights"

    def __init__(self, layer_experts):
        super().__init__(layer_experts)
        self._layer_weights = np.zeros((self.layers, len(self._weights)), np.float32)
        self._layer_grad_sq = np.full((self.layers, len(self._weights)), 1e-3, np.float32)
        self._layer_calls = np.zeros(self.layers, int)

    def on_step(self, token_ids):
        # the token row's weight differs per layer: scale each layer's token update by its own weight
        shared = self._weights.copy()
        self._weights = self._layer_weights.mean(axis=0)
        super().on_step(token_ids)
        self._weights = shared

    def on_call(self, layer, experts):
        # the parent's update with this layer's weights and learning state swapped in
        self._weights, self._grad_sq = self._layer_weights[layer], self._layer_grad_sq[layer]
        self._calls = int(self._layer_calls[layer])
        super().on_call(layer, experts)
        self._layer_calls[layer] = self._calls


def _make(name, layer_experts):
    cls = POLICIES[name]
    return cls(layer_experts) if issubclass(cls, ForecastPolicy) else cls()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--budgets", default="5%,10%,20%,30%")
    args = parser.parse_args()
    for cls in (ExpectedNextUse, PerLayerWeights):
        POLICIES[cls.name] = cls
    simulate.make_policy = _make  # the simulator builds these subclasses with their layer sizes too
    names = ["lfu", "forecast", ExpectedNextUse.name, PerLayerWeights.name]
    print(f"share of Belady's hits at {args.budgets}, then the mean")
    for path in args.traces:
        trace = Trace.load(path)
        shares = shares_of_optimum(sweep(trace, parse_budgets(args.budgets, trace), names))
        print(path.rsplit("/", 1)[-1])
        for name in names:
            print(f"  {name:<20} " + " ".join(f"{x:.3f}" for x in shares[name]) + f"   mean {np.mean(shares[name]):.3f}")


if __name__ == "__main__":
    main()

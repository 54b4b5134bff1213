"""Variants of the `forecast` policy against it, on recorded traces: share of Belady's hits per budget.

    python benchmarks/policy_variants.py benchmarks/traces/*.npz

- `expected-next-use`: the victim is the cached expert whose next use is expected last, taking the layer
  cycle into account: with p its forecast probability of use at its layer's next call, d the calls until
  that call and L the layers, under a constant p the next use comes after d + L (1 - p) / p calls. (The
  earlier cycle weighting, p / d, lost on DeepSeek-V3; this one reduces to p alone for small p.)
- `per-layer-weights`: one weight vector of the online regression per layer instead of one shared.
- `nearest-context`: the step's token's kept routings weighed by how well each matched this step's
  routing at the layers that have run (weight exp(2 x the share of their experts it got right)), so that
  the token's past context most like this one counts most for the layers still to run.
- `optgen-labels`: the regression learns whether an optimal cache of this capacity would have kept the
  expert across the gap (OPTgen's occupancy test, as Hawkeye learns Belady's decisions), instead of
  whether the layer's next call used it; an expert's features wait 16 calls of its layer for the label.
- `one-routing`, `eight-routings`: the token tables keep 1 or 8 routings per token id instead of 3.
- `warm-start`: the regression starts at the weights it ends with after a first replay of the same trace
  (at the 10% budget) instead of at zero: what learning from scratch costs (an oracle, not a policy).

Each variant is a subclass of ForecastPolicy registered for the simulator's replay (exact runtime order).
"""

import argparse

import numpy as np

import moestream.tools.simulate as simulate
from moestream.core.policies import POLICIES, ForecastPolicy
from moestream.tools.simulate import parse_budgets, replay, shares_of_optimum, sweep
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


class NearestContext(ForecastPolicy):
    name = "nearest-context"
    SHARPNESS = 2.0

    def on_step(self, token_ids):
        super().on_step(token_ids)
        self._kept = self._token_routing.get(self._step_token) if self._step_token is not None else None
        self._agreement = None if self._kept is None else np.zeros(len(self._kept))

    def on_call(self, layer, experts):
        super().on_call(layer, experts)
        kept = self._kept
        if self._idle or kept is None or len(kept) < 2 or layer >= self.layers - 1:
            return
        ids = np.fromiter(experts, dtype=np.intp)
        self._agreement += [len(np.intersect1d(routing[layer], ids)) / kept.shape[2] for routing in kept]
        weight = np.exp(self.SHARPNESS * self._agreement)
        weight /= weight.sum()
        row = len(self.HALF_LIVES) + 1  # the token row
        for later in range(layer + 1, self.layers):
            share = np.zeros(self.experts, np.float32)
            for w, routing in zip(weight, kept):
                share[routing[later]] += w
            cols = np.nonzero(share)[0]
            new = np.log(share[cols] + self._offsets[row, 0])
            self._logit[later, cols] += self._weights[row] * (new - self._features[later, row, cols])
            self._features[later, row, cols] = new
            self._masked[later, cols] = self._logit[later, cols] + self._uncached[later, cols]
            self._update_min(later)


class OptGenLabels(ForecastPolicy):
    name = "optgen-labels"
    WAIT = 16  # calls of a layer that a snapshot of its features waits for its labels

    def __init__(self, layer_experts):
        super().__init__(layer_experts)
        self._now = 0  # calls so far, all layers
        self._occupancy = np.zeros(1 << 16, np.int32)  # per call: intervals an optimal cache keeps across it
        self._last_use = np.full((self.layers, self.experts), -1, np.int64)
        self._last_call = np.full(self.layers, -1, np.int64)
        self._waiting = [[] for _ in range(self.layers)]  # (call, features, labels; -1 while unknown)
        self._slots = 1 << 30

    def attach(self, capacity):
        super().attach(capacity)
        self._slots = capacity

    def on_call(self, layer, experts):
        if self._idle or not len(experts):
            return
        now, waiting = self._now, self._waiting[layer]
        if self._last_call[layer] >= 0:  # the features its experts were judged by until this call
            waiting.append((int(self._last_call[layer]), self._features[layer].copy(), np.full(self.experts, -1.0, np.float32)))
        for e in experts:
            start = self._last_use[layer, e]
            if start >= 0:
                kept = now == start or self._occupancy[start:now].max() < self._slots
                if kept:
                    self._occupancy[start:now] += 1
                for call, _, labels in waiting:
                    if start <= call < now and labels[e] < 0:
                        labels[e] = float(kept)
            self._last_use[layer, e] = now
        while len(waiting) > self.WAIT:  # learn from the oldest: a label still unknown means not kept
            _, features, labels = waiting.pop(0)
            p = 1.0 / (1.0 + np.exp(-(self._weights @ features)))
            grad = (features * (p - np.maximum(labels, 0.0))).sum(axis=1) / self.experts
            self._grad_sq += grad * grad
            self._weights -= self.LEARNING_RATE * grad / np.sqrt(self._grad_sq)
        self._last_call[layer] = now
        self._now += 1
        rate, self.LEARNING_RATE = self.LEARNING_RATE, 0.0  # the parent's features and logits, not its learning
        super().on_call(layer, experts)
        self.LEARNING_RATE = rate


class OneRouting(ForecastPolicy):
    name = "one-routing"
    TOKEN_VOTES = 1


class EightRoutings(ForecastPolicy):
    name = "eight-routings"
    TOKEN_VOTES = 8


class WarmStart(ForecastPolicy):
    name = "warm-start"
    start: tuple | None = None  # (weights, squared gradients), set per trace before the replay

    def __init__(self, layer_experts):
        super().__init__(layer_experts)
        self._weights[:], self._grad_sq[:] = WarmStart.start


def _make(name, layer_experts):
    cls = POLICIES[name]
    return cls(layer_experts) if issubclass(cls, ForecastPolicy) else cls()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--budgets", default="5%,10%,20%,30%")
    args = parser.parse_args()
    variants = (ExpectedNextUse, PerLayerWeights, NearestContext, OptGenLabels, OneRouting, EightRoutings, WarmStart)
    for cls in variants:
        POLICIES[cls.name] = cls
    simulate.make_policy = _make  # the simulator builds these subclasses with their layer sizes too
    names = ["lfu", "forecast", *(cls.name for cls in variants)]
    print(f"share of Belady's hits at {args.budgets}, then the mean")
    for path in args.traces:
        trace = Trace.load(path)
        first = ForecastPolicy(trace.layer_experts.tolist())
        replay(trace, parse_budgets("10%", trace)[0] // int(trace.record_bytes.max()), first)
        WarmStart.start = (first._weights.copy(), first._grad_sq.copy())
        shares = shares_of_optimum(sweep(trace, parse_budgets(args.budgets, trace), names))
        print(path.rsplit("/", 1)[-1])
        for name in names:
            print(f"  {name:<20} " + " ".join(f"{x:.3f}" for x in shares[name]) + f"   mean {np.mean(shares[name]):.3f}")


if __name__ == "__main__":
    main()

"""Eviction policies of the expert cache: which unpinned entry gives up its slot.

The cache (cache.py) owns slots and pins; a policy only orders keys. The runtime and the offline
simulator (simulate.py) drive the same ExpertCache with the same policy objects, so a policy's hit rate
in `moestream simulate` is the hit rate the runtime gets on the same routing.

A policy is a `Policy`: the base class lists the hooks the cache calls, each a no-op by default, so a
policy writes only those it uses. The policies users choose are the names of choices.POLICIES (the one
list the CLI, the simulator and `plan` read); `make_policy` builds one by name.

Keys are (layer, expert). Decode visits the layers cyclically, so plain recency (LRU) evicts exactly the
experts the next pass needs once the cache is smaller than one pass's working set; the frequency-aware
policies below keep the experts that are popular across passes.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import numpy as np

from ...choices import DEFAULT_POLICY, POLICIES
from ...errors import UsageError

Key = Hashable

__all__ = ["DEFAULT_POLICY", "POLICIES", "Policy", "make_policy", "policy_class"]


class Policy:
    """Orders the cache's keys for eviction. The cache calls, on the model thread:
        attach(capacity)            once, with the number of slots
        on_step(token_ids)          a forward pass begins, on these input token ids
        on_call(layer, experts)     an experts call of `layer` begins; `experts` are the distinct ids it needs
                                    (called before its lookups)
        on_hit(key)                 a lookup found key
        on_insert(key)              key got a slot (a miss being read)
        on_remove(key)              key left the cache (evicted, or its read failed)
        victim(evictable, incoming) the key to evict for `incoming`; only keys with evictable(key) True
                                    (unpinned) may be chosen; None when there is none
    Every hook but `victim` does nothing unless a policy needs it. A subclass names itself (`name`) and is
    found by it (`policy_class`)."""

    name = ""
    _by_name: dict[str, type[Policy]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        Policy._by_name[cls.name] = cls

    @classmethod
    def for_layers(cls, layer_experts: Sequence[int]) -> Policy:
        """A fresh policy for layers of `layer_experts` experts; those that forecast per layer need them."""
        return cls()

    def attach(self, capacity: int) -> None:
        pass

    def on_step(self, token_ids) -> None:
        pass

    def on_call(self, layer: int, experts) -> None:
        pass

    def on_hit(self, key: Key) -> None:
        pass

    def on_insert(self, key: Key) -> None:
        pass

    def on_remove(self, key: Key) -> None:
        pass

    def victim(self, evictable: Callable[[Key], bool], incoming: Key | None = None) -> Key | None:
        raise NotImplementedError


class LRUPolicy(Policy):
    """Evict the least recently used unpinned entry."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()

    def on_hit(self, key: Key) -> None:
        self._order.move_to_end(key)

    def on_insert(self, key: Key) -> None:
        self._order[key] = None

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[Key], bool], incoming: Key | None = None) -> Key | None:
        for key in self._order:
            if evictable(key):
                return key
        return None


class LFUPolicy(Policy):
    """Evict the unpinned entry with the lowest exponentially decayed use count.

    Counts are kept for every key ever seen, cached or not: the key space (layers x experts) is small and
    bounded, and an expert that was popular before its eviction should come back with its history. A newly
    read cold expert therefore has the lowest count and is the next victim, which keeps the hot set in place
    (it behaves like "admit only if hotter" without a bypass path).

    Decay: counts halve at the end of every epoch of `half_life` accesses (lookups), so popularity can
    drift. Stored as a time-independent priority log2(count in epoch e) + e, which orders keys exactly as
    their decayed counts do in any later epoch; so a heap never needs re-keying.

    Ties (equal counts) evict the most recently touched key. Decode visits the layers in a cycle; when the
    hot experts of all layers are equally hot and do not all fit, evicting the oldest of them is LRU's scan
    pathology (every lookup misses); evicting the newest keeps a stable subset cached, as Belady's MIN
    does. Why discrete epochs: a continuous decay makes every equally hot key's count depend on how long
    ago it was touched, which is that same recency order again (docs/DECISIONS.md, "LFU's decay in
    discrete epochs").
    """

    name = "lfu"

    def __init__(self, half_life: float | None = None, half_life_per_slot: float = 64.0) -> None:
        self.half_life = half_life
        self.half_life_per_slot = half_life_per_slot
        self._clock = 0
        self._priority: dict[Key, float] = {}  # every key seen
        self._cached: set[Key] = set()
        self._heap: list[tuple[float, int, Key]] = []  # (priority, -seq, key); stale rows are skipped
        self._seq = 0

    def attach(self, capacity: int) -> None:
        if self.half_life is None:
            # Scale memory with the cache: a cache of C slots turns over about every C misses; remembering
            # popularity over many turnovers is what separates the hot set from a passing burst.
            self.half_life = max(1.0, self.half_life_per_slot * capacity)

    def _touch(self, key: Key) -> None:
        if self.half_life is None:
            self.attach(1)
        self._clock += 1
        now = self._clock // self.half_life  # the epoch
        old = self._priority.get(key)
        count = 1.0 if old is None else 2.0 ** (old - now) + 1.0
        priority = math.log2(count) + now
        self._priority[key] = priority
        if key in self._cached:
            self._push(key, priority)

    def _push(self, key: Key, priority: float) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (priority, -self._seq, key))  # -seq: among equals the newest goes first
        if len(self._heap) > 4 * len(self._cached) + 64:  # mostly stale rows: rebuild from the live keys
            self._heap = [(self._priority[k], -i, k) for i, k in enumerate(self._cached, start=self._seq + 1)]
            self._seq += len(self._heap)
            heapq.heapify(self._heap)

    def on_hit(self, key: Key) -> None:
        self._touch(key)

    def on_insert(self, key: Key) -> None:
        self._cached.add(key)
        self._touch(key)

    def on_remove(self, key: Key) -> None:
        self._cached.discard(key)

    def victim(self, evictable: Callable[[Key], bool], incoming: Key | None = None) -> Key | None:
        skipped, chosen = [], None
        while self._heap:
            item = heapq.heappop(self._heap)
            priority, _, key = item
            if key not in self._cached or self._priority[key] != priority:
                continue  # stale: evicted, or touched since this row was pushed
            skipped.append(item)
            if evictable(key):
                chosen = key
                break
        for item in skipped:
            heapq.heappush(self._heap, item)  # the chosen key's row goes stale once on_remove runs
        return chosen


class ARCPolicy(Policy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), with pins.

    T1 holds keys seen once recently, T2 keys seen at least twice; the ghost lists B1 and B2 remember keys
    recently evicted from each. A miss that hits a ghost list moves the target size p of T1 toward the list
    that would have kept it: the policy learns, per workload, how much room recency and frequency get.
    Victims are the LRU end of T1 (when T1 is above its target) or of T2, skipping pinned keys (falling back
    to the other list when a whole list is pinned), which is the only change pins make to the algorithm.
    """

    name = "arc"

    def __init__(self) -> None:
        self.c = 1
        self.p = 0.0
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()
        self._adapted: Key | None = None  # the incoming key whose ghost hit already moved p

    def attach(self, capacity: int) -> None:
        self.c = max(1, capacity)

    def _adapt(self, key: Key) -> None:
        if key == self._adapted:
            return
        if key in self.b1:
            self.p = min(float(self.c), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
        self._adapted = key

    def on_hit(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)
        self.t2[key] = None

    def on_insert(self, key: Key) -> None:
        self._adapt(key)
        self._adapted = None
        if key in self.b1 or key in self.b2:
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[key] = None  # seen before: frequency side
        else:
            self.t1[key] = None
        # Directory bounds of ARC: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
        while len(self.t1) + len(self.b1) > self.c and self.b1:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.c and (self.b2 or self.b1):
            (self.b2 or self.b1).popitem(last=False)

    def on_remove(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
            self.b1[key] = None
        elif key in self.t2:
            del self.t2[key]
            self.b2[key] = None

    def victim(self, evictable: Callable[[Key], bool], incoming: Key | None = None) -> Key | None:
        if incoming is not None:
            self._adapt(incoming)
        from_t1 = bool(self.t1) and (len(self.t1) > self.p or (incoming in self.b2 and len(self.t1) == int(self.p)))
        for lst in (self.t1, self.t2) if from_t1 else (self.t2, self.t1):
            for key in lst:
                if evictable(key):
                    return key
        return None


class ForecastPolicy(Policy):
    """Evict the cached expert least likely to be needed at its layer's next call, as forecast online.

    Belady's MIN evicts the entry needed farthest in the future, which only a replay knows. This policy
    forecasts, for every (layer, expert), the probability that its layer's next call uses it, from what
    the engine has seen of the routing, and evicts the cached expert with the lowest, whatever its layer. After each call of a layer
    (one per token in decode), per expert of that layer:
        - its use counts decayed with half-lives of 1, 8 and 64 calls (the last use, a topic, popularity),
        - the layer's transitions: of the times the experts this call used were followed at their layer's
          next call, the share that went to this expert (an expert-to-expert count table per layer; the
          consecutive tokens of a text take related paths, which counts alone do not see),
        - once the next step's input token is known (`on_step`, before its first layer runs): the share of
          the last (up to TOKEN_VOTES) times that token id came in a one-token step in which its layer
          chose this expert (a table of the last TOKEN_TABLE_SIZE token ids' routings, TOKEN_VOTES x layers
          x top-k ids each),
        - once the layer has run in this step, so that its next call is the next step's, whose token is not
          known yet: the share of the last times this step's token came in which its layer chose this
          expert in the step that followed (a second table of as many token ids: what followed each),
    as logarithms, are the features of a logistic regression whose weights are learned online: a call
    labels the previous call's features of its layer with the experts it used, and an AdaGrad step
    follows (every LEARN_EVERY calls). Nothing is fitted to a model beforehand: the weights start at zero.

    Measured and left out (docs/DECISIONS.md, "The forecast policy's signals"): the router's full
    probabilities (their rank at the current token), the next layer's router applied to this layer's
    input (the prefetcher's guess), a reuse-distance feature and weighing the forecast by the calls until
    its layer runs again. None gained on average on the trained models here, and the last lost 0.05x of
    Belady's hits on one, so the policy needs only the expert ids of each call and the token ids of each
    step, which traces hold.

    Cost: about 20 small vector operations over one layer's experts per call and 10 over all layers per
    step, none through BLAS (numpy's BLAS threads would compete with torch's for the cores); an eviction
    compares one number per layer. The transition tables take layers x experts^2 float32 (15 MiB for
    DeepSeek-V3's 58 layers of 256 experts, 3 MiB for Qwen3-30B-A3B's 48 of 128), the two token tables up
    to TOKEN_TABLE_SIZE x TOKEN_VOTES x layers x top-k int16 each (21.8 MiB each for DeepSeek-V3)."""

    name = "forecast"
    HALF_LIVES = (1.0, 8.0, 64.0)  # in calls of the layer; (2, 8, 32, 128) and (2, 16, 128) gave the same hits
    LEARN_EVERY = 4  # calls per learning step: 1, 2, 4 and 8 give the same hits within 0.002x of Belady's
    LEARNING_RATE = 0.2  # AdaGrad's step; hit rates vary by under 0.5% between 0.05 and 1 on the fixture
    TOKEN_TABLE_SIZE = 8192  # token ids whose last routings are kept (the least recently seen leave first)
    TOKEN_VOTES = 3  # routings kept per token id: 1 -> 3 gains 0.003-0.007x of Belady's hits, 8 no more
    TOKEN_STEP_LIMIT = 16  # longer steps (prompts) are not looked up: they use most experts anyway

    @classmethod
    def for_layers(cls, layer_experts: Sequence[int]) -> Policy:
        return cls(layer_experts)

    def __init__(self, layer_experts: Sequence[int]):
        if not len(layer_experts):
            raise UsageError("the forecast policy needs the number of experts of each layer")
        self.layers, self.experts = len(layer_experts), int(max(layer_experts))
        layers, experts, n = self.layers, self.experts, len(self.HALF_LIVES)
        f32 = np.float32
        self._decay = np.array([0.5 ** (1.0 / h) for h in self.HALF_LIVES], f32)[:, None]
        self._follow = np.full((layers, experts * experts), 0.01, f32)  # [l, s*E + e]: e followed s
        self._used = np.zeros((layers, experts), f32)  # 1 where the layer's last call used the expert
        # Each layer at its last call, [quantity, expert]: the decayed counts, the transition share, a row
        # of zeros for the token (not known until the next step starts; `on_step` then writes the token's
        # features itself) and the successor row; the features are their logs (after these offsets, which
        # keep a zero finite) and a constant 1, the bias.
        self._raw = np.zeros((layers, n + 3, experts), f32)
        self._offsets = np.array([1e-3] * n + [1e-4, 0.1, 0.1], f32)[:, None]
        self._features = np.ones((layers, n + 4, experts), f32)
        self._features[:, : n + 3] = np.log(self._offsets)  # nothing seen yet
        self._scratch = np.empty((n + 4, experts), f32)
        self._weights = np.zeros(n + 4, f32)
        self._grad_sq = np.full(n + 4, 1e-3, f32)
        self._calls = 0
        # The token table: token id -> [votes, layers, top-k] expert ids it took in its last one-token steps,
        # the latest first; the successor table: token id -> the experts of the one-token steps that followed.
        self._token_routing: OrderedDict[int, np.ndarray] = OrderedDict()
        self._successor_routing: OrderedDict[int, np.ndarray] = OrderedDict()
        self._step_token: int | None = None  # the current step's token, if it is a one-token step
        self._previous_token: int | None = None  # the token of the one-token step before it
        self._step_successor: np.ndarray | None = None  # what followed the current token the last times
        self._step_calls = 0  # calls since the step began (its routing is whole once every layer ran)
        self._last_ids: list[np.ndarray | None] = [None] * layers  # the experts of each layer's last call
        self._layer_offsets = (np.arange(layers) * experts)[:, None]  # [layer, 0] -> its first flat index
        # Per layer: the logit of every expert's use at the layer's next call, the same for cached experts
        # only (+inf for the rest), and each layer's lowest: the probability is monotone in the logit, so an
        # eviction compares one number per layer.
        self._logit = np.zeros((layers, experts), f32)
        self._masked = np.full((layers, experts), np.inf, f32)
        self._uncached = np.full((layers, experts), np.inf, f32)  # 0 for cached experts: masked = logit + this
        self._layer_min = np.full(layers, np.inf, f32)
        self._layer_argmin = np.zeros(layers, dtype=np.intp)
        self._idle = False

    def attach(self, capacity: int) -> None:
        # A cache that holds every expert never evicts: forecasting would only cost time (about 2 ms per
        # token at 48 layers of 128 experts, on the model thread).
        self._idle = capacity >= self.layers * self.experts

    def on_step(self, token_ids) -> None:
        if self._idle:
            return
        finished = None
        if self._step_token is not None and self._step_calls == self.layers:  # remember the finished token
            ids = self._last_ids
            if len({len(i) for i in ids}) == 1:
                finished = self._step_token
                routing = np.stack(ids).astype(np.int16)
                self._remember(self._token_routing, finished, routing)
                if self._previous_token is not None:
                    self._remember(self._successor_routing, self._previous_token, routing)
        tokens = list(token_ids) if len(token_ids) <= self.TOKEN_STEP_LIMIT else []
        self._previous_token = finished
        self._step_token = int(tokens[0]) if len(tokens) == 1 else None
        self._step_successor = self._successor_routing.get(self._step_token)
        self._step_calls = 0
        known = [self._token_routing[t] for t in tokens if t in self._token_routing]
        if not known:
            return  # every layer's token row already says "unknown" (reset at each call)
        n = len(self.HALF_LIVES)
        # Per token, the share of its routings kept that chose each (layer, expert); summed over the tokens.
        flat = np.concatenate([(r + self._layer_offsets).ravel() for r in known])
        votes = np.concatenate([np.full(r.size, 1.0 / len(r)) for r in known])
        choices = np.bincount(flat, votes, minlength=self.layers * self.experts).reshape(self.layers, self.experts)
        rows, cols = np.nonzero(choices)
        # Only the named experts' features change (their token row was log(offset) since their layer's last
        # call), and so their logits, by the token row's weight times the change.
        new = np.log(choices[rows, cols] + self._offsets[n + 1, 0])
        self._logit[rows, cols] += self._weights[n + 1] * (new - self._features[rows, n + 1, cols])
        self._features[rows, n + 1, cols] = new
        self._masked[rows, cols] = self._logit[rows, cols] + self._uncached[rows, cols]
        self._layer_argmin[:] = self._masked.argmin(axis=1)
        self._layer_min[:] = self._masked[np.arange(self.layers), self._layer_argmin]

    def _remember(self, table: OrderedDict, token: int, routing: np.ndarray) -> None:
        kept = table.get(token)
        table[token] = routing[None] if kept is None else np.concatenate([routing[None], kept[: self.TOKEN_VOTES - 1]])
        table.move_to_end(token)
        if len(table) > self.TOKEN_TABLE_SIZE:
            table.popitem(last=False)

    def on_call(self, layer: int, experts) -> None:
        if self._idle:
            return
        ids = np.fromiter(experts, dtype=np.intp)
        if not len(ids):  # a call whose experts another tier served (device_tier.py): nothing to learn here
            return
        previous, self._last_ids[layer] = self._last_ids[layer], ids
        self._step_calls += 1
        features, raw, logit, used = self._features[layer], self._raw[layer], self._logit[layer], self._used[layer]
        used[:] = 0.0
        used[ids] = 1.0
        if previous is not None:
            if self._calls % self.LEARN_EVERY == 0:  # learn: the last call's forecast against this call's use
                grad = (features * (1.0 / (1.0 + np.exp(-logit)) - used)).sum(axis=1) / self.experts
                self._grad_sq += grad * grad
                self._weights -= self.LEARNING_RATE * grad / np.sqrt(self._grad_sq)
            self._calls += 1
            self._follow[layer][(previous[:, None] * self.experts + ids).ravel()] += 1.0
        n = len(self.HALF_LIVES)
        counts = raw[:n]
        counts *= self._decay
        counts += used
        follows = self._follow[layer].reshape(self.experts, self.experts)[ids].sum(axis=0, out=raw[n])
        follows /= follows.sum()
        # This layer's next call comes in the next step: the experts it took in the steps that followed this
        # step's token the last times that token came (raw[n + 1], the token row, waits for that step's token)
        successor = raw[n + 2]
        if self._step_successor is None:
            successor[:] = 0.0
        else:
            votes = self._step_successor[:, layer]
            successor[:] = np.bincount(votes.ravel(), minlength=self.experts) / len(votes)
        logs = features[: n + 3]  # the row after them is constant (the bias, last)
        np.add(raw, self._offsets, out=logs)
        np.log(logs, out=logs)
        np.multiply(features, self._weights[:, None], out=self._scratch)
        self._scratch.sum(axis=0, out=logit)
        np.add(logit, self._uncached[layer], out=self._masked[layer])
        self._update_min(layer)

    def _update_min(self, layer: int) -> None:
        e = int(self._masked[layer].argmin())
        self._layer_argmin[layer] = e
        self._layer_min[layer] = self._masked[layer, e]

    def on_insert(self, key: Key) -> None:
        layer, e = key
        self._uncached[key] = 0.0
        value = self._masked[key] = self._logit[key]
        if value < self._layer_min[layer]:
            self._layer_min[layer], self._layer_argmin[layer] = value, e

    def on_remove(self, key: Key) -> None:
        layer, e = key
        self._uncached[key] = np.inf
        self._masked[key] = np.inf
        if self._layer_argmin[layer] == e:
            self._update_min(layer)

    def _victim_layer(self) -> int:
        """The layer whose least likely cached expert goes first: the least likely of all."""
        return int(self._layer_min.argmin())

    def victim(self, evictable: Callable[[Key], bool], incoming: Key | None = None) -> Key | None:
        skipped, chosen = [], None
        while True:
            layer = self._victim_layer()
            if self._layer_min[layer] == np.inf:
                break
            key = (layer, int(self._layer_argmin[layer]))
            if evictable(key):
                chosen = key
                break
            skipped.append((key, self._masked[key]))  # pinned or still being read: look further
            self._masked[key] = np.inf
            self._update_min(layer)
        for key, value in skipped:
            self._masked[key] = value
            self._update_min(key[0])
        return chosen


def policy_class(name: str) -> type[Policy]:
    """The class of the policy users call `name` (one of choices.POLICIES)."""
    if name not in POLICIES:
        raise UsageError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICIES)}")
    return Policy._by_name[name]


def make_policy(name: str, layer_experts: Sequence[int]) -> Policy:
    """A fresh policy object by name, for layers of `layer_experts` experts (the cache attaches it to its
    capacity)."""
    return policy_class(name).for_layers(layer_experts)

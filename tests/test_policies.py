"""Eviction policies on their own: what each may evict, and what the forecast policy learns."""

from pathlib import Path

import numpy as np
import pytest

from moestream.core.supply.policies import DEFAULT_POLICY, POLICIES, ForecastPolicy, Policy, make_policy
from moestream.errors import UsageError
from moestream.tools.simulate import BELADY, parse_budgets, replay, shares_of_optimum, sweep
from moestream.tools.trace import Trace

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"


def _decode_trace(experts: np.ndarray, layer_experts: int) -> Trace:
    """experts [tokens, layers, k] -> a trace of one decode call per token and layer."""
    return Trace.of_decode(experts.astype(np.int32), layer_experts)


def _drifting_routing(seed: int, layers=4, experts=32, k=2, tokens=600, stay=0.5) -> np.ndarray:
    """Each layer's k choices walk on a ring of its experts (in a random order): from token to token each
    stays with probability `stay`, else moves to a neighbour. Over the run every expert is about equally
    popular, so long-run counts say little; what the last tokens used says a lot."""
    rng = np.random.default_rng(seed)
    out = np.zeros((tokens, layers, k), np.int64)
    for layer in range(layers):
        order, position = rng.permutation(experts), rng.choice(experts, k, replace=False)
        for t in range(tokens):
            nxt = []
            for p in position:
                c = (p + (0 if rng.random() < stay else rng.choice([-1, 1]))) % experts
                while c in nxt:
                    c = (c + 1) % experts
                nxt.append(c)
            position = np.array(nxt)
            out[t, layer] = order[position]
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("slots", [12, 24])
def test_forecast_learns_recency_where_counts_mislead(seed, slots):
    """LFU, tuned for stable popularity, holds on to experts the walk has left; the forecast learns from
    the routing that recent use predicts the next (as LRU assumes), does as well as LRU and gets most of
    MIN's hits."""
    trace = _decode_trace(_drifting_routing(seed), 32)  # 128 experts; a token needs 8
    best = replay(trace, slots, BELADY).hits
    hits = {p: replay(trace, slots, p).hits for p in ("lru", "lfu", "forecast")}
    assert hits["forecast"] > 2 * hits["lfu"], hits
    assert hits["forecast"] >= 0.98 * hits["lru"], hits
    assert hits["forecast"] > 0.75 * best, (hits, best)


def test_forecast_learns_popularity_too():
    """Zipf-popular experts drawn independently per token (no transitions to learn): within 5% of LFU,
    which suits independent draws best (it is what the forecast has to learn from 800 tokens)."""
    rng = np.random.default_rng(5)
    layers, experts, k = 4, 32, 2
    ranks = np.arange(1, experts + 1.0) ** -1.2
    p = ranks / ranks.sum()
    routing = np.array([[rng.choice(experts, k, replace=False, p=p) for _ in range(layers)] for _ in range(800)])
    trace = _decode_trace(routing, experts)
    for slots in (12, 24, 40):
        assert replay(trace, slots, "forecast").hits >= 0.95 * replay(trace, slots, "lfu").hits, slots


def _policy(name: str, layers=2, experts=8):
    policy = make_policy(name, [experts] * layers)
    policy.attach(4)
    return policy


@pytest.mark.parametrize("name", list(POLICIES))
def test_victim_is_never_a_pinned_key_and_none_when_all_are(name):
    policy = _policy(name)
    cached = [(0, 1), (0, 5), (1, 2), (1, 7)]
    policy.on_call(0, [1, 5])
    for key in cached:
        policy.on_insert(key)
    policy.on_hit((0, 1))
    pinned = {(0, 1), (1, 2)}
    for _ in range(3):
        victim = policy.victim(lambda key: key not in pinned)
        assert victim in set(cached) - pinned
    assert policy.victim(lambda key: False) is None
    policy.on_remove((0, 5))
    policy.on_remove((1, 7))
    assert policy.victim(lambda key: key not in pinned) is None  # the rest are pinned


def test_forecast_never_evicts_a_removed_key():
    policy = _policy("forecast")
    for key in [(0, 0), (0, 1), (1, 0)]:
        policy.on_insert(key)
    policy.on_remove((0, 1))
    seen = set()
    for _ in range(2):
        victim = policy.victim(lambda key: key not in seen)
        assert victim in {(0, 0), (1, 0)}
        seen.add(victim)


def test_forecast_does_no_work_when_the_cache_holds_every_expert():
    """Nothing is ever evicted then; the forecast would only cost the model thread time."""
    trace = _decode_trace(_drifting_routing(0, tokens=50), 32)
    assert replay(trace, 128, "forecast").hits == replay(trace, 128, "lfu").hits  # compulsory misses only
    full, partial = _policy("forecast", 4, 32), _policy("forecast", 4, 32)
    full.attach(128)
    partial.attach(127)
    for layer, experts in trace.call_experts:
        full.on_call(layer, experts)
        partial.on_call(layer, experts)
    assert not full._weights.any() and partial._weights.any()


def test_forecast_needs_the_layer_table():
    with pytest.raises(Exception, match="experts of each layer"):
        ForecastPolicy([])


def _shipped_traces() -> list[Path]:
    return sorted(TRACES.glob("*.npz"))


def test_the_repository_carries_trained_traces():
    names = {p.stem for p in _shipped_traces()}
    assert len(names) >= 3, names


@pytest.mark.parametrize("path", _shipped_traces(), ids=lambda p: p.stem)
def test_default_policy_is_never_below_lfu_on_trained_routing(path):
    """Routing of trained models decoding held-out text (benchmarks/traces, made by
    benchmarks/policy_validation.py): the default is at or above LFU at every budget."""
    trace = Trace.load(path)
    budgets = parse_budgets("5%,10%,20%,30%", trace)
    rows = sweep(trace, budgets, sorted({DEFAULT_POLICY, "lfu"}))
    shares = shares_of_optimum(rows)
    for default, lfu in zip(shares[DEFAULT_POLICY], shares["lfu"]):
        assert default >= lfu, (path.stem, shares)


def test_forecast_uses_what_a_token_id_routed_to_before():
    """Each of 10 token ids (Zipf-distributed, in random order) always takes the same experts, as the early
    layers of trained MoEs nearly do. Told each step's token id (`on_step`; a trace records them), the
    forecast protects the experts the rest of the token will need; without the ids it cannot."""
    rng = np.random.default_rng(3)
    layers, experts, k, vocab = 4, 32, 2, 10
    routes = np.array([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(vocab)])
    p = 1.0 / np.arange(1, vocab + 1)
    tokens = rng.choice(vocab, size=600, p=p / p.sum())
    with_ids = Trace.of_decode(routes[tokens].astype(np.int32), experts, token_ids=tokens)
    without = Trace.of_decode(routes[tokens].astype(np.int32), experts)
    assert with_ids.step_starts[4] == [int(tokens[1])] and not without.step_starts
    for slots in (12, 24):
        told, blind = replay(with_ids, slots, "forecast").hits, replay(without, slots, "forecast").hits
        assert told > 1.03 * blind, (slots, told, blind)
        assert replay(with_ids, slots, "lfu").hits == replay(without, slots, "lfu").hits  # lfu ignores ids


class _NoSuccessor(ForecastPolicy):
    """The forecast without its successor feature: the table of what followed each token stays empty."""

    def _remember(self, table, token, routing):
        if table is not self._successor_routing:
            super()._remember(table, token, routing)


def test_forecast_uses_what_followed_a_token_the_last_time():
    """Tokens come in a fixed order around a cycle of 12 (each followed by the next, as words of a phrase
    that recurs), each always taking the same experts; the cycle is broken at random points by one of 20
    other tokens. Once a layer has run in a step, its next call is the next step's, whose token is not
    known yet, but what followed this step's token the last time says which experts it will take."""
    rng = np.random.default_rng(5)
    layers, experts, k, vocab = 4, 32, 2, 32
    routes = np.array([[rng.choice(experts, k, replace=False) for _ in range(layers)] for _ in range(vocab)])
    tokens, t = [], 0
    for _ in range(800):
        if rng.random() < 0.2:
            tokens.append(int(rng.integers(12, vocab)))  # a break in the cycle
        else:
            tokens.append(t)
            t = (t + 1) % 12
    tokens = np.array(tokens)
    trace = Trace.of_decode(routes[tokens].astype(np.int32), experts, token_ids=tokens)
    layer_experts = trace.layer_experts.tolist()
    for slots in (12, 24):
        told = replay(trace, slots, ForecastPolicy(layer_experts)).hits
        blind = replay(trace, slots, _NoSuccessor(layer_experts)).hits
        assert told > 1.03 * blind, (slots, told, blind)


def test_every_offered_policy_is_built_by_its_name_and_an_unknown_name_says_what_to_choose():
    for name in POLICIES:
        policy = make_policy(name, [8, 8])
        assert isinstance(policy, Policy) and policy.name == name
    with pytest.raises(UsageError, match="choose one of lru, lfu, arc, forecast"):
        make_policy("belady", [8, 8])  # the simulator's oracle is a Policy too, but no user's choice


def test_a_policy_that_writes_only_its_victim_runs_on_the_base_class_hooks():
    """The base class's hooks are no-ops: a policy that evicts the highest expert id of the lowest layer, and
    writes nothing else, replays a random trace to the hit count that rule gives when computed by hand."""
    rng = np.random.default_rng(7)
    experts = rng.integers(0, 16, size=(300, 2, 1))
    trace = _decode_trace(experts, 16)

    class HighestId(Policy):
        name = "highest-id (test)"

        def victim(self, evictable, incoming=None):
            keys = [key for key in self.cached if evictable(key)]
            return min(keys, key=lambda k: (k[0], -k[1])) if keys else None

        def __init__(self):
            self.cached = set()

        def on_insert(self, key):
            self.cached.add(key)

        def on_remove(self, key):
            self.cached.discard(key)

    slots = 6
    cached, hits = set(), 0
    for t in range(experts.shape[0]):
        for layer in range(2):
            key = (layer, int(experts[t, layer, 0]))
            if key in cached:
                hits += 1
                continue
            if len(cached) == slots:
                cached.remove(min(cached, key=lambda k: (k[0], -k[1])))
            cached.add(key)
    assert replay(trace, slots, HighestId()).hits == hits

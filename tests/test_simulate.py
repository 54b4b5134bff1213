"""The offline simulator against the runtime (exact hit counts), and Belady's MIN as the optimum."""

from functools import lru_cache

import numpy as np
import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.conversion.store import Store
from moestream.core.supply.policies import DEFAULT_POLICY, POLICIES
from moestream.errors import UsageError
from moestream.tools.simulate import BELADY, replay, shares_of_optimum, sweep
from moestream.tools.trace import Trace, recording, store_identity


def _load(store, budget, policy="lru"):
    """Demand reads only: speculative prefetch reads experts that the trace does not name, from predictions
    it does not hold, so the simulator's exactness is stated with prefetch off (the default, said here)."""
    return moestream.load(store, budget, policy=policy, prefetch="off")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("simulate")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=11)
    return moestream.convert(ckpt, root / "store", experts_dtype="fp32", progress=False)


def _run(store, slots: int, policy: str):
    """A prefill of 12 tokens and 16 sampled decode steps, recorded; returns (runtime stats, trace)."""
    slot = Store(store).manifest.max_record_stride
    model, _ = _load(store, slots * slot, policy)
    prompt = torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(slots))
    torch.manual_seed(slots)
    with torch.no_grad(), recording(model) as recorder:
        model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=True, top_k=0, top_p=1.0)
    return moestream.stats(model), recorder.trace()


# 2 and 3 slots: the prefill needs more distinct experts per layer than the cache holds (it runs in waves);
# 6: a layer's working set fits but not both layers'; 16: everything fits.
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("slots", [2, 3, 6, 16])
def test_simulator_hits_equal_runtime_hits(store, policy, slots):
    stats, trace = _run(store, slots, policy)
    assert stats["cache_slots"] == slots and stats["cache_policy"] == policy
    result = replay(trace, slots, policy)
    assert (result.hits, result.misses) == (stats["hits"], stats["misses"])
    assert result.bytes_read == stats["bytes_read"]
    assert trace.tokens == 12 + 15  # generate runs the last sampled token through no layer
    assert trace.meta["store_id"] == store_identity(Store(store).manifest)
    assert replay(trace, slots, BELADY).hits >= result.hits


def _synthetic_trace(seed: int, skew: float, layers=3, experts=16, top_k=2, tokens=60, prefill=8) -> Trace:
    """Prefill of `prefill` tokens then single-token decode calls, cycling over the layers; expert
    popularity Zipf(skew) per layer (0: uniform), each layer with its own ranking."""
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, experts + 1, dtype=np.float64)
    weights = ranks**-skew / (ranks**-skew).sum()
    order = [rng.permutation(experts) for _ in range(layers)]
    rows, call_layer, call_rows = [], [], []
    steps = [prefill] + [1] * (tokens - prefill)
    for t in steps:
        for layer in range(layers):
            for _ in range(t):
                rows.append(order[layer][rng.choice(experts, size=top_k, replace=False, p=weights)])
            call_layer.append(layer)
            call_rows.append(t)
    ids = np.array(rows, dtype=np.int32)
    return Trace(
        experts=ids,
        weights=np.full(ids.shape, 1.0 / top_k, np.float32),
        call_layer=np.array(call_layer, np.int32),
        call_rows=np.array(call_rows, np.int32),
        record_bytes=np.full(layers, 4096, np.int64),
        layer_experts=np.full(layers, experts, np.int32),
        meta={"model_type": "synthetic"},
    )


@pytest.mark.parametrize("skew", [0.0, 1.2])
def test_belady_is_at_least_every_online_policy(skew):
    for seed in range(6):
        trace = _synthetic_trace(seed, skew)
        for slots in (2, 3, 5, 8, 12, 20, 32, 48):
            best = replay(trace, slots, BELADY).hits
            for policy in POLICIES:
                assert replay(trace, slots, policy).hits <= best, (seed, slots, policy)


def _exhaustive_optimum(trace: Trace, slots: int) -> int:
    """The most hits any eviction choice can get under the runtime's rules (no waves: every call fits)."""
    calls = trace.call_experts

    @lru_cache(maxsize=None)
    def best(c: int, cached: frozenset) -> int:
        if c == len(calls):
            return 0
        layer, experts = calls[c]
        need = {(layer, e) for e in experts}
        hits = len(need & cached)
        missing = need - cached
        evictable = sorted(cached - need)
        drop = max(0, len(cached) + len(missing) - slots)
        # Any `drop` unpinned entries may go; the order of evictions inside a call does not matter.
        options = [frozenset(evictable[i] for i in choice) for choice in _combinations(len(evictable), drop)]
        return hits + max(best(c + 1, (cached - out) | missing) for out in options)

    return best(0, frozenset())


def _combinations(n: int, r: int):
    from itertools import combinations

    return combinations(range(n), r)


@pytest.mark.parametrize("seed", range(4))
def test_belady_equals_the_exhaustive_optimum(seed):
    trace = _synthetic_trace(seed, skew=0.8, layers=2, experts=5, top_k=2, tokens=14, prefill=1)
    for slots in (2, 3, 4, 6):
        assert replay(trace, slots, BELADY).hits == _exhaustive_optimum(trace, slots), slots


def test_trace_file_round_trip_and_damage(tmp_path):
    trace = _synthetic_trace(0, 1.0)
    path = trace.save(tmp_path / "t.npz")
    again = Trace.load(path)
    assert np.array_equal(again.experts, trace.experts) and again.call_experts == trace.call_experts
    assert again.tokens == 60 and again.meta["model_type"] == "synthetic"
    damaged = _synthetic_trace(0, 1.0)
    damaged.experts[5, 0] = 99  # beyond the layer's 16 experts
    damaged.save(tmp_path / "bad.npz")
    with pytest.raises(UsageError, match="inconsistent"):
        Trace.load(tmp_path / "bad.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(UsageError, match="not a moestream trace"):
        Trace.load(tmp_path / "junk.npz")


def test_trace_steps_round_trip_and_version_1_still_loads(tmp_path):
    """Version 2 records each step's token ids; a version 1 file (no steps) still loads and replays, and a
    step table that does not add up is refused."""
    import json

    routing = np.random.default_rng(1).integers(0, 16, size=(30, 3, 2))
    routing[:, :, 1] = (routing[:, :, 0] + 1) % 16  # two distinct experts per call
    trace = Trace.of_decode(routing.astype(np.int32), 16, token_ids=np.arange(30) % 7)
    again = Trace.load(trace.save(tmp_path / "v2.npz"))
    assert again.meta["format_version"] == 2 and again.step_starts == trace.step_starts
    assert replay(again, 6, "forecast").hits == replay(trace, 6, "forecast").hits
    # Version 1, as earlier releases wrote it: the same arrays without the steps.
    with np.load(tmp_path / "v2.npz") as z:
        arrays = {n: z[n] for n in z.files if n not in ("step_tokens", "step_rows", "call_step")}
    meta = json.loads(str(arrays.pop("meta")))
    np.savez(tmp_path / "v1.npz", **arrays, meta=np.array(json.dumps(dict(meta, format_version=1))))
    old = Trace.load(tmp_path / "v1.npz")
    assert old.step_tokens is None and old.step_starts == {} and replay(old, 6, "lfu").hits == replay(trace, 6, "lfu").hits
    np.savez(tmp_path / "v9.npz", **arrays, meta=np.array(json.dumps(dict(meta, format_version=9))))
    with pytest.raises(UsageError, match="version 9"):
        Trace.load(tmp_path / "v9.npz")
    trace.step_rows[0] = 5  # more token ids than the trace holds
    trace.save(tmp_path / "bad.npz")
    with pytest.raises(UsageError, match="inconsistent"):
        Trace.load(tmp_path / "bad.npz")


def test_sweep_refuses_budgets_below_one_tokens_experts():
    trace = _synthetic_trace(0, 1.0)
    with pytest.raises(UsageError, match="minimum is 8192 bytes"):
        sweep(trace, [4096], ["lru"])
    rows = sweep(trace, [8192, 40960], ["lru", "lfu"])
    assert [[r.policy for r in row] for row in rows] == [["lru", "lfu", BELADY]] * 2


def test_a_call_whose_hits_fill_the_cache_still_gets_slots_for_its_misses(tmp_path):
    """Every slot held by this call's hits: once those are computed their slots take the misses."""
    from tiny import TINY

    from moestream.conversion.synthetic import make_model, save_checkpoint

    config = dict(TINY["qwen3_moe"], num_hidden_layers=1)
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=5, **config), tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    model, _ = _load(store, 2 * Store(store).manifest.max_record_stride)  # 2 slots = top_k
    with torch.no_grad(), recording(model) as recorder:
        model(torch.tensor([[5]]))  # caches the two experts of token 5 at position 0
        model(torch.tensor([[5, 9, 17, 33, 60, 101]]))  # the same two again, and others
    first, second = recorder.trace().call_experts
    assert set(first[1]) < set(second[1])  # the second call hits both cached experts and misses more
    stats = moestream.stats(model)
    assert stats["hits"] == 2 and stats["misses"] == 2 + len(second[1]) - 2


def test_cli_trace_simulate_and_generate_trace_out(store, tmp_path, capsys):
    import json

    from moestream.cli import main

    text = tmp_path / "text.txt"
    text.write_text("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n")
    out = tmp_path / "t.npz"
    assert main(["trace", str(store), "--text", str(text), "--max-tokens", "20", "--prefill", "5", "-o", str(out)]) == 0
    trace = Trace.load(out)
    assert trace.tokens == 20 and trace.calls == 2 * 16  # one prefill call and 15 decode calls per layer
    assert list(trace.call_rows[:2]) == [5, 5] and set(trace.call_rows[2:]) == {1}
    capsys.readouterr()
    assert main(["simulate", str(out), "--memory", "64KiB,50%", "--policy", f"lru,arc,{DEFAULT_POLICY}"]) == 0
    printed = capsys.readouterr().out
    assert "belady" in printed and "closest to the optimum" in printed
    # Each policy's mean share of Belady's hits, the default marked; the rows' shares are those of the table.
    rows = sweep(
        trace, [64 * 1024, round(0.5 * int(trace.layer_experts.sum())) * trace.slot_bytes], ["lru", "arc", DEFAULT_POLICY]
    )
    shares = shares_of_optimum(rows)
    summary = printed.split("share of Belady's hits, on average over these budgets:")[1].splitlines()
    for name, values in shares.items():
        line = next(line for line in summary if line.split() and line.split()[0] == name)
        assert f"{sum(values) / len(values):.2f}x" in line and f"lowest {min(values):.2f}x" in line
        assert ("(the default)" in line) == (name == DEFAULT_POLICY)
    assert main(["simulate", str(out), "--memory", "1KiB"]) == 2  # below one token's experts
    assert "minimum is" in capsys.readouterr().err

    # generate records its own routing: every token of the prompt and of the decode, in its calls.
    slot = Store(store).manifest.max_record_stride
    run = [
        "generate",
        str(store),
        "--memory",
        str(5 * slot),
        "--policy",
        "lfu",
        "--prompt",
        "def f(x):",
        "--max-new-tokens",
        "10",
    ]
    assert main(run + ["--greedy", "--json", "--trace-out", str(tmp_path / "g.npz")]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert result["stats"]["cache_policy"] == "lfu"
    trace = Trace.load(tmp_path / "g.npz")
    assert trace.tokens == result["prompt_tokens"] + len(result["token_ids"]) - 1
    assert trace.calls == 2 * len(result["token_ids"]) and trace.meta["prompt"] == "def f(x):"
    assert main(["simulate", str(tmp_path / "g.npz"), "--memory", str(5 * slot), "--policy", "lfu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["results"][0][0]["slots"] == 5 and report["default_policy"] == DEFAULT_POLICY
    assert report["mean_share_of_optimum"]["lfu"] == pytest.approx(
        report["results"][0][0]["hits"] / report["results"][0][1]["hits"]
    )


def test_reuse_distances_and_popularity_match_their_definitions():
    from moestream.tools.trace import popularity, reuse_distances

    trace = _synthetic_trace(3, 1.0, tokens=30)
    keys = [(layer, e) for layer, experts in trace.call_experts for e in experts]
    expected = []
    for t, key in enumerate(keys):
        previous = [p for p in range(t) if keys[p] == key]
        expected.append(len(set(keys[previous[-1] + 1 : t])) if previous else -1)
    assert reuse_distances(trace).tolist() == expected
    counts = popularity(trace)
    assert counts.sum() == trace.experts.size and counts.shape == (3, 16)
    assert counts[trace.call_layer[0], trace.experts[0, 0]] >= 1


def test_simulate_plot_writes_three_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from moestream.cli import main

    path = _synthetic_trace(1, 1.2).save(tmp_path / "t.npz")
    assert main(["simulate", str(path), "--memory", "20%,40%", "--plot", str(tmp_path / "plots")]) == 0
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["expert_popularity.png", "hit_rate_vs_budget.png", "reuse_distance.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_decode_figures_leave_the_prompt_out(store, tmp_path):
    trace = _synthetic_trace(4, 1.0)  # an 8-token prompt call per layer, then decode calls
    r = replay(trace, 6, "lru")
    decode_calls = [experts for (layer, experts), rows in zip(trace.call_experts, trace.call_rows) if rows == 1]
    assert r.decode_hits + r.decode_misses == sum(len(e) for e in decode_calls)
    assert r.decode_tokens == 60 - 8 and r.decode_bytes_read < r.bytes_read
    # bench records the routing of the run it measures.
    from moestream.tools.bench import bench

    slot = Store(store).manifest.max_record_stride
    report = bench(store, 4 * slot, prompt_tokens=6, new_tokens=5, trace_out=str(tmp_path / "b.npz"), policy="lfu")
    recorded = Trace.load(tmp_path / "b.npz")
    assert recorded.tokens == 6 + 4 and recorded.meta["prompt_tokens"] == 6
    assert report.moestream.hit_rate == pytest.approx(replay(recorded, 4, "lfu").decode_hit_rate)


def test_lfu_keeps_a_stable_subset_when_equally_hot_experts_do_not_fit():
    """Every token uses the same 2 experts in each of 8 layers (16 hot keys) and the cache holds 10: LRU
    evicts each just before its next use (0 hits); LFU evicts the newest of equals and keeps most of 10."""
    layers, tokens = 8, 50
    experts = np.tile(np.array([[3, 7]], np.int32), (layers * tokens, 1))
    trace = Trace(
        experts=experts,
        weights=np.full(experts.shape, 0.5, np.float32),
        call_layer=np.tile(np.arange(layers, dtype=np.int32), tokens),
        call_rows=np.ones(layers * tokens, np.int32),
        record_bytes=np.full(layers, 4096, np.int64),
        layer_experts=np.full(layers, 16, np.int32),
        meta={},
    )
    assert replay(trace, 10, "lru").hits == 0
    best = replay(trace, 10, BELADY).hits
    assert replay(trace, 10, "lfu").hits > 0.6 * best

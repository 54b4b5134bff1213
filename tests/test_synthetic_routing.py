"""calibrated_router: synthetic routing between the uniform and the fully biased extremes, each parameter
doing what its name says, all measured on the experts a tiny random model actually chooses over real text."""

from __future__ import annotations

import inspect
import textwrap

import numpy as np
import pytest
import torch

from moestream.conversion.synthetic import (
    CALIBRATED,
    VOCAB_SIZE,
    RoutingParams,
    byte_tokenizer,
    calibrated_router,
    make_model,
    routed_experts,
    save_checkpoint,
    skew_router,
)
from moestream.tools.simulate import replay
from moestream.tools.trace import Trace

EXPERTS, TOP_K, LAYERS = 16, 2, 2
TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=EXPERTS,
    num_experts_per_tok=TOP_K,
    max_position_embeddings=1024,
)
# Real text, as the fixture's heldout.txt is (Python source), without depending on any file outside the repo.
IDS = byte_tokenizer()(inspect.getsource(textwrap))["input_ids"][:2000]


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3_moe", seed=0, **TINY)


def _measure(experts: np.ndarray) -> dict:
    """Share of routings taken by each layer's top 25% experts; lru and lfu hit rates with 25% of all
    experts cached; the excess of next-token expert overlap over that of the same tokens shuffled."""
    tokens = experts.shape[0]
    counts = np.stack([np.bincount(experts[:, layer].ravel(), minlength=EXPERTS) for layer in range(LAYERS)])
    top = -np.sort(-counts, axis=1)[:, : EXPERTS // 4]
    trace = Trace.of_decode(experts, EXPERTS)
    slots = LAYERS * EXPERTS // 4
    onehot = np.zeros((tokens, LAYERS, EXPERTS), bool)
    np.put_along_axis(onehot, experts.astype(np.int64), True, axis=2)

    def overlap(x):
        return (x[1:] & x[:-1]).sum() / ((tokens - 1) * LAYERS * TOP_K)

    shuffled = onehot[np.random.default_rng(0).permutation(tokens)]
    return {
        "share": top.sum() / counts.sum(),
        "lru": replay(trace, slots, "lru").hit_rate,
        "lfu": replay(trace, slots, "lfu").hit_rate,
        "locality": overlap(onehot) - overlap(shuffled),
    }


def _routed(model, params: RoutingParams) -> dict:
    calibrated_router(model, params)
    return _measure(routed_experts(model, IDS))


def test_calibrated_lies_between_uniform_and_fully_biased(model):
    # The uniform extreme: each token's experts drawn at random, independently of everything.
    uniform = _measure(np.argsort(np.random.default_rng(0).random((len(IDS), LAYERS, EXPERTS)), axis=2)[..., :TOP_K])
    skew_router(model, 4.0)  # the fully biased extreme: the same few experts for every token
    biased = _measure(routed_experts(model, IDS))
    calibrated = _routed(model, CALIBRATED)
    for key in ("share", "lru", "lfu"):
        assert uniform[key] + 0.05 < calibrated[key] < biased[key] - 0.05, (key, uniform, calibrated, biased)
    assert biased["share"] > 0.95 and uniform["share"] < 0.3


def test_zipf_concentrates_popularity_and_raises_hit_rates(model):
    results = [_routed(model, RoutingParams(zipf=z, noise=1.0, topic=0.0)) for z in (0.0, 0.5, 1.0, 2.0)]
    for key in ("share", "lru", "lfu"):
        values = [r[key] for r in results]
        assert all(a < b for a, b in zip(values, values[1:])), (key, values)


def test_noise_spreads_tokens_over_more_experts(model):
    shares = [_routed(model, RoutingParams(zipf=1.0, noise=n, topic=0.0))["share"] for n in (0.5, 1.0, 2.0)]
    assert all(a > b for a, b in zip(shares, shares[1:])), shares


def test_topic_gives_consecutive_tokens_shared_experts(model):
    locality = [_routed(model, RoutingParams(zipf=0.5, noise=1.0, topic=t))["locality"] for t in (0.0, 1.0, 3.0)]
    assert all(a < b for a, b in zip(locality, locality[1:])), locality


def test_routing_survives_save_pretrained(model, tmp_path):
    from transformers import AutoModelForCausalLM

    calibrated_router(model, CALIBRATED)
    before = routed_experts(model, IDS[:200])
    save_checkpoint(model, tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert (routed_experts(reloaded, IDS[:200]) == before).all()
    # Every token of the text routes through each layer; the experts it picks are valid ids.
    assert before.shape == (200, LAYERS, TOP_K) and before.min() >= 0 and before.max() < EXPERTS

"""The budget changes what is read, never the numbers; a budget below one token's experts is a clear error."""

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.conversion.store import Store
from moestream.errors import UsageError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("budgets")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=7)
    return moestream.convert(ckpt, root / "store", experts_dtype="fp32", progress=False)


def _greedy(store, budget, prompt):
    model, _ = moestream.load(store, budget)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    return out, moestream.stats(model)


def test_tiny_budget_and_full_budget_give_identical_tokens(store):
    manifest = Store(store).manifest
    top_k = manifest.model_config["num_experts_per_tok"]
    slot = manifest.max_record_stride
    prompt = torch.randint(0, 250, (1, 9), generator=torch.Generator().manual_seed(3))

    small, small_stats = _greedy(store, top_k * slot, prompt)  # the minimum: one token's experts
    full, full_stats = _greedy(store, sum(layer.num_experts for layer in manifest.layers) * slot, prompt)
    assert torch.equal(small, full)
    # The small budget evicted experts of every layer; the full one never evicted anything.
    assert all(layer["evictions"] > 0 for layer in small_stats["layers"])
    assert full_stats["evictions"] == 0
    assert small_stats["bytes_read"] > full_stats["bytes_read"]
    # Prefill needs more distinct experts per layer than the minimum budget holds: they ran in waves.
    assert small_stats["misses"] > full_stats["misses"]


def test_budget_below_one_tokens_experts_names_the_minimum(store):
    manifest = Store(store).manifest
    minimum = manifest.model_config["num_experts_per_tok"] * manifest.max_record_stride
    with pytest.raises(UsageError, match=f"minimum is .*{minimum} bytes"):
        moestream.load(store, minimum - 1)


def test_unparseable_budget_is_a_usage_error(store):
    with pytest.raises(UsageError, match="cannot read the size"):
        moestream.load(store, "four gigs")

"""The budget changes what is read, never the numbers; a budget below one token's experts is a clear error."""

import pytest
import torch
from tiny import TINY, tiny_checkpoint

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.core import engine
from moestream.core.compute import fused
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


@pytest.mark.parametrize("family, experts_dtype", [("qwen3_moe", "int8"), ("qwen3_moe", "bf16"), ("gpt_oss", "fp32")])
def test_shared_gate_of_cached_experts_gives_the_numbers_of_one_expert_at_a_time(family, experts_dtype, tmp_path, monkeypatch):
    """With one token, cached experts share one gate over their stacked rows (engine._compute, for widths
    a multiple of engine.SHARED_GATE_WIDTH); with the threshold out of reach each gets its own. The decode
    step's logits are bit-equal (gpt-oss: its own clamped gate and biases). The fused one-token kernel,
    which would take the int8 calls, is off: this is the engine's own path."""
    monkeypatch.setattr(fused, "experts_kernel", lambda *args: None)
    field = "moe_intermediate_size" if family == "qwen3_moe" else "intermediate_size"
    model = make_model(family, seed=11, **dict(TINY[family], **{field: 64}))  # 2 x 64: a shared gate
    path = moestream.convert(
        save_checkpoint(model, tmp_path / "hf"), tmp_path / "store", experts_dtype=experts_dtype, progress=False
    )
    manifest = Store(path).manifest
    everything = sum(layer.num_experts for layer in manifest.layers) * manifest.max_record_stride
    prompt = torch.randint(0, 250, (1, 7), generator=torch.Generator().manual_seed(12))
    logits = {}
    for name, width in (("one at a time", 10**9), ("shared gate", engine.SHARED_GATE_WIDTH)):
        monkeypatch.setattr(engine, "SHARED_GATE_WIDTH", width)
        model, _ = moestream.load(path, everything, prefetch="off")
        with torch.no_grad():
            out = model(prompt, use_cache=True)
            before = moestream.stats(model)["layers"]
            step = model(out.logits[:, -1:].argmax(-1), cache=out.past_key_values)
        logits[name] = step.logits
        hits = [now["hits"] - then["hits"] for now, then in zip(moestream.stats(model)["layers"], before)]
        assert max(hits) >= 2, hits  # a call had experts to stack
    assert torch.equal(logits["one at a time"], logits["shared gate"])

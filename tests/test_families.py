"""Every supported MoE family: streamed logits and greedy tokens equal transformers' own on the same checkpoint."""

import pytest
import torch
from tiny import TINY, tiny_checkpoint
from transformers import AutoModelForCausalLM

import moestream
from moestream.conversion.store import Store


def _budget_below_half(store) -> int:
    manifest = Store(store).manifest
    budget = manifest.expert_bytes // 2 - 1
    top_k = manifest.model_config["num_experts_per_tok"]
    assert budget >= top_k * manifest.max_record_stride, "tiny config too small for a meaningful budget"
    return budget


@pytest.mark.parametrize("family", sorted(TINY))
def test_streamed_model_equals_transformers(tmp_path, family):
    _, ckpt = tiny_checkpoint(family, tmp_path / "hf", seed=hash(family) % 1000)
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    budget = _budget_below_half(store)
    streamed, _ = moestream.load(store, budget)
    reference = AutoModelForCausalLM.from_pretrained(ckpt).eval()  # transformers' own loading and forward

    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, reference.config.vocab_size - 2, (2, 11), generator=generator)
    with torch.no_grad():
        expected = reference(ids).logits
        got = streamed(ids).logits
    assert (expected - got).abs().max().item() <= 1e-5

    prompt = ids[:1, :7]
    want = reference.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    have = streamed.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert torch.equal(want, have)

    stats = moestream.stats(streamed)
    assert stats["misses"] > 0 and stats["evictions"] > 0, "the budget should have forced streaming"
    # Every miss is one record read; speculative prefetch, when on, may read a few more.
    stride = Store(store).manifest.max_record_stride
    assert stats["bytes_read"] % stride == 0 and stats["bytes_read"] >= stats["misses"] * stride

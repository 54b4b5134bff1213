"""Resident memory tracks the budget, not the model; the page cache keeps no copy of expert bytes."""

import os

import torch

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import VOCAB_SIZE, make_model, save_checkpoint
from moestream.core.memory import current_rss_bytes, page_cache_bytes, peak_rss_bytes, reset_peak_rss

# What a process needs beyond resident weights + expert budget while decoding this small model:
# activations, the KV cache, transformers' generate bookkeeping and allocator slack.
STATED_OVERHEAD = 64 * 2**20


def test_peak_rss_stays_within_resident_plus_budget(tmp_path):
    model = make_model(
        "qwen3_moe",
        seed=11,
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=128,
        num_experts_per_tok=4,
        max_position_embeddings=256,
        dtype=torch.bfloat16,
    )
    ckpt = save_checkpoint(model, tmp_path / "hf")
    del model
    store = moestream.convert(ckpt, tmp_path / "store", progress=False)
    manifest = Store(store).manifest
    budget = 16 * 2**20
    assert manifest.expert_bytes >= 8 * budget

    reset_peak_rss()
    baseline = current_rss_bytes()
    streamed, _ = moestream.load(store, budget)
    prompt = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    with torch.inference_mode():
        streamed.generate(prompt, max_new_tokens=48, min_new_tokens=48, do_sample=True, top_k=0, temperature=1.0)
    growth = peak_rss_bytes() - baseline
    stats = moestream.stats(streamed)

    print(f"growth {growth / 2**20:.1f} MiB, read {stats['bytes_read'] / 2**20:.0f} MiB")
    assert stats["bytes_read"] > 2 * budget, "the run must have streamed more than the budget holds"
    assert growth <= manifest.resident_bytes + budget + STATED_OVERHEAD, (
        f"peak RSS grew by {growth / 2**20:.1f} MiB; resident {manifest.resident_bytes / 2**20:.1f} MiB "
        f"+ budget {budget / 2**20:.0f} MiB + overhead {STATED_OVERHEAD / 2**20:.0f} MiB"
    )
    expert_files = [store / layer.file for layer in manifest.layers]
    cached = sum(page_cache_bytes(f) for f in expert_files)
    total = sum(f.stat().st_size for f in expert_files)
    assert cached <= 0.02 * total, f"{cached} of {total} expert bytes sit in the page cache"


def test_buffered_io_keeps_read_experts_in_the_page_cache(tmp_path):
    from tiny import tiny_checkpoint

    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=12)
    store = moestream.convert(ckpt, tmp_path / "store", progress=False)
    manifest = Store(store).manifest
    files = [store / layer.file for layer in manifest.layers]
    for f in files:  # start from a cold page cache for these files
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    cached = {}
    for direct in (True, False):
        model, _ = moestream.load(store, 4 * manifest.max_record_stride, direct_io=direct)
        with torch.no_grad():
            model(torch.randint(0, 250, (1, 12), generator=torch.Generator().manual_seed(3)))
        read = moestream.stats(model)["bytes_read"]
        cached[direct] = sum(page_cache_bytes(f) for f in files)
        assert read > 0
    assert cached[True] == 0  # direct: no copy outside the process
    assert cached[False] >= manifest.max_record_stride  # buffered: the OS keeps what was read

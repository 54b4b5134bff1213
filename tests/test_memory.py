"""Resident memory tracks the budget, not the model; the page cache keeps no copy of expert bytes."""

import os
import time

import pytest
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


def test_the_freed_heap_goes_back_to_the_os(monkeypatch):
    """glibc keeps freed memory for later: 200 MiB of 64 KiB blocks (below its mmap threshold, so on the
    heap), every fourth kept, the rest freed, leave the RSS high until release_freed_heap hands the free
    pages back (where the C library has no malloc_trim, there is nothing to hand back, and the test says so)."""
    from moestream.core import memory

    if memory._malloc_trim is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    memory.release_freed_heap()
    blocks = [torch.ones(64 * 2**10, dtype=torch.uint8) for _ in range(3200)]
    kept = blocks[::4]
    del blocks
    before = current_rss_bytes()
    memory.release_freed_heap()
    after = current_rss_bytes()
    assert before - after > 100 * 2**20, (before, after)  # of the 150 MiB freed between the kept blocks
    assert sum(int(b.sum()) for b in kept) == 800 * 64 * 2**10  # the kept blocks are untouched


def test_heap_bytes_count_what_is_handed_out_apart_from_what_is_kept_free():
    """heap_bytes() separates the C heap's bytes in use from those it keeps free: 64 MiB of 64 KiB tensors
    raise the first by about that much; freeing three of every four moves about 48 MiB to the second (until
    a trim), the bytes in use dropping by as much."""
    from moestream.core import memory

    if memory.heap_bytes() is None:
        pytest.skip("this C library has no mallinfo2 (not glibc 2.33 or later)")
    memory.release_freed_heap()
    used0, _ = memory.heap_bytes()
    blocks = [torch.ones(64 * 2**10, dtype=torch.uint8) for _ in range(1024)]
    used1, free1 = memory.heap_bytes()
    assert 60 * 2**20 < used1 - used0 < 72 * 2**20, (used0, used1)
    kept = blocks[::4]
    del blocks
    used2, free2 = memory.heap_bytes()
    assert 44 * 2**20 < used1 - used2 < 52 * 2**20, (used1, used2)
    assert free2 - free1 > 44 * 2**20, (free1, free2)
    assert sum(int(b.sum()) for b in kept) == 256 * 64 * 2**10


def test_the_server_worker_releases_the_heap_when_its_work_runs_out(tmp_path, monkeypatch):
    """The worker hands the freed heap back after a step that leaves it idle (at most once a second), so a
    server's RSS tracks what it holds between bursts, not what its steps once needed."""
    import asyncio

    from tiny import tiny_checkpoint

    from moestream.generation import worker as worker_module
    from moestream.generation.generate import SamplingParams
    from moestream.generation.worker import Choice, Worker

    released = []
    monkeypatch.setattr(worker_module, "release_freed_heap", lambda: released.append(time.monotonic()))
    monkeypatch.setattr(worker_module, "RELEASE_HEAP_IDLE_SECONDS", 0.0)
    _, ckpt = tiny_checkpoint("qwen3_moe", tmp_path / "hf", seed=4)
    store = moestream.convert(ckpt, tmp_path / "store", progress=False)
    model, tokenizer = moestream.load(store, "1MiB")
    worker = Worker(model, tokenizer, 4)
    worker.start()

    async def ask():
        job = worker.submit([Choice([5, 6, 7, 8], SamplingParams.greedy(6))], timeout=120)
        return [event async for event in job.output()]

    try:
        asyncio.run(ask())
        deadline = time.monotonic() + 10  # (the answer is out before its step returns to the worker's loop)
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(released) >= 1
        steps = worker.stats().batch_steps
        assert len(released) <= steps + 1  # once per step at the most: the last one left it idle
    finally:
        worker.close()
        moestream.close(model)

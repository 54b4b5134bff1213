"""The prefix cache's tier on disk (generation/kv_disk.py): a continued conversation gets the same greedy
tokens whether its prefix came from RAM, from disk, from disk after a restart, or from a fresh prefill; a
damaged, truncated or foreign file is never loaded (the prefix is computed again, the tokens the same); the
directory stays within its budget; a failed write leaves the prefix in RAM and the request served."""

import os
import threading

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.generation import kv_disk
from moestream.generation.generate import SamplingParams
from moestream.generation.kv_cache import PrefixCache
from moestream.generation.kv_disk import FORMAT, SUFFIX, DiskTier, TierFileError, identity, load, write_file
from moestream.generation.serving import generate_batch


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvdisk")
    _, checkpoint = tiny_checkpoint("qwen3_moe", root / "hf", seed=6)
    assert main(["convert", str(checkpoint), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


@pytest.mark.parametrize("reads", ["plain", "direct, in pieces"])
def test_a_file_gives_back_every_layer_bit_for_bit(tmp_path, monkeypatch, reads):
    """Float, 8-bit and sliding-window layers, odd sizes (an int8 tensor of an odd byte count before a bf16
    one): load(write_file(cache)) has the same tensors and attributes; full-attention layers come back as
    growing layers whose next positions are written in place (no copy of the prefix), and `keep` cuts."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    from moestream.generation import kv_disk
    from moestream.generation.kv_layer import GrowingLayer, Int8Layer

    if reads != "plain":  # every file around the page cache (where the file system allows), a block a read
        monkeypatch.setattr(kv_disk, "DIRECT_FROM", 0)
        monkeypatch.setattr(kv_disk, "PIECE", 1)
    g = torch.Generator().manual_seed(10)
    cache = DynamicCache.__new__(DynamicCache)
    cache.__dict__.update({"layer_class_to_replicate": None, "offloading": False})
    float_layer = DynamicLayer()
    float_layer.lazy_initialization(torch.randn(1, 2, 5, 8, generator=g).bfloat16(), torch.randn(1, 2, 5, 8).bfloat16())
    float_layer.keys, float_layer.values = (
        torch.randn(1, 2, 5, 8, generator=g).bfloat16(),
        torch.randn(1, 2, 5, 8, generator=g).bfloat16(),
    )
    packed = Int8Layer.__new__(Int8Layer)
    packed.__dict__.update({"is_initialized": True, "device": torch.device("cpu"), "_buffers": None})
    packed.keys = torch.randint(-128, 127, (1, 1, 3, 3), generator=g, dtype=torch.int8)  # 9 bytes
    packed.values = torch.randint(-128, 127, (1, 1, 3, 3), generator=g, dtype=torch.int8)
    sliding = DynamicSlidingWindowLayer(sliding_window=4)
    sliding.lazy_initialization(torch.randn(1, 2, 3, 8).float(), torch.randn(1, 2, 3, 8).float())
    sliding.keys, sliding.values = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    sliding.cumulative_length = 3
    big = DynamicLayer()  # blocks of several pages (a head of 600 positions of 16 floats)
    big.lazy_initialization(torch.randn(1, 3, 600, 16), torch.randn(1, 3, 600, 16))
    big.keys, big.values = torch.randn(1, 3, 600, 16, generator=g), torch.randn(1, 3, 600, 16, generator=g)
    cache.layers = [float_layer, packed, sliding, big]
    ident = {"format": FORMAT, "store": "s"}
    write_file(tmp_path / "a.kv", [1, 2, 3], cache, ident)
    ids, back, arrival = load(tmp_path / "a.kv", ident)
    arrival.wait(range(len(arrival.specs)))
    assert ids == [1, 2, 3]
    assert [type(layer) for layer in back.layers] == [GrowingLayer, Int8Layer, DynamicSlidingWindowLayer, GrowingLayer]
    for mine, theirs in zip(cache.layers, back.layers):
        assert set(vars(mine)) | ({"_buffers", "arriving"} if isinstance(theirs, GrowingLayer) else set()) == set(vars(theirs))
        for key, value in vars(mine).items():
            other = getattr(theirs, key)
            if key != "_buffers":  # (a growing layer's own: checked below)
                assert (
                    torch.equal(value, other) and value.dtype == other.dtype
                    if isinstance(value, torch.Tensor)
                    else value == other
                )
    for layer, width in ((back.layers[0], 8), (back.layers[3], 16)):
        where, before = layer.keys.data_ptr(), layer.keys.clone()
        new = torch.randn(1, layer.keys.shape[1], 2, width, generator=g, dtype=layer.keys.dtype)
        keys, _ = layer.update(new, new.clone())
        assert keys.data_ptr() == where and torch.equal(keys, torch.cat([before, new], dim=-2))  # in place
    _, cut, arrival = load(tmp_path / "a.kv", ident, keep=2)
    arrival.wait(range(len(arrival.specs)))
    assert [layer.keys.shape[-2] for layer in cut.layers] == [2, 2, 2, 2]
    assert torch.equal(cut.layers[3].values, big.values[..., :2, :]) and torch.equal(cut.layers[2].keys, sliding.keys[..., :2, :])


def _tokens(model, tokenizer, prompt, prefixes=None, n=8):
    (result,) = generate_batch(model, tokenizer, [prompt], SamplingParams.greedy(n, ignore_eos=True), prefix_cache=prefixes)
    return result.token_ids, result.cached_tokens


def _tier(model, directory, budget=2**30, store="this store"):
    return DiskTier(directory, budget, identity(store, model.config))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_continuation_gets_the_same_tokens_from_ram_disk_a_restart_and_a_fresh_prefill(store, tmp_path, kv_cache_dtype):
    if kv_cache_dtype == "int8":
        pytest.importorskip("moestream.native.fused_build").extension() or pytest.skip("no compiled kernels")
    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32", kv_cache_dtype=kv_cache_dtype)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 250, (30,), generator=g).tolist()
    other = torch.randint(3, 250, (30,), generator=g).tolist()
    first, _ = _tokens(model, tokenizer, prompt)
    follow = prompt + first + torch.randint(3, 250, (5,), generator=g).tolist()
    fresh, cached = _tokens(model, tokenizer, follow)
    assert cached == 0
    # RAM
    ram = PrefixCache(2**30)
    _tokens(model, tokenizer, prompt, ram)
    from_ram, cached = _tokens(model, tokenizer, follow, ram)
    assert cached > 0
    # evicted to disk: RAM holds one conversation, the other pushes it out
    tier = _tier(model, tmp_path / "tier")
    small = PrefixCache(2**30, disk=tier)
    _tokens(model, tokenizer, prompt, small)
    small.budget_bytes = small.stats().bytes * 3 // 2  # room for one conversation
    _tokens(model, tokenizer, other, small)
    tier.flush()
    assert tier.stats().writes >= 1 and not any(ids[:30] == tuple(prompt) for ids in small._entries)
    from_disk, cached_disk = _tokens(model, tokenizer, follow, small)
    assert cached_disk == cached and tier.stats().hits == 1
    # a restart: a new tier on the same directory finds what the last one wrote; a clean stop flushes RAM too,
    # so the follow-up's own KV is there now, all of its prompt but the last token
    small.flush()
    restarted = PrefixCache(2**30, disk=_tier(model, tmp_path / "tier"))
    after_restart, cached_restart = _tokens(model, tokenizer, follow, restarted)
    assert cached_restart == len(follow) - 1 and restarted.disk.stats().hits == 1
    assert from_ram == from_disk == after_restart
    if kv_cache_dtype == "auto":  # (int8 rows read back differ from a fresh prefill's float ones: test_kv_int8.py)
        assert fresh == from_ram
    moestream.close(model)


def test_a_prefix_still_being_written_to_disk_is_reused_from_ram(store, tmp_path, monkeypatch):
    """An agent's next turn comes as soon as its tool has run, while the last turn's KV (larger than
    --kv-memory, so bound for the disk only) is still being written: the turn reuses that prefix from RAM,
    and gets the tokens a fresh prefill gives; the write then completes."""
    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32")
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(3, 250, (40,), generator=g).tolist()
    first, _ = _tokens(model, tokenizer, prompt)
    follow = prompt + first + torch.randint(3, 250, (5,), generator=g).tolist()
    fresh, _ = _tokens(model, tokenizer, follow)
    release, write = threading.Event(), DiskTier._write
    monkeypatch.setattr(DiskTier, "_write", lambda self, ids, cache: (release.wait(60), write(self, ids, cache)))
    tier = _tier(model, tmp_path / "tier")
    prefixes = PrefixCache(1, disk=tier)  # (every conversation's KV is more than RAM may keep: the disk's only)
    _tokens(model, tokenizer, prompt, prefixes)
    assert tier.stats().writes == 0 and [ids for ids, _ in tier.pending()] == [tuple(prompt + first[:-1])]
    reused, cached = _tokens(model, tokenizer, follow, prefixes)
    assert cached == len(prompt) + len(first) - 1 and reused == fresh
    release.set()
    tier.flush()
    assert tier.stats().writes == 2 and not tier.pending()  # (the follow-up's own KV went the same way)
    moestream.close(model)


def test_a_batch_of_rows_some_with_prefixes_from_disk_gets_each_rows_own_tokens(store, tmp_path):
    """Three prompts decoded together: one whose prefix comes from the disk tier, one from RAM, one fresh;
    each row's greedy tokens are the ones it gets alone without any cache."""
    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 250, (20 + 3 * i,), generator=g).tolist() for i in range(3)]
    alone = [_tokens(model, tokenizer, p)[0] for p in prompts]
    follows = [p + a + [7, 8] for p, a in zip(prompts, alone)]
    expected = [_tokens(model, tokenizer, f)[0] for f in follows]
    tier = _tier(model, tmp_path / "tier")
    cache = PrefixCache(2**30, disk=tier)
    _tokens(model, tokenizer, prompts[0], cache)
    cache.flush()
    cache.clear()  # the first prompt's KV now on disk only
    _tokens(model, tokenizer, prompts[1], cache)  # the second's in RAM
    params = SamplingParams.greedy(8, ignore_eos=True)
    results = generate_batch(model, tokenizer, follows, params, max_batch=3, prefix_cache=cache)
    assert [r.token_ids for r in results] == expected
    assert results[0].cached_tokens > 0 and results[1].cached_tokens > 0 and results[2].cached_tokens == 0
    assert tier.stats().hits == 1
    moestream.close(model)


def test_a_damaged_truncated_or_foreign_file_is_never_loaded(store, tmp_path):
    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32")
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(3, 250, (24,), generator=g).tolist()
    first, _ = _tokens(model, tokenizer, prompt)
    follow = prompt + first + [5, 6, 7]
    fresh, _ = _tokens(model, tokenizer, follow)

    def written(directory):
        cache = PrefixCache(2**30, disk=_tier(model, directory))
        _tokens(model, tokenizer, prompt, cache)
        cache.flush()
        (path,) = directory.glob(f"*{SUFFIX}")
        return path

    for damage in ("flip", "truncate"):
        path = written(tmp_path / damage)
        data = bytearray(path.read_bytes())
        if damage == "flip":
            data[-10] ^= 0x10  # a byte of the last tensor
        else:
            data = data[: len(data) - 100]
        path.write_bytes(bytes(data))
        restarted = PrefixCache(2**30, disk=_tier(model, tmp_path / damage))
        tokens, cached = _tokens(model, tokenizer, follow, restarted)
        assert cached == 0 and tokens == fresh, damage  # computed again, the same tokens
        assert not path.exists() and restarted.disk.stats().dropped == 1
        # a truncated file is refused by its size before it is read; a flipped byte is found as it arrives,
        # once the prefill has started from it (the read overlaps the first layers' compute)
        assert restarted.disk.stats().hits == (1 if damage == "flip" else 0)
    # a tier written for another store is left alone: not loaded, not deleted
    path = written(tmp_path / "foreign")
    other = PrefixCache(2**30, disk=_tier(model, tmp_path / "foreign", store="another store"))
    tokens, cached = _tokens(model, tokenizer, follow, other)
    assert cached == 0 and tokens == fresh and path.exists() and other.disk.stats().entries == 0
    with pytest.raises(TierFileError, match="another store"):
        load(path, identity("another store", model.config))
    moestream.close(model)


def test_the_directory_stays_within_its_budget_and_a_failed_write_loses_nothing(store, tmp_path, monkeypatch):
    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32")
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, 250, (20,), generator=g).tolist() for _ in range(5)]
    probe = PrefixCache(2**30)
    _tokens(model, tokenizer, prompts[0], probe, n=2)
    ((entry, _),) = probe._entries.values()
    size = write_file(tmp_path / "one.kv", prompts[0], entry, identity("s", model.config))
    tier = _tier(model, tmp_path / "budget", budget=2 * size + size // 2, store="s")
    cache = PrefixCache(1, disk=tier)  # RAM holds nothing: a prefix too big for it goes to the disk at once
    for prompt in prompts:
        cache.put(prompt, entry)  # (any KV: the budget is in bytes)
        tier.flush()
        on_disk = sum(p.stat().st_size for p in (tmp_path / "budget").iterdir())
        assert on_disk <= tier.budget_bytes
    assert tier.stats().entries == 2
    # the same prefix queued twice (evicted, then flushed at a stop) is one file, still there
    tier.put(prompts[0], entry)
    tier.put(prompts[0], entry)
    tier.flush()
    assert tier.match(prompts[0] + [1])[1] == len(prompts[0])
    # a full disk: the write fails, is counted, and nothing else changes
    full = _tier(model, tmp_path / "full", store="s")

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("builtins.open", no_space)
    full.put(prompts[0], entry)
    full.flush()
    monkeypatch.undo()
    assert full.stats().errors == 1 and full.stats().entries == 0
    assert not any(os.scandir(tmp_path / "full"))
    moestream.close(model)


def test_a_conversation_survives_a_server_restart_through_the_tier(store, tmp_path):
    """The server's path: a conversation's KV goes to the tier at a clean stop; a new server on the same
    directory reuses it (its usage says how many prompt tokens were cached, /metrics the tier's hit), and
    the answer is the one a server without a tier gives."""
    from fastapi.testclient import TestClient

    from moestream.server.http_app import ServerConfig, create_app

    model, tokenizer = moestream.load(store, "1GiB", compute_dtype="fp32")
    with_tier = ServerConfig("m", kv_disk=str(tmp_path / "kv"), kv_disk_memory=2**30)
    ask = {"model": "m", "prompt": "one two three four five six seven", "max_tokens": 6, "temperature": 0}
    with TestClient(create_app(model, tokenizer, with_tier)) as http:
        first = http.post("/v1/completions", json=ask).json()["choices"][0]["text"]
    assert list((tmp_path / "kv").glob(f"*{SUFFIX}"))  # (written at the stop)
    follow = {**ask, "prompt": ask["prompt"] + first + " eight nine"}
    with TestClient(create_app(model, tokenizer, with_tier)) as http:
        reply = http.post("/v1/completions", json=follow).json()
        metrics = http.get("/metrics").text
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert "moestream_kv_disk_hits_total 1.0" in metrics
    with TestClient(create_app(model, tokenizer, ServerConfig("m", kv_memory=0))) as http:
        fresh = http.post("/v1/completions", json=follow).json()
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert reply["choices"][0]["text"] == fresh["choices"][0]["text"]
    moestream.close(model)


def test_the_index_finds_the_same_shared_prefix_in_packed_ids_as_in_the_ids_themselves():
    """The tier's index keeps each prefix's ids packed (4 bytes a token, not a tuple of Python ints) and
    compares them by a binary search over bytes: the same length as a plain walk over the ids."""
    g = torch.Generator().manual_seed(11)

    def ids(n: int) -> list[int]:  # few distinct ids (long shared runs), some beyond 2^16
        return [x * 70_001 for x in torch.randint(0, 4, (n,), generator=g).tolist()]

    for _ in range(300):
        a = ids(int(torch.randint(0, 40, (1,), generator=g)))
        b = a[: int(torch.randint(0, len(a) + 1, (1,), generator=g))] + ids(int(torch.randint(0, 10, (1,), generator=g)))
        limit = int(torch.randint(0, 45, (1,), generator=g))
        expected = kv_disk.common_prefix(a, b, limit)
        assert kv_disk.common_packed_prefix(kv_disk.packed(a), kv_disk.packed(b), limit) == expected

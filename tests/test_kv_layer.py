"""KV cache layers that grow into room (generation/kv_layer.py): the same tensors as transformers'
concatenation at every step, layers that share buffers kept apart, the same logits end to end."""

import copy

import pytest
import torch
from tiny import tiny_checkpoint
from transformers.cache_utils import DynamicLayer

import moestream
from moestream.cli import main
from moestream.generation import kv_cache, kv_layer
from moestream.generation.batching import BatchGenerator
from moestream.generation.generate import Decoding, SamplingParams
from moestream.generation.kv_cache import PrefixCache, kv_bytes
from moestream.generation.kv_layer import GrowingLayer, grow_in_place
from moestream.generation.serving import stream


def _steps(g: torch.Generator, lengths, heads: int = 2, dim: int = 8):
    return [(torch.randn(1, heads, n, dim, generator=g), torch.randn(1, heads, n, dim, generator=g)) for n in lengths]


def _check_against_cat(layer, reference, steps) -> None:
    for k, v in steps:
        got = layer.update(k, v)
        expected = reference.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
        assert layer.get_seq_length() == reference.get_seq_length()


@pytest.mark.parametrize("room", [1, 3, 256])
def test_a_growing_layer_holds_what_concatenation_holds_at_every_step(room, monkeypatch):
    monkeypatch.setattr(kv_layer, "ROOM", room)
    g = torch.Generator().manual_seed(room)
    layer, reference = GrowingLayer(), DynamicLayer()
    _check_against_cat(layer, reference, _steps(g, [5] + [1] * 20 + [4] + [1] * 7))
    assert layer._buffers.keys.shape[-2] <= layer.get_seq_length() + room + 4  # room, never more


def test_layers_sharing_buffers_do_not_write_into_each_other(monkeypatch):
    """A copy of a layer (the prefix cache's, kv_cache._shallow) and the layer both go on; a cropped copy
    goes on too. Each holds its own history, whatever the others appended."""
    monkeypatch.setattr(kv_layer, "ROOM", 8)
    g = torch.Generator().manual_seed(1)
    layer, reference = GrowingLayer(), DynamicLayer()
    _check_against_cat(layer, reference, _steps(g, [4, 1, 1]))
    kept, kept_reference = copy.copy(layer), copy.copy(reference)  # shares the buffers
    cropped, cropped_reference = copy.copy(layer), copy.copy(reference)
    cropped.crop(-2)
    cropped_reference.crop(-2)
    _check_against_cat(layer, reference, _steps(g, [1, 1, 1]))  # in place, at the frontier
    _check_against_cat(kept, kept_reference, _steps(g, [1, 1]))  # behind the frontier: copies first
    _check_against_cat(cropped, cropped_reference, _steps(g, [1, 2, 1]))
    _check_against_cat(layer, reference, _steps(g, [1] * 10))
    assert layer._buffers is not kept._buffers is not cropped._buffers


def test_tensors_replaced_from_outside_are_copied_before_growing(monkeypatch):
    """Batching replaces a layer's tensors (rows joined by torch.cat): the next update must not write
    into the old buffers, whose frontier the new tensors are not at."""
    monkeypatch.setattr(kv_layer, "ROOM", 8)
    g = torch.Generator().manual_seed(2)
    layer, reference = GrowingLayer(), DynamicLayer()
    _check_against_cat(layer, reference, _steps(g, [3, 1]))
    other_k, other_v = _steps(g, [4])[0]
    layer.keys, layer.values = torch.cat([layer.keys, other_k]), torch.cat([layer.values, other_v])
    reference.keys, reference.values = torch.cat([reference.keys, other_k]), torch.cat([reference.values, other_v])
    _check_against_cat(layer, reference, [(torch.randn(2, 2, 1, 8, generator=g), torch.randn(2, 2, 1, 8, generator=g))])


@pytest.fixture(scope="module")
def qwen_store(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=4)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


def _decode_logits(model, prompt, n: int, prefix_cache=None) -> list[torch.Tensor]:
    seen = []
    stream(model, None, prompt, SamplingParams.timed(n), prefix_cache=prefix_cache, on_logits=seen.append)
    return seen


def test_decoding_gives_the_same_logits_as_with_concatenation(qwen_store, monkeypatch):
    monkeypatch.setattr(kv_layer, "ROOM", 5)  # many reallocations in a short decode
    model, _ = moestream.load(qwen_store, "1MiB")
    prompt = torch.randint(3, 250, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    grown = _decode_logits(model, prompt, 40)
    with monkeypatch.context() as m:
        m.setattr(kv_cache, "grow_in_place", lambda cache: None)
        concatenated = _decode_logits(model, prompt, 40)
    assert all(torch.equal(a, b) for a, b in zip(grown, concatenated)) and len(grown) == 40


def test_the_prefix_cache_keeps_plain_compact_layers(qwen_store, monkeypatch):
    """What the prefix cache keeps of a grown sequence holds exactly its positions (its byte count is true)
    and is a plain DynamicLayer, and a prompt continuing it decodes as a fresh prefill does."""
    monkeypatch.setattr(kv_layer, "ROOM", 64)
    model, _ = moestream.load(qwen_store, "1MiB")
    prefixes = PrefixCache(2**30)
    prompt = torch.randint(3, 250, (6,), generator=torch.Generator().manual_seed(5)).tolist()
    first = _decode_logits(model, prompt, 12, prefix_cache=prefixes)
    ((entry, size),) = prefixes._entries.values()
    assert all(type(layer) is DynamicLayer for layer in entry.layers)
    held = sum(t.untyped_storage().nbytes() for layer in entry.layers for t in (layer.keys, layer.values))
    assert held == size == kv_bytes(entry)
    follow = prompt + [int(x.argmax()) for x in first[:-1]] + [7, 8]
    assert _decode_logits(model, follow, 5, prefix_cache=prefixes)[0].shape == first[0].shape
    fresh = _decode_logits(model, follow, 5)
    reused = _decode_logits(model, follow, 5, prefix_cache=prefixes)
    assert prefixes.stats().hits >= 2
    assert [int(x.argmax()) for x in reused] == [int(x.argmax()) for x in fresh]


def test_grow_in_place_leaves_other_layer_kinds_alone():
    class Other(DynamicLayer):
        pass

    class Cache:
        layers = [DynamicLayer(), Other()]

    cache = Cache()
    grow_in_place(cache)
    assert type(cache.layers[0]) is GrowingLayer and type(cache.layers[1]) is Other


def _batched_logits(model, prompts, news, join_after: int) -> tuple[BatchGenerator, list[list[torch.Tensor]]]:
    """Greedy decoding of prompts[0] in a BatchGenerator, prompts[1] joining after `join_after` steps;
    the batch, and every row's logits at every step."""
    seen = [[] for _ in prompts]
    decodings = [Decoding(model, None, p, SamplingParams.greedy(n)) for p, n in zip(prompts, news)]
    for d, out in zip(decodings, seen):
        d.sampler = lambda logits, out=out: (out.append(logits.clone()), logits.argmax(dim=-1))[1]
    batch = BatchGenerator(model, max_batch=2)
    batch.admit(decodings[0])
    for step in range(60):
        if step == join_after:
            batch.admit(decodings[1])
            batch.prefill_step()  # (its whole prompt: no prefill_chunk)
        if not batch.running:
            break
        batch.decode()
    return batch, seen


def test_a_batch_grows_in_place_and_computes_what_concatenation_does(qwen_store, monkeypatch):
    """A lone row writes each step into room (no copy of its history per step); rows joining and leaving
    replace the tensors, and every row's logits stay those of transformers' concatenating layers."""
    monkeypatch.setattr(kv_layer, "ROOM", 64)
    model, _ = moestream.load(qwen_store, "1MiB")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 12)]
    lone = BatchGenerator(model, max_batch=2)
    lone.admit(Decoding(model, None, prompts[0], SamplingParams.greedy(40)))
    lone.decode()
    layer = lone.kv.cache.layers[0]
    buffer = layer._buffers.keys.data_ptr()
    for _ in range(20):
        lone.decode()
    assert isinstance(layer, GrowingLayer) and layer._buffers.keys.data_ptr() == buffer == layer.keys.data_ptr()
    assert layer.keys.shape[-2] == len(prompts[0]) + 21

    monkeypatch.setattr(kv_layer, "ROOM", 5)  # reallocations too, besides the joins and the leave
    _, grown = _batched_logits(model, prompts, [30, 10], join_after=6)
    with monkeypatch.context() as m:
        m.setattr(kv_cache, "grow_in_place", lambda cache: None)
        _, concatenated = _batched_logits(model, prompts, [30, 10], join_after=6)
    assert [len(x) for x in grown] == [30, 10]
    for ours, theirs in zip(grown, concatenated):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)) and len(ours) == len(theirs)

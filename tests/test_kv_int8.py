"""The 8-bit KV cache (`--kv-cache-dtype int8`; core/compute/attention.py packs the rows, generation/kv_layer.py holds
them): each element within half a step of its float value, a model's logits within the stated error of the
float cache's, rows batched and cut exactly as they are alone, the prefix cache keeping packed rows, and a
clear error where the attention kernel is not the model's."""

import pytest
import torch
from test_kv_layer import _batched_logits
from test_kv_layer import _decode_logits as _decode
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.core.compute import attention, fused
from moestream.core.loading import stats
from moestream.errors import UsageError
from moestream.generation.generate import Forward
from moestream.generation.kv_cache import PrefixCache, kv_bytes
from moestream.generation.kv_layer import Int8Layer
from moestream.generation.serving import timed
from moestream.native import fused_build


def _prefilled(model, prompt):
    """The model's KV cache after a prefill of `prompt`, as a decoding holds it."""
    forward = Forward(model)
    with torch.inference_mode():
        forward(torch.tensor([prompt]))
    return forward.cache


def test_packed_rows_are_within_half_a_step_of_the_float_ones():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, 50, 128, generator=g)
    x[..., 7] *= 30  # an outlier channel, as keys have
    x[1, 1, 3] = 0  # a row of zeros (a batch's padding)
    packed = attention.pack_int8(x)
    assert packed.dtype == torch.int8 and packed.shape == (3, 2, 50, 128 + attention.SCALE_BYTES)
    back = attention.unpack_int8(packed, torch.float64)
    step = x.abs().amax(-1, keepdim=True).double() / 127
    assert ((back - x.double()).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[1, 1, 3], torch.zeros(128, dtype=torch.float64))
    # packing what unpacks in float32 gives the same bytes (a cache's rows can be widened and packed again)
    assert torch.equal(attention.pack_int8(attention.unpack_int8(packed, torch.float32)), packed)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    if fused_build.extension() is None:
        pytest.skip(f"no compiled kernels: {fused.unavailable_reason()}")
    root = tmp_path_factory.mktemp("kv8")
    _, checkpoint = tiny_checkpoint("qwen3_moe", root / "hf", seed=5)
    assert main(["convert", str(checkpoint), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


def test_decoding_stays_within_the_stated_error_of_the_float_cache(store):
    """After a 600-token prompt, 48 steps: every logit within 2% of the largest one of the float cache's
    step, the same greedy token at 46 steps or more, and a cache of int8 rows (about a quarter of float32's
    bytes here)."""
    prompt = torch.randint(3, 250, (600,), generator=torch.Generator().manual_seed(8)).tolist()
    plain, _ = moestream.load(store, "1GiB")
    packed, _ = moestream.load(store, "1GiB", kv_cache_dtype="int8")
    note = next(p["note"] for p in stats(packed)["fast_paths"] if p["name"] == "attention function")
    assert "8-bit KV cache" in note
    expected, got = _decode(plain, prompt, 48), _decode(packed, prompt, 48)
    for a, b in zip(expected, got):
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()
    assert sum(int(a.argmax()) == int(b.argmax()) for a, b in zip(expected, got)) >= 46
    assert any(not torch.equal(a, b) for a, b in zip(expected, got))  # the int8 rows were read

    cache = _prefilled(packed, prompt[:40])
    layers = [layer for layer in cache.layers if layer.is_initialized]
    assert layers and all(type(layer) is Int8Layer and layer.keys.dtype == torch.int8 for layer in layers)
    dim = layers[0].keys.shape[-1] - attention.SCALE_BYTES
    assert kv_bytes(cache) == sum(2 * t.keys.shape[:-1].numel() * (dim + attention.SCALE_BYTES) for t in layers)


def test_a_batch_of_int8_rows_computes_what_each_row_does_alone(store):
    """Rows joining (left-padded with zero rows), decoding together and leaving (cut) move codes and
    scales together: each row's logits are the ones it gets decoding alone (to the rounding a batch's
    matmuls bring with a float cache too; a scale moved apart from its codes would be off by far more)."""
    model, _ = moestream.load(store, "1GiB", kv_cache_dtype="int8")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (7, 30)]
    news = [24, 8]
    alone = [_decode(model, p, n) for p, n in zip(prompts, news)]
    batch, seen = _batched_logits(model, prompts, news, join_after=5)
    assert [len(x) for x in seen] == news
    assert all(type(layer) is Int8Layer for layer in (batch.kv.cache.layers if batch.kv.cache else []))
    for ours, theirs in zip(seen, alone):  # (float32 rows: a batch's matmuls round as alone's within 1e-7)
        assert all(torch.allclose(a, b, atol=1e-6, rtol=0) for a, b in zip(ours, theirs))


def test_the_prefix_cache_keeps_packed_rows_and_a_continuation_reads_them(store):
    model, _ = moestream.load(store, "1GiB", kv_cache_dtype="int8")
    prefixes = PrefixCache(2**30)
    prompt = torch.randint(3, 250, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    first = _decode(model, prompt, 6, prefix_cache=prefixes)
    ((entry, size),) = prefixes._entries.values()
    assert all(type(layer) is Int8Layer and layer.keys.dtype == torch.int8 for layer in entry.layers)
    assert (
        size == kv_bytes(entry) == sum(t.untyped_storage().nbytes() for layer in entry.layers for t in (layer.keys, layer.values))
    )
    follow = prompt + [int(x.argmax()) for x in first[:-1]] + [11, 12]
    fresh = _decode(model, follow, 5)
    reused = _decode(model, follow, 5, prefix_cache=prefixes)
    assert prefixes.stats().hits >= 1
    # the reused prefix is read as int8 rows by the continuation's prompt too (a fresh prefill attends to float rows)
    for a, b in zip(fresh, reused):
        assert (a - b).abs().max().item() <= 0.02 * a.abs().max().item()


def test_an_8bit_cache_needs_the_attention_kernel(store, capsys):
    with pytest.raises(UsageError, match="8-bit KV cache is read by moestream's attention kernel only"):
        moestream.load(store, "1GiB", kv_cache_dtype="int8", attention="sdpa")
    with pytest.raises(UsageError, match="kv_cache_dtype must be one of"):
        moestream.load(store, "1GiB", kv_cache_dtype="q4")
    code = main(
        ["generate", str(store), "--prompt", "hello", "--max-new-tokens", "2", "--kv-cache-dtype", "int8", "--attention", "sdpa"]
    )
    assert code != 0
    err = capsys.readouterr().err
    assert "8-bit KV cache" in err and "Traceback" not in err
    assert len(timed(moestream.load(store, "1GiB", kv_cache_dtype="int8")[0], [5, 6, 7], 3).token_ids) == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_the_kv_sizes_inspect_prints_are_what_a_cache_holds(family):
    """KVSizes (inspect's KV rows) against the bytes of the cache transformers' own forward leaves, in the
    model's dtype and packed as an 8-bit cache: full layers, sliding windows (gpt_oss), MLA (deepseek_v3)."""
    from tiny import tiny_model

    from moestream.conversion.sizes import KVSizes
    from moestream.generation.kv_layer import grow_in_place

    model = tiny_model(family)
    kv = KVSizes.of_config(model.config)
    assert kv is not None
    for positions in (3, 40):
        ids = torch.randint(3, 250, (1, positions), generator=torch.Generator().manual_seed(positions))
        with torch.no_grad():
            cache = model(ids, use_cache=True).past_key_values
        assert kv_bytes(cache) == kv.nbytes(positions, element_bytes=4), positions
        if kv.packable:  # (the layers an 8-bit cache packs: every full-attention one here)
            grow_in_place(cache, packed=range(len(cache.layers)))
            assert kv_bytes(cache) == kv.nbytes(positions, element_bytes=4, int8=True)


def test_a_latent_cache_is_left_in_its_dtype(tmp_path):
    """MLA (deepseek_v3) caches a latent that its own code widens per head before the attention reads it:
    packed rows would break that code, so its layers stay as they are and it decodes as without the option."""
    _, checkpoint = tiny_checkpoint("deepseek_v3", tmp_path / "hf", seed=3)
    assert main(["convert", str(checkpoint), str(tmp_path / "store"), "--experts-dtype", "fp32"]) == 0
    prompt = torch.randint(3, 250, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    plain, _ = moestream.load(tmp_path / "store", "1GiB")
    try:
        packed, _ = moestream.load(tmp_path / "store", "1GiB", kv_cache_dtype="int8")
    except UsageError as e:  # (or its attention keeps sdpa, and the option is refused with the reason)
        assert "8-bit KV cache" in str(e)
        return
    assert all(torch.equal(a, b) for a, b in zip(_decode(plain, prompt, 6), _decode(packed, prompt, 6)))
    cache = _prefilled(packed, prompt)
    assert not any(isinstance(layer, Int8Layer) for layer in cache.layers)

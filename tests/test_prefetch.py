"""Speculative prefetch changes what is read, never the numbers; auto turns off layers where it is wasted."""

import torch
from tiny import TINY

import moestream
from moestream.prefetch import AUTO_MIN_ISSUED, AUTO_PROBE_EVERY, Prefetcher
from moestream.store import Store
from moestream.synthetic import make_model, save_checkpoint, skew_router


def test_prefetch_changes_no_tokens_and_is_accounted(tmp_path):
    config = dict(TINY["qwen3_moe"], num_hidden_layers=4, num_experts=16, num_experts_per_tok=2)
    model = make_model("qwen3_moe", seed=17, **config)
    skew_router(model, 1.0)  # some locality, so that predictions and the cache have something to find
    ckpt = save_checkpoint(model, tmp_path / "hf")
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    stride = Store(store).manifest.max_record_stride
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(1))
    outputs, reports = {}, {}
    for mode in ("off", "on", "auto"):
        loaded, _ = moestream.load(store, 8 * stride, prefetch=mode)
        with torch.no_grad():
            outputs[mode] = loaded.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        reports[mode] = moestream.stats(loaded)
    assert torch.equal(outputs["off"], outputs["on"]) and torch.equal(outputs["off"], outputs["auto"])

    off, on = reports["off"], reports["on"]
    assert off["prefetch"]["issued"] == 0 and off["bytes_read"] == off["misses"] * stride
    p = on["prefetch"]
    assert p["issued"] > 0 and p["useful"] + p["wasted"] <= p["issued"]
    assert 0 < p["precision"] <= 1 and 0 < p["recall"] <= 1
    # Bytes read: every demand miss, plus the speculative reads that landed.
    assert on["misses"] * stride <= on["bytes_read"] <= (on["misses"] + p["issued"]) * stride


def test_auto_switches_a_wasteful_layer_off_and_probes_again():
    router = torch.nn.Linear(8, 4, bias=False)
    prefetcher = Prefetcher([router, router], top_k=1, mode="auto")
    assert prefetcher.enabled(1)
    for _ in range(AUTO_MIN_ISSUED):
        prefetcher.record_use(1, False)
    assert not prefetcher.enabled(1)
    assert prefetcher.predict(0, torch.randn(1, 8)) == []  # no speculation while off
    for _ in range(AUTO_PROBE_EVERY):
        prefetcher.observe(1, [0])
    assert prefetcher.enabled(1)
    for _ in range(AUTO_MIN_ISSUED):
        prefetcher.record_use(1, True)
    assert prefetcher.enabled(1)  # useful reads keep it on
    assert Prefetcher([router, router], 1, mode="on").enabled(1) and not Prefetcher([router, router], 1, mode="off").enabled(1)

"""Speculative prefetch changes what is read, never the numbers; auto keeps whichever mode decodes faster."""

import errno
import threading

import pytest
import torch
from tiny import TINY, tiny_checkpoint

import moestream
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint, skew_router
from moestream.core.engine import engine_of
from moestream.core.supply.cache import State
from moestream.core.supply.prefetch import (
    AUTO_HOLD_STEPS,
    AUTO_MARGIN,
    AUTO_PROBE_BLOCK,
    AUTO_PROBE_BLOCKS,
    AUTO_WARMUP_STEPS,
    Prefetcher,
)
from moestream.core.supply.reader import RecordFile


def _skewed_store(tmp_path, seed: int):
    """4 layers x 16 experts, top-2, routers skewed for some locality (so that predictions and the cache have
    something to find), as a store -> (store, bytes per record)."""
    config = dict(TINY["qwen3_moe"], num_hidden_layers=4, num_experts=16, num_experts_per_tok=2)
    model = make_model("qwen3_moe", seed=seed, **config)
    skew_router(model, 1.0)
    store = moestream.convert(save_checkpoint(model, tmp_path / "hf"), tmp_path / "store", experts_dtype="fp32", progress=False)
    return store, Store(store).manifest.max_record_stride


def test_prefetch_changes_no_tokens_and_is_accounted(tmp_path):
    store, stride = _skewed_store(tmp_path, seed=17)
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


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def run_decode_steps(prefetcher, clock, steps, seconds_on, seconds_off):
    """Drive the prefetcher through decode steps whose duration depends on whether it speculated."""
    modes = []
    for _ in range(steps):
        prefetcher.start_step(1)
        modes.append(prefetcher.speculating())
        clock.now += seconds_on if modes[-1] else seconds_off
    return modes


def test_auto_keeps_the_faster_mode_and_probes_again():
    router = torch.nn.Linear(8, 4, bias=False)
    clock = FakeClock()
    prefetcher = Prefetcher([router, router], top_k=1, mode="auto", clock=clock)
    probe = len(AUTO_PROBE_BLOCKS) * AUTO_PROBE_BLOCK
    assert not any(run_decode_steps(prefetcher, clock, AUTO_WARMUP_STEPS, seconds_on=0.030, seconds_off=0.020))
    modes = run_decode_steps(prefetcher, clock, probe, seconds_on=0.030, seconds_off=0.020)
    assert modes.count(True) == modes.count(False) == probe // 2  # the probe tries both
    modes = run_decode_steps(prefetcher, clock, AUTO_HOLD_STEPS, seconds_on=0.030, seconds_off=0.020)
    assert not any(modes)  # off was faster: held off
    assert prefetcher.predict(0, torch.randn(1, 8)) == []  # and no speculation while off
    assert prefetcher.report()["auto_last_probe_ms"] == pytest.approx({"on": 30.0, "off": 20.0})
    # The workload changes (say the cache got smaller): the next probe finds on faster and keeps it.
    modes = run_decode_steps(prefetcher, clock, probe + AUTO_HOLD_STEPS, seconds_on=0.010, seconds_off=0.050)
    assert modes[:probe].count(True) == probe // 2 and all(modes[probe + 1 :])
    assert prefetcher.predict(0, torch.randn(1, 8)) != []
    # On wins by less than the margin: off, which reads fewer bytes, is kept.
    slightly_faster = 0.050 * (1 - AUTO_MARGIN / 2)
    modes = run_decode_steps(prefetcher, clock, probe + AUTO_HOLD_STEPS, seconds_on=slightly_faster, seconds_off=0.050)
    assert not any(modes[probe + 1 :])
    assert prefetcher.report()["auto_probes"] == 3


def test_auto_never_times_a_prompt_or_the_idle_time_after_it():
    router = torch.nn.Linear(8, 4, bias=False)
    clock = FakeClock()
    prefetcher = Prefetcher([router, router], top_k=1, mode="auto", clock=clock)
    for step in range(AUTO_WARMUP_STEPS + len(AUTO_PROBE_BLOCKS) * AUTO_PROBE_BLOCK + 1):
        prefetcher.start_step(1)
        clock.now += 0.010 if prefetcher.speculating() else 0.020
        if step % 3 == 2:  # a request ends here; the next one's prompt and the wait before it take long
            clock.now += 100.0
            prefetcher.start_step(512)
            clock.now += 10.0
    assert prefetcher.report()["auto_last_probe_ms"] == pytest.approx({"on": 10.0, "off": 20.0})
    assert prefetcher.speculating()


def test_fixed_modes():
    router = torch.nn.Linear(8, 4, bias=False)
    assert Prefetcher([router, router], 1, mode="on").speculating()
    assert not Prefetcher([router, router], 1, mode="off").speculating()


def test_hash_routed_layers_are_read_exactly_before_they_run(tmp_path):
    _, ckpt = tiny_checkpoint("deepseek_v4", tmp_path / "hf", seed=5)  # its first MoE layer routes by token id
    store = moestream.convert(ckpt, tmp_path / "store", experts_dtype="fp32", progress=False)
    stride = Store(store).manifest.max_record_stride
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(4))
    outputs, layer0 = {}, {}
    for mode in ("off", "on"):
        model, _ = moestream.load(store, 4 * stride, prefetch=mode)  # 4 of 24 experts: most decode reads miss
        with torch.no_grad():
            model(prompt)  # the prompt alone: its misses, to tell decode's apart
            prompt_misses = moestream.stats(model)["layers"][0]["misses"]
            model, _ = moestream.load(store, 4 * stride, prefetch=mode)
            outputs[mode] = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        s = moestream.stats(model)
        layer0[mode] = (s["layers"][0]["misses"] - prompt_misses, s["prefetch"]["per_layer"][0])
    assert torch.equal(outputs["off"], outputs["on"])
    decode_misses, books = layer0["on"]
    assert decode_misses == 0  # every decode step found the hash layer's experts read or in flight
    assert books["precision"] == books["recall"] == 1.0 and books["issued"] > 0
    assert layer0["off"][0] > 0  # without it the same steps miss


def test_a_failed_speculative_read_never_fails_a_token(tmp_path, monkeypatch):
    store, stride = _skewed_store(tmp_path, seed=17)
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(1))
    loaded, _ = moestream.load(store, 8 * stride, prefetch="off")
    with torch.no_grad():
        expected = loaded.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    real = RecordFile.read_at

    def failing_ahead(self, buffer, offset):  # every read on the speculative thread fails, demand reads work
        if threading.current_thread().name.startswith("moestream-prefetch"):
            raise OSError(errno.EIO, "Input/output error")
        return real(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", failing_ahead)
    monkeypatch.setattr("moestream.core.supply.reader.RETRY_BACKOFF_SECONDS", 0.0)
    loaded, _ = moestream.load(store, 8 * stride, prefetch="on")
    with torch.no_grad():
        got = loaded.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert torch.equal(got, expected)
    assert moestream.stats(loaded)["prefetch"]["issued"] > 0  # speculative reads were tried (and failed)
    cache = engine_of(loaded).supply.cache  # none of the failed guesses left a slot pinned or a ready one empty
    assert all(e.pins == 0 for e in cache.entries())
    assert all(e.tensors for e in cache.entries() if e.state is State.READY)


def test_read_ahead_never_evicts_an_expert_the_current_call_needs(tmp_path):
    store, stride = _skewed_store(tmp_path, seed=5)
    loaded, _ = moestream.load(store, 5 * stride, prefetch="on")  # tight: reads ahead must evict
    supply = engine_of(loaded).supply
    state, evicted, violations = {"needed": set(), "ahead": False}, [], []
    provide, read_ahead, on_evict = supply.provide, supply._read_ahead, supply.cache.on_evict

    def watched_provide(layer, experts, hidden, compute):
        state["needed"] = {(layer, e) for e in experts}
        return provide(layer, experts, hidden, compute)

    def watched_read_ahead(layer, experts, exact=False):
        state["ahead"] = True
        try:
            return read_ahead(layer, experts, exact)
        finally:
            state["ahead"] = False

    def watched_evict(entry):
        if state["ahead"]:
            evicted.append(entry.key)
            if entry.key in state["needed"]:
                violations.append(entry.key)
        if on_evict is not None:
            on_evict(entry)

    supply.provide, supply._read_ahead, supply.cache.on_evict = watched_provide, watched_read_ahead, watched_evict
    prompt = torch.randint(0, 250, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loaded.generate(prompt, max_new_tokens=24, min_new_tokens=24, do_sample=False)
    assert evicted  # reads ahead did take slots from cached experts
    assert not violations

"""Damaged stores and failing disks: every problem is found, named and never computed with.

Faults are injected in two places only: the bytes of a copied store (flips, truncation) and
`RecordFile.read_at`, the one call through which the reader touches the disk (short reads, EIO, stalls).
"""

import errno
import json
import os
import random
import shutil
import threading
import time

import pytest
import torch
from tiny import TINY

import moestream
from moestream.cli import main
from moestream.conversion.skeleton import experts_modules
from moestream.conversion.store import Store
from moestream.conversion.synthetic import make_model, save_checkpoint
from moestream.conversion.verify import verify_store
from moestream.core.compute.plan import experts_plans
from moestream.core.engine import ExpertEngine
from moestream.core.supply.cache import State
from moestream.core.supply.expert_supply import ExpertSupply
from moestream.core.supply.reader import RecordFile
from moestream.errors import ExpertReadError, ReadsInterrupted, RecordChecksumError, StoreError

EXPERTS, TOP_K = 32, 2


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """2 layers x 32 experts: 64 records, enough to damage 50 distinct ones."""
    root = tmp_path_factory.mktemp("integrity")
    config = dict(TINY["qwen3_moe"], num_experts=EXPERTS, num_experts_per_tok=TOP_K)
    ckpt = save_checkpoint(make_model("qwen3_moe", seed=11, **config), root / "hf")
    return moestream.convert(ckpt, root / "store", progress=False)


@pytest.fixture
def store(pristine, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(pristine, copy)
    return copy


@pytest.fixture(scope="module")
def model(pristine):
    model, _ = moestream.load(pristine, "64MiB")
    return model


def _records(store):
    return [(layer.index, e) for layer in Store(store).manifest.layers for e in range(layer.num_experts)]


def _flip_bit(store, layer_index, expert, rng):
    """Flip one random bit of one random payload byte of a record (padding is not covered by checksums)."""
    layer = Store(store).manifest.layers[layer_index]
    position = layer.offsets[expert] + rng.randrange(layer.layout.nbytes)
    with open(store / layer.file, "r+b") as f:
        f.seek(position)
        byte = f.read(1)[0]
        f.seek(position)
        f.write(bytes([byte ^ (1 << rng.randrange(8))]))


def _run_expert(engine, model, layer, expert, alone=False, seed=0):
    """Route 3 random tokens of `layer` to `expert` (and, unless alone, the next expert) through the engine."""
    module = experts_modules(model)[layer][1]
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(3, model.config.hidden_size, generator=g)
    index = torch.tensor([[expert] if alone else [expert, (expert + 1) % EXPERTS]] * 3)
    weights = torch.rand(*index.shape, generator=g)
    return engine.run(module, layer, hidden, index, weights)


def _engine(store, verify="first", budget=64 * 2**20, **supply_options):
    """An engine over the store with the CPU's kernels, floats computed as stored (no preparers)."""
    opened = Store(store)
    supply = ExpertSupply(opened, budget, io_threads=2, verify=verify, **supply_options)
    return ExpertEngine(opened, supply, experts_plans(opened.manifest.layers, cpu_kernels=True, int8_activations=False))


def _assert_cache_consistent(engine):
    """Every cached entry is fully loaded and unpinned; every slot is cached, free, or parked behind a
    read that is still running: none is lost and none is handed out twice."""
    cache = engine.supply.cache
    assert all(e.tensors and e.state is State.READY and e.read is None and e.pins == 0 for e in cache.entries())
    slots = [e.slot for e in cache.entries()] + cache.free_slots() + [e.slot for e in cache.parked]
    assert sorted(slots) == list(range(cache.capacity))


def test_fifty_flipped_records_are_found_by_verify_and_at_run_time(pristine, store, model):
    rng = random.Random(20261130)
    damaged = rng.sample(_records(store), 50)
    for layer, e in damaged:
        _flip_bit(store, layer, e, rng)

    report = verify_store(store, progress=False)
    assert not report.ok and report.records_checked == report.records_total == 2 * EXPERTS
    assert sorted((p.layer, p.expert) for p in report.problems) == sorted(damaged)
    layers = Store(store).manifest.layers
    for p in report.problems:
        assert "checksum" in p.message and p.file == layers[p.layer].file
        assert p.offset == layers[p.layer].offsets[p.expert]

    engine, reference = _engine(store), _engine(pristine)
    try:
        for layer, e in damaged:
            with pytest.raises(RecordChecksumError, match=rf"layer {layer} \(.*\), expert {e}: .*checksum"):
                _run_expert(engine, model, layer, e, alone=True)
            assert engine.supply.cache.lookup((layer, e)) is None  # damaged bytes never stay cached
            _assert_cache_consistent(engine)
        # The engine keeps working for records that are intact, with the right numbers.
        layer, e = next((i, e) for i, e in _records(store) if (i, e) not in damaged and (i, (e + 1) % EXPERTS) not in damaged)
        assert torch.equal(_run_expert(engine, model, layer, e), _run_expert(reference, model, layer, e))
    finally:
        engine.close()
        reference.close()


def test_verify_always_catches_damage_after_the_first_read(store, model):
    engine = _engine(store, verify="always", budget=Store(store).manifest.max_record_stride * TOP_K)
    try:
        _run_expert(engine, model, 0, 5)  # read and verified once, then pushed out by the next call
        _run_expert(engine, model, 0, 9)
        _flip_bit(store, 0, 5, random.Random(1))
        with pytest.raises(RecordChecksumError, match=r"layer 0 .*expert 5"):
            _run_expert(engine, model, 0, 5)
        _assert_cache_consistent(engine)
    finally:
        engine.close()


def test_verify_cli_lists_problems_and_exits_nonzero(store, capsys):
    assert main(["verify", str(store)]) == 0
    assert "OK" in capsys.readouterr().out
    _flip_bit(store, 1, 3, random.Random(2))
    resident = next(store.glob("resident-*.safetensors"))
    data = bytearray(resident.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's bytes: only the file checksum can see it
    resident.write_bytes(bytes(data))
    assert main(["verify", str(store), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    found = {(p["file"], p.get("layer"), p.get("expert")) for p in report["problems"]}
    assert found == {("experts/layer-001.bin", 1, 3), (resident.name, None, None)}
    open_files = len(os.listdir("/proc/self/fd"))
    with pytest.raises(StoreError, match=f"resident file {resident.name} does not match its checksum"):
        moestream.load(store, "1MiB")
    assert len(os.listdir("/proc/self/fd")) == open_files  # the refused load closed the store's files


def test_verify_quick_checks_a_sample_and_headers(store):
    report = verify_store(store, quick=True, progress=False)
    assert report.ok and report.records_checked == 2 * 8 and report.records_total == 2 * EXPERTS
    _flip_bit(store, 0, EXPERTS - 1, random.Random(3))  # the last record of a layer is always sampled
    assert [(p.layer, p.expert) for p in verify_store(store, quick=True, progress=False).problems] == [(0, EXPERTS - 1)]


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_every_file_truncated_or_removed_is_refused_and_reported(pristine, tmp_path, damage):
    files = [p.relative_to(pristine) for p in pristine.rglob("*") if p.suffix in (".bin", ".safetensors")]
    assert len(files) >= 3
    for rel in files:
        copy = tmp_path / f"{damage}-{rel.name}"
        shutil.copytree(pristine, copy)
        if damage == "truncate":
            with open(copy / rel, "r+b") as f:
                f.truncate((copy / rel).stat().st_size - 1)
        else:
            (copy / rel).unlink()
        expected = "truncated" if damage == "truncate" else "missing"
        with pytest.raises(StoreError, match=rf"{rel}.*{expected}"):
            moestream.load(copy, "1MiB")
        problems = verify_store(copy, progress=False).problems
        assert problems and problems[0].file == str(rel) and expected in problems[0].message


def test_verify_reports_an_unreadable_manifest(store):
    (store / "manifest.json").write_text('{"format": "moestream-store", "format_version": 1')
    report = verify_store(store, progress=False)
    assert [p.file for p in report.problems] == ["manifest.json"] and "not valid JSON" in report.problems[0].message


# -- faults of the disk, injected at RecordFile.read_at ----------------------------------------------------


def test_short_reads_are_completed(pristine, model, monkeypatch):
    expected = _run_expert(_engine(pristine), model, 1, 4)
    real = RecordFile.read_at
    calls = []

    def short(self, buffer, offset):
        calls.append(offset)
        return real(self, buffer[:1000], offset)  # never more than 1000 bytes per call

    monkeypatch.setattr(RecordFile, "read_at", short)
    engine = _engine(pristine, direct_io=False)  # buffered: O_DIRECT would refuse the unaligned tail
    assert torch.equal(_run_expert(engine, model, 1, 4), expected)
    assert len(calls) > 2 * 4  # each record took several calls
    engine.close()


def test_transient_eio_is_retried(pristine, model, monkeypatch):
    expected = _run_expert(_engine(pristine), model, 0, 7)
    real = RecordFile.read_at
    failures = {}

    def flaky(self, buffer, offset):
        failures[offset] = failures.get(offset, 0) + 1
        if failures[offset] <= 2:  # the first two attempts at every offset fail
            raise OSError(errno.EIO, "Input/output error")
        return real(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", flaky)
    engine = _engine(pristine)
    assert torch.equal(_run_expert(engine, model, 0, 7), expected)
    _assert_cache_consistent(engine)
    engine.close()


def test_persistent_eio_is_raised_with_file_and_offset_and_leaves_the_cache_consistent(pristine, model, monkeypatch):
    reference = _engine(pristine)
    expected = _run_expert(reference, model, 0, 12)
    bad_offset = Store(pristine).manifest.layers[0].offsets[12]
    real = RecordFile.read_at

    def broken(self, buffer, offset):
        if offset == bad_offset and self.path.name == "layer-000.bin":
            raise OSError(errno.EIO, "Input/output error")
        return real(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", broken)
    engine = _engine(pristine)
    start = time.perf_counter()
    with pytest.raises(ExpertReadError, match=rf"layer 0 .*expert 12: .*offset {bad_offset} of .*layer-000.bin failed 4 times"):
        _run_expert(engine, model, 0, 12)
    assert time.perf_counter() - start < 5  # bounded: 3 retries with a short backoff
    assert engine.supply.cache.lookup((0, 12)) is None
    _assert_cache_consistent(engine)
    monkeypatch.setattr(RecordFile, "read_at", real)  # the disk recovers: the same call now succeeds
    assert torch.equal(_run_expert(engine, model, 0, 12), expected)
    engine.close()
    reference.close()


def test_a_stalled_read_times_out_and_its_slot_is_not_reused_until_it_ends(pristine, model, monkeypatch):
    expected = _run_expert(_engine(pristine), model, 1, 20)
    release = threading.Event()
    real = RecordFile.read_at

    def stalled(self, buffer, offset):
        release.wait(30)  # a disk that does not answer
        return real(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", stalled)
    engine = _engine(pristine, read_timeout=0.5)
    start = time.perf_counter()
    with pytest.raises(ExpertReadError, match=r"no read of layer 1's experts \[20, 21\] finished within 0.5 s"):
        _run_expert(engine, model, 1, 20)
    assert time.perf_counter() - start < 5
    assert len(engine.supply.cache.parked) == 2  # their slots are parked, not free: the reads may still write into them
    _assert_cache_consistent(engine)
    monkeypatch.setattr(RecordFile, "read_at", real)
    release.set()
    for entry in engine.supply.cache.parked:
        entry.read.result(timeout=30)  # the disk answers again: the abandoned reads end
    engine.supply.read_timeout = 60  # a loaded CI machine must not time out the healthy reads that follow
    assert torch.equal(_run_expert(engine, model, 1, 20), expected)
    assert not engine.supply.cache.parked  # reclaimed once the reads ended
    _assert_cache_consistent(engine)
    engine.close()


def test_slots_held_by_stalled_reads_are_waited_for_not_reported_as_a_small_budget(pristine, model, monkeypatch):
    """A cache of two slots, both parked behind reads that stalled past the timeout: the next call waits for
    one of them to end (as for a read of its own) instead of failing with "no free slot; raise --memory", and
    computes the same result; an interrupted wait ends at once."""
    expected = _run_expert(_engine(pristine), model, 1, 20)
    release = threading.Event()
    real = RecordFile.read_at

    def stalled(self, buffer, offset):
        release.wait(30)
        return real(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", stalled)
    slot = Store(pristine).manifest.layers[1].layout.stride
    engine = _engine(pristine, budget=2 * slot, read_timeout=0.5)
    with pytest.raises(ExpertReadError, match="finished within 0.5 s"):
        _run_expert(engine, model, 1, 20)
    assert len(engine.supply.cache.parked) == 2 and not engine.supply.cache.free_slots()
    engine.supply.interrupt_waits()
    with pytest.raises(ReadsInterrupted):  # a stopping server does not wait for them
        _run_expert(engine, model, 1, 20)
    engine.supply.interrupt_waits(False)
    monkeypatch.setattr(RecordFile, "read_at", real)
    engine.supply.read_timeout = 60
    threading.Timer(0.5, release.set).start()  # the disk answers again half a second into the wait
    assert torch.equal(_run_expert(engine, model, 1, 20), expected)
    _assert_cache_consistent(engine)
    engine.close()


def test_an_interrupted_model_ends_its_step_at_the_next_layer_even_when_nothing_is_read(pristine, model):
    """A stopping server's long prefill step must not run to its end: with every expert a cache hit (no wait
    for the disk), an interrupted engine still raises at the next MoE layer, holds no slot afterwards, and
    computes the same result once it may run again."""
    engine = _engine(pristine)
    expected = _run_expert(engine, model, 1, 20)  # now cached: the next call reads nothing
    engine.supply.interrupt_waits()
    with pytest.raises(ReadsInterrupted, match="stopping"):
        _run_expert(engine, model, 1, 20)
    _assert_cache_consistent(engine)
    engine.supply.interrupt_waits(False)
    assert torch.equal(_run_expert(engine, model, 1, 20), expected)
    engine.close()

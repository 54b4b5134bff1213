"""`moestream bench`: the floor and efficiency are computed from the run's own measurements."""

import json

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.conversion.store import Store
from moestream.errors import UsageError
from moestream.tools.bench import bench, replay_reads, run_moestream


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=9)
    return moestream.convert(ckpt, root / "store", progress=False)


def test_report_is_consistent_with_its_own_measurements(store):
    manifest = Store(store).manifest
    budget = manifest.max_record_stride * 4  # well below the 16 records: decode must read
    report = bench(store, budget, prompt_tokens=8, new_tokens=6)
    run = report.moestream
    assert report.disk_bandwidth_bytes_per_second > 0
    assert run.new_tokens == 6 and run.decode_tokens_per_second > 0 and 0 <= run.hit_rate < 1
    assert run.decode_bytes_read > 0 and run.decode_bytes_read % manifest.max_record_stride == 0
    assert report.bytes_missed_per_token == pytest.approx(run.decode_bytes_read / 5)
    assert report.all_hits_measured  # a tiny store fits in memory, so all-hits compute is measured
    floor = report.bytes_missed_per_token / report.disk_bandwidth_bytes_per_second + report.all_hits_seconds_per_token
    assert report.floor_seconds_per_token == pytest.approx(floor)
    assert report.efficiency == pytest.approx(floor * run.decode_tokens_per_second)
    reading = report.bytes_missed_per_token / report.disk_bandwidth_bytes_per_second
    assert report.overlapped_floor_seconds_per_token == pytest.approx(max(reading, report.all_hits_seconds_per_token))
    assert report.overlapped_efficiency == pytest.approx(report.overlapped_floor_seconds_per_token * run.decode_tokens_per_second)
    assert not report.teacher_forced and "greedy after random prompt ids" in report.table()


TEXT = "The quick brown fox jumps over the lazy dog, and then it keeps running through the field. " * 2


def test_text_decode_is_teacher_forced_on_the_texts_tokens(store, monkeypatch):
    from moestream.core.loading import load_tokenizer
    from moestream.tools import bench as bench_module

    text_ids = load_tokenizer(store)(TEXT, add_special_tokens=False)["input_ids"]
    fed = []
    real_timed = bench_module.timed

    def recording_timed(model, ids, new_tokens, **options):
        result = real_timed(model, ids, new_tokens, **options)
        fed.append((ids[0].tolist(), result.token_ids))
        return result

    monkeypatch.setattr(bench_module, "timed", recording_timed)
    report = bench(store, Store(store).manifest.max_record_stride * 4, prompt_tokens=8, new_tokens=6, text=TEXT)
    assert report.teacher_forced and "teacher-forced through --text" in report.table()
    assert fed and all(run == (text_ids[:8], text_ids[8:14]) for run in fed)  # the measured run and the all-hits one
    with pytest.raises(UsageError, match="--text has only"):
        bench(store, "1MiB", prompt_tokens=8, new_tokens=len(text_ids), text=TEXT)


def test_all_hits_compute_is_measured_on_steps_that_hit_everything_when_experts_do_not_fit(store, monkeypatch):
    from moestream.tools import bench as bench_module

    monkeypatch.setattr(bench_module, "_memory_available", lambda: 1)  # as if the experts were twice the RAM
    stride = Store(store).manifest.max_record_stride
    roomy = bench(store, stride * 64, prompt_tokens=8, new_tokens=4, text=TEXT)  # the probe's experts all fit
    assert roomy.all_hits_measured and "steps that hit every expert" in roomy.all_hits_how
    assert 0 < roomy.all_hits_seconds_per_token < 1
    tight = bench(store, stride * 2, prompt_tokens=8, new_tokens=4, text=TEXT)  # two records: every step misses
    assert not tight.all_hits_measured and tight.all_hits_how.startswith("estimated")


def test_bandwidth_is_timed_on_the_runs_own_decode_reads(store):
    opened = Store(store)
    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(3))
    run, reads = run_moestream(store, opened.manifest.max_record_stride * 4, ids, 5, "moestream")
    assert reads and sum(length for _, _, length in reads) == run.decode_bytes_read
    files = {layer.file for layer in opened.manifest.layers}
    for file_index, offset, length in reads:  # each is one of the store's records
        layer = opened.manifest.layers[file_index]
        assert layer.file in files and offset in layer.offsets and length == layer.layout.stride
    assert replay_reads(opened, reads, threads=2) > 1e6
    assert replay_reads(opened, []) == 0.0


def test_cli_writes_json(store, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(store), "--memory", "64KiB", "--prompt-tokens", "4", "--new-tokens", "3", "--json", str(out)]) == 0
    assert "efficiency" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["moestream"]["new_tokens"] == 3 and data["efficiency"] > 0


def test_a_peer_that_cannot_run_is_reported_not_fatal(store, tmp_path):
    missing = tmp_path / "absent.gguf"  # no such file (and llama-cpp-python may not be installed either)
    report = bench(store, Store(store).manifest.max_record_stride * 4, prompt_tokens=4, new_tokens=3, compare_gguf=str(missing))
    (peer,) = report.peers
    assert peer.name == "llama.cpp (GGUF, mmap)" and peer.decode_tokens_per_second == 0
    assert peer.note.startswith("did not run:")
    assert "llama.cpp (GGUF, mmap)" in report.table() and report.moestream.decode_tokens_per_second > 0


def test_the_decodes_read_ahead_is_reported(store):
    from moestream.tools.bench import _read_ahead_line

    ids = torch.randint(0, 200, (1, 8), generator=torch.Generator().manual_seed(5))
    budget = Store(store).manifest.max_record_stride * 4
    run, _ = run_moestream(store, budget, ids, 8, "moestream", prefetch="on")
    ahead = run.read_ahead
    assert ahead["mode"] == "on" and ahead["speculating"] and ahead["issued"] > 0
    assert ahead["useful"] + ahead["wasted"] <= ahead["issued"] and 0 <= ahead["precision"] <= 1
    assert _read_ahead_line(ahead).startswith("read-ahead (--prefetch on, on at the end): in the decode")
    off, _ = run_moestream(store, budget, ids, 8, "moestream", prefetch="off")
    assert off.read_ahead["issued"] == 0 and _read_ahead_line(off.read_ahead) == "read-ahead: off"

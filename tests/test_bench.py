"""`moestream bench`: the floor and efficiency are computed from the run's own measurements."""

import json

import pytest
from tiny import tiny_checkpoint

import moestream
from moestream.bench import bench, measure_disk_bandwidth
from moestream.cli import main
from moestream.store import Store


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


def test_bandwidth_probe_reads_real_records(store):
    assert measure_disk_bandwidth(Store(store), threads=2, budget_bytes=2**20) > 1e6


def test_cli_writes_json(store, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", str(store), "--memory", "64KiB", "--prompt-tokens", "4", "--new-tokens", "3", "--json", str(out)]) == 0
    assert "efficiency" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["moestream"]["new_tokens"] == 3 and data["efficiency"] > 0

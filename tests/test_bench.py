"""`moestream bench`: the floor and efficiency are computed from the run's own measurements."""

import json
import os

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.conversion.store import Store
from moestream.errors import UsageError
from moestream.tools.bench import bench, per_step_floor, replay_reads, run_moestream


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
    # Per decode step: its reads (5 steps after the first token) add up to the decode's, at a rate measured
    # while reads were in flight, and the floor averages each step's larger part.
    steps = run.decode_step_bytes
    assert len(steps) == 5 and sum(steps) >= run.decode_bytes_read > 0
    assert 0 < run.decode_read_busy_seconds < 5 / run.decode_tokens_per_second
    assert report.read_busy_bytes_per_second == pytest.approx(sum(steps) / run.decode_read_busy_seconds)
    expected = sum(max(report.all_hits_seconds_per_token, b / report.read_busy_bytes_per_second) for b in steps) / 5
    assert report.per_step_floor_seconds_per_token == pytest.approx(expected)
    assert report.per_step_efficiency == pytest.approx(expected * run.decode_tokens_per_second)
    assert "per decode step, its own reads hidden behind compute" in report.table()
    # The prefill: prompt tokens over the time to the first token, its matmul work per second held against
    # the CPU's int8 peak; the weights a token meets counted here from the config by hand.
    c = manifest.model_config
    attention = c["hidden_size"] * c["head_dim"] * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    router = c["hidden_size"] * c["num_local_experts"]
    experts = c["num_experts_per_tok"] * 3 * c["hidden_size"] * c["moe_intermediate_size"]
    assert not c.get("mlp_only_layers") and c.get("decoder_sparse_step", 1) == 1  # every layer is MoE
    assert run.matmul_weights_per_token == c["num_hidden_layers"] * (attention + router + experts)
    assert run.prefill_tokens_per_second == pytest.approx(8 / run.ttft_seconds)
    assert report.int8_peak_ops_per_second > 0
    share = 2 * run.matmul_weights_per_token * run.prefill_tokens_per_second / report.int8_peak_ops_per_second
    assert report.prefill_share_of_int8_peak == pytest.approx(share)
    assert f"{share:.1%} of this CPU's int8 peak" in report.table()


def test_per_step_floor_keeps_each_steps_reads_in_its_step():
    # Two steps of 10 ms compute: one reads nothing, one reads 30 ms worth. Averaged over the steps the reads
    # (15 ms) would hide behind compute; per step the second is bound by its reads.
    assert per_step_floor([0, 3_000_000], 0.010, 1e8) == pytest.approx((0.010 + 0.030) / 2)
    assert per_step_floor([], 0.010, 1e8) == 0.010
    assert per_step_floor([1_000_000], 0.010, 0.0) == 0.010  # nothing read: compute alone


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


def test_reader_busy_time_counts_overlapping_reads_once(tmp_path, monkeypatch):
    import mmap
    import time

    from moestream.core.supply.reader import RecordFile, RecordReader

    path = tmp_path / "records.bin"
    path.write_bytes(os.urandom(1 << 16))
    real_read_at = RecordFile.read_at

    def slow_read_at(self, buffer, offset):
        time.sleep(0.05)
        return real_read_at(self, buffer, offset)

    monkeypatch.setattr(RecordFile, "read_at", slow_read_at)
    reader = RecordReader([path], threads=2, direct=False)
    buffers = [memoryview(mmap.mmap(-1, 4096)) for _ in range(2)]
    try:
        together = [reader.submit(0, 4096 * i, 4096, buffers[i]) for i in range(2)]  # in flight at once
        for future in together:
            future.result()
        overlapped = reader.busy_seconds()
        assert 0.05 <= overlapped < 0.09
        time.sleep(0.1)  # idle: not busy
        reader.submit(0, 0, 4096, buffers[0]).result()
        assert overlapped + 0.05 <= reader.busy_seconds() < overlapped + 0.09  # the sleep between is not counted
        assert bytes(buffers[0]) == path.read_bytes()[:4096]
    finally:
        reader.close()


def test_kernels_are_timed_per_distinct_matrix_against_memory_bandwidth(store, tmp_path, capsys):
    from moestream.core.kernel_timing import time_kernels

    report = time_kernels(store, rotation_bytes=8 << 20)
    layer = Store(store).manifest.layers[0]
    # The tiny store's float records: gate_up [2I, H] and down [H, I], the same in every layer, one kernel each.
    shapes = sorted(tuple(t.shape) for t in layer.layout.tensors if len(t.shape) == 2)
    assert sorted(k.shape for k in report.kernels) == shapes
    assert {k.kernel for k in report.kernels} == {"float matmul"}
    assert report.memory_gb_per_second > 0
    for k in report.kernels:
        assert k.weight_bytes == k.shape[0] * k.shape[1] * 4 or k.weight_bytes == k.shape[0] * k.shape[1] * 2
        assert k.microseconds > 0 and k.gb_per_second == pytest.approx(k.weight_bytes / k.microseconds / 1e3)
        assert k.share_of_memory == pytest.approx(k.gb_per_second / report.memory_gb_per_second)
    out = tmp_path / "kernels.json"
    assert main(["bench", str(store), "--kernels", "--json", str(out)]) == 0
    assert "memory bandwidth" in capsys.readouterr().out
    assert len(json.loads(out.read_text())["kernels"]) == len(shapes)

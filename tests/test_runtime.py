"""core.runtime: what the server, generation and tools see of a loaded model (statistics, read and routing recording)."""

import pytest
import torch
from tiny import tiny_checkpoint

import moestream
from moestream.conversion.store import Store
from moestream.core.runtime import runtime_of
from moestream.errors import UsageError
from moestream.generation.serving import timed


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=5)
    return moestream.convert(ckpt, root / "store", progress=False)


def test_read_recording_splits_the_reads_by_forward_pass_and_stops(store):
    stride = Store(store).manifest.max_record_stride
    model, _ = moestream.load(store, stride * 4)  # 4 slots for 16 records: every pass reads
    runtime = runtime_of(model)
    try:
        ids = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(3))
        recording = runtime.record_reads()
        timed(model, ids, 4)  # a prompt pass and 3 decode passes
        recording.stop()
        steps = recording.step_bytes()
        assert len(steps) == 4 and all(b > 0 for b in steps)
        assert sum(steps) == sum(length for _, _, length in recording.reads) == stride * len(recording.reads)
        assert recording.busy_seconds > 0
        assert runtime.stats()["bytes_read"] >= sum(steps)  # the same reads, booked by the cache's statistics
        kept = len(recording.reads)
        timed(model, ids, 2)
        assert len(recording.reads) == kept and len(recording.step_bytes()) == 4  # stopped: nothing added
    finally:
        runtime.close()


def test_routing_observer_hears_every_experts_call_and_only_one_at_a_time(store):
    model, _ = moestream.load(store, "64MiB")
    runtime = runtime_of(model)
    calls, steps = [], []

    class Observer:
        def start_step(self, token_ids):
            steps.append(list(token_ids))

        def record(self, layer, top_k_index, top_k_weights):
            calls.append((layer, top_k_index.shape))

    try:
        runtime.observe_routing(Observer())
        with pytest.raises(RuntimeError, match="already being observed"):
            runtime.observe_routing(Observer())
        ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
        timed(model, ids, 2)
        layers = Store(store).manifest.layers
        assert steps[0] == ids[0].tolist() and len(steps) == 2
        assert [layer for layer, _ in calls] == list(range(len(layers))) * 2
        runtime.observe_routing(None)
        timed(model, ids, 2)
        assert len(steps) == 2  # no longer observed
    finally:
        runtime.close()


def test_a_model_not_loaded_by_moestream_has_no_runtime():
    with pytest.raises(UsageError, match="not loaded with moestream.load"):
        runtime_of(torch.nn.Linear(2, 2))

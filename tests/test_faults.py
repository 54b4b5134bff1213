"""Injected disk faults (MOESTREAM_FAULTS, reader.Faults): each kind does what a failing disk does at the one
call that reads, the reader's promise holds under it (short reads completed, errors retried then raised, a
flipped byte caught by the checksum), and a server under faults answers every request with its own answer or
a clear disk error, never a wrong token, and goes on serving."""

import os

import pytest
from test_server import MODEL, Server, store  # noqa: F401 (fixture)

from moestream.conversion.store import checksum
from moestream.core.supply.reader import FAULTS_ENV, Faults, RecordReader
from moestream.errors import ExpertReadError, RecordChecksumError

SIZE = 64 * 1024


@pytest.fixture
def record(tmp_path):
    path = tmp_path / "records.bin"
    data = os.urandom(4 * SIZE)
    path.write_bytes(data)
    return path, data


def _read(path, faults, offset=SIZE, expected=None):
    reader = RecordReader([path], threads=1, direct=False, faults=faults)
    buffer = memoryview(bytearray(SIZE))
    try:
        reader.submit(0, offset, SIZE, buffer, expected=expected).result(timeout=30)
    finally:
        reader.close()
    return bytes(buffer)


def test_faults_are_read_from_the_environment_and_unknown_ones_named(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "read_error:0.01,short_read:0.005,stall:0.001,flip:0.002,stall_seconds:2,seed:7")
    faults = Faults.from_env()
    assert (faults.read_error, faults.short_read, faults.stall, faults.flip) == (0.01, 0.005, 0.001, 0.002)
    assert faults.stall_seconds == 2 and faults.seed == 7
    monkeypatch.setenv(FAULTS_ENV, "bit_rot:0.1")
    with pytest.raises(ValueError, match="unknown fault 'bit_rot'"):
        Faults.from_env()
    monkeypatch.delenv(FAULTS_ENV)
    assert Faults.from_env() is None


def test_each_kind_of_fault_meets_the_readers_promise(record):
    path, data = record
    whole = data[SIZE : 2 * SIZE]
    expected = (SIZE, checksum(memoryview(whole)))
    # short reads: completed; a stall: only slower; the bytes are the file's
    short = Faults(short_read=1.0)
    assert _read(path, short, expected=expected) == whole and short.injected["short_read"] > 1
    assert _read(path, Faults(stall=1.0, stall_seconds=0.05), expected=expected) == whole
    # errors: retried, then raised naming the file
    failing = Faults(read_error=1.0)
    with pytest.raises(ExpertReadError, match="failed 4 times .*injected read error"):
        _read(path, failing)
    assert failing.injected["read_error"] == 4
    # a flipped byte: the checksum finds it (the read is tried twice, both flipped here)
    with pytest.raises(RecordChecksumError, match="the store is damaged"):
        _read(path, Faults(flip=1.0), expected=expected)
    # half the reads fail: every read still returns the file's bytes or raises, never other bytes
    flaky = Faults(read_error=0.5, short_read=0.3, flip=0.1, seed=3)
    for offset in (0, SIZE, 2 * SIZE, 3 * SIZE) * 5:
        truth = data[offset : offset + SIZE]
        try:
            assert _read(path, flaky, offset, (SIZE, checksum(memoryview(truth)))) == truth
        except ExpertReadError:
            pass
    assert all(flaky.injected[k] for k in ("read_error", "short_read", "flip"))


def test_a_server_under_faults_gives_each_request_its_answer_or_a_disk_error(store, tmp_path, monkeypatch):  # noqa: F811
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(10)]

    def ask(server, prompt):
        body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}
        return server.http.post("/v1/chat/completions", json=body)

    extra = ("--memory", "16KiB", "--verify", "always", "--kv-memory", "0")
    clean = Server(store, tmp_path / "clean.log", *extra)
    try:
        expected = [ask(clean, p).json()["choices"][0]["message"]["content"] for p in prompts]
    finally:
        clean.stop()
    monkeypatch.setenv(FAULTS_ENV, "read_error:0.3,short_read:0.2,flip:0.02,seed:11")
    faulty = Server(store, tmp_path / "faulty.log", *extra)
    try:
        outcomes = []
        for prompt, answer in zip(prompts, expected):
            response = ask(faulty, prompt)
            if response.status_code == 200:
                assert response.json()["choices"][0]["message"]["content"] == answer  # never a wrong token
                outcomes.append("ok")
            else:
                error = response.json()["error"]
                assert response.status_code == 500 and error["code"] == "disk_read_failed", error
                assert "reading the model's experts from disk failed" in error["message"]
                outcomes.append("disk")
        assert "ok" in outcomes and "disk" in outcomes, outcomes
        assert faulty.metric("generations_ended_early_total", reason="disk") == outcomes.count("disk")
        assert faulty.http.get("/health").status_code == 200  # it goes on serving
    finally:
        faulty.stop()


def test_closing_a_worker_ends_a_step_held_by_a_stalled_disk_at_once(store):  # noqa: F811
    """A server's drain that runs out of time closes the worker; a step waiting for a read that stalls (here for
    ten minutes, past the 60 s read timeout) ends within a second, its job with ShuttingDown, not a disk error,
    and so do the jobs still queued (their waiters hear it, rather than waiting out their timeouts) and one
    submitted after the close. Afterwards the model reads and answers again."""
    import asyncio
    import threading
    import time

    import moestream
    from moestream.core.engine import engine_of
    from moestream.generation.generate import SamplingParams
    from moestream.generation.worker import Choice, ModelThread, ShuttingDown, Worker

    thread = ModelThread()
    model, tokenizer = thread.call(moestream.load, store, "16KiB")
    reader = engine_of(model).supply.reader
    worker = Worker(model, tokenizer, 4, model_thread=thread)
    worker.start()
    stall = Faults(stall=1.0, stall_seconds=600)
    reader.faults = stall
    for f in reader._files:
        f.faults = stall

    async def ask(on_worker):
        job = on_worker.submit([Choice([5, 6, 7, 8], SamplingParams.greedy(8))], timeout=900)
        return [event async for event in job.output()]

    async def ending(job):
        try:
            await job.wait_until_started()
            [event async for event in job.output()]
        except ShuttingDown as e:
            return str(e)

    async def ask_three():  # one runs (and stalls), two wait in the queue behind it (a batch of one row)
        jobs = [worker.submit([Choice([5 + i, 6, 7, 8], SamplingParams.greedy(8))], timeout=900) for i in range(3)]
        return await asyncio.gather(*(ending(job) for job in jobs))

    def close_when_stalled():
        while not stall.injected["stall"]:
            time.sleep(0.05)
        time.sleep(0.5)
        closing[0] = time.monotonic()
        worker.close()
        closing[1] = time.monotonic()

    closing = [0.0, 0.0]
    closer = threading.Thread(target=close_when_stalled)
    closer.start()
    try:
        endings = asyncio.run(ask_three())
    finally:
        closer.join(30)
        stall.wake()  # (else the stalled I/O threads hold the interpreter's exit for ten minutes)
    assert endings == ["the server is stopping"] * 3
    assert closing[1] - closing[0] < 5, closing
    assert worker.stats().ended_early["cancelled"] == 3 and not worker.stats().ended_early["disk"]
    with pytest.raises(ShuttingDown):  # a request that comes after the close (it passed the drain's check before)
        asyncio.run(ask(worker))
    # the disk answers again (the stalls end, and the slots they held come back): a new worker on the model serves
    for entry in engine_of(model).supply.cache.parked:
        entry.read.result(timeout=30)
    again = Worker(model, tokenizer, 4, model_thread=thread)
    again.start()
    try:
        events = asyncio.run(ask(again))
    finally:
        again.close()
        thread.stop()
    assert len(events[-1].result.token_ids) == 8

"""A clean stop of `moestream serve`: on SIGTERM a running stream goes on to its end while new requests get 503
with Retry-After (and /health 503), then the process exits 0; past --shutdown-timeout the running stream ends
with an error event instead; a second SIGTERM exits at once."""

import json
import signal
import threading
import time

import httpx
from test_server import MODEL, Server, store  # noqa: F401 (fixture)

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 200, "ignore_eos": True, "stream": True}


def _stream_lines(server, body, first: threading.Event, lines: list) -> None:
    with (
        httpx.Client(base_url=server.url, timeout=60) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        for line in response.iter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first.set()
    first.set()


def _start_stream(server, body=BODY):
    first, lines = threading.Event(), []
    thread = threading.Thread(target=_stream_lines, args=(server, body, first, lines))
    thread.start()
    assert first.wait(60)
    return thread, lines


def test_sigterm_lets_a_running_stream_finish_refuses_new_requests_and_exits_0(store, tmp_path):  # noqa: F811
    server = Server(store, tmp_path / "server.log", "--shutdown-timeout", "30")
    thread, lines = _start_stream(server)
    server.process.send_signal(signal.SIGTERM)
    refused = server.http.post("/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 2})
    health = server.http.get("/health")
    thread.join(60)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "30", refused.text
    assert refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.json()["status"] == "draining"
    assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(30) == 0


def test_past_the_shutdown_timeout_a_stream_ends_with_an_error_event_and_a_second_sigterm_exits_at_once(store, tmp_path):  # noqa: F811
    server = Server(store, tmp_path / "server.log", "--shutdown-timeout", "0")
    thread, lines = _start_stream(server)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    thread.join(60)
    assert server.process.wait(30) == 0 and time.monotonic() - started < 30
    assert lines[-1] == "[DONE]" and "shutting down" in json.loads(lines[-2])["error"]["message"], lines[-2:]
    # a second signal: exits at once, whatever runs
    server = Server(store, tmp_path / "server2.log", "--shutdown-timeout", "60")
    thread, lines = _start_stream(server)
    server.process.send_signal(signal.SIGTERM)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(15) == 0
    thread.join(60)


def test_the_process_is_gone_within_the_shutdown_timeout_while_every_read_is_slow(store, tmp_path, monkeypatch):  # noqa: F811
    """The timeout bounds the whole stop, not only the drain: with every expert read taking 2 s (a stream
    that would run for minutes), a SIGTERM with a 12 s timeout ends the stream with an error event and the
    process exits 0 before the 12 s are over (the closing starts 3 s before: a quarter of the timeout)."""
    monkeypatch.setenv("MOESTREAM_FAULTS", "stall:1,stall_seconds:2,seed:1")
    server = Server(store, tmp_path / "server.log", "--shutdown-timeout", "12")
    thread, lines = _start_stream(server)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(30) == 0
    took = time.monotonic() - started
    thread.join(30)
    assert took < 12, f"exited {took:.1f} s after the SIGTERM"
    assert lines[-1] == "[DONE]" and "shutting down" in json.loads(lines[-2])["error"]["message"], lines[-2:]

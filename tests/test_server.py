"""`moestream serve`: a real server process on a loopback port with a tiny model, driven by the real
`openai` client (and raw HTTP where a client would not send such a request)."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny import tiny_checkpoint

from moestream.cli import build_parser, main
from moestream.conversion.synthetic import byte_tokenizer
from moestream.core.memory import heap_bytes
from moestream.generation.generate import chat_prompt

MODEL = "tiny"
BUDGET = 40 * 2**10
CONTEXT = 256  # the tiny checkpoint's max_position_embeddings
# What the server process may grow by beyond the expert budget while it answers: activations, KV caches,
# transformers' generate bookkeeping, 20 open connections with their request objects, allocator slack.
STATED_OVERHEAD = 64 * 2**20


def metric_value(text: str, name: str, **labels) -> float:
    """A sample of /metrics, read with prometheus_client's own parser (0 where the sample is absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"moestream_{name}" and sample.labels == labels:
                return sample.value
    return 0.0


def _status(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


class Server:
    def __init__(self, store: Path, log: Path, *extra: str):
        self.log = log
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moestream.cli",
                "serve",
                str(store),
                "--memory",
                str(BUDGET),
                "--port",
                "0",
                "--model-name",
                MODEL,
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 180
        while True:
            match = re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())
            if match:
                break
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        self.url = match.group(1)
        self.http = httpx.Client(base_url=self.url, timeout=60)
        assert self.http.get("/health").json()["status"] == "ok"
        self.rss_at_ready = _status(self.process.pid, "VmRSS")
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def metric(self, name: str, **labels) -> float:
        return metric_value(self.http.get("/metrics").text, name, **labels)

    def stop(self) -> None:
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=3)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


@pytest.fixture(scope="module")
def server(store, tmp_path_factory):
    # Prompts of newcomers are fed 8 tokens per step while others decode: every test below also checks
    # that this interleaving changes no answer.
    s = Server(store, tmp_path_factory.mktemp("serve-log") / "server.log", "--prefill-chunk", "8")
    yield s
    s.stop()


def _chat(server, content="Hello there", **kw):
    return server.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def _streamed_chat(server, content="Hello there", **kw):
    pieces, finish, usage = [], None, None
    for chunk in _chat(server, content, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish, usage


def _generate_cli(store, prompt: str, n: int, capsys) -> dict:
    capsys.readouterr()
    assert (
        main(
            [
                "generate",
                str(store),
                "--memory",
                str(BUDGET),
                "--prompt",
                prompt,
                "--max-new-tokens",
                str(n),
                "--greedy",
                "--json",
            ]
        )
        == 0
    )
    return json.loads(capsys.readouterr().out)


def test_models_health_and_help(server):
    assert [m.id for m in server.client.models.list().data] == [MODEL]
    assert server.client.models.retrieve(MODEL).id == MODEL
    assert server.http.get("/health").json() == {"status": "ok", "model": MODEL, "queued": 0, "running": 0}
    budgets = next(line for line in server.log.read_text().splitlines() if "memory budgets" in line)
    assert "experts 40 KiB (--memory)" in budgets and "KV 2 GiB (--batch-kv-memory, up to 8 together)" in budgets
    assert "1 GiB (--kv-memory)" in budgets
    out = build_parser().format_help()
    assert "chat" in out and "serve" in out


def test_the_serve_verb_builds_and_checks_its_options_without_fastapi(tmp_path):
    """`moestream --help` builds every verb's parser, and the server extra is optional: the verb module
    imports without FastAPI and uvicorn, and bad options or the missing extra are one-line errors."""
    code = """
import sys
sys.modules["fastapi"] = sys.modules["uvicorn"] = None  # as if `moestream[server]` were not installed
from moestream.cli import main
assert "serve" in __import__("moestream.cli").cli.build_parser().format_help()
for extra in (["--port", "70000"], ["--max-queue", "0"], ["--request-timeout", "nan"], ["--default-max-tokens", "-1"],
              ["--max-batch", "0"], ["--kv-memory", "lots"], ["--batch-kv-memory", "0"], ["--prefill-chunk", "0"], []):
    print(main(["serve", "no-such-store", *extra]))
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2"] * 9
    errors = [line for line in done.stderr.splitlines() if line.startswith("moestream: error:")]
    assert len(errors) == 9, done.stderr
    assert "--port" in errors[0] and "--max-queue" in errors[1] and "--request-timeout" in errors[2]
    assert "--default-max-tokens" in errors[3] and "--max-batch" in errors[4] and "'lots'" in errors[5]
    assert "--batch-kv-memory" in errors[6] and "--prefill-chunk" in errors[7] and "pip install 'moestream[server]'" in errors[8]


def test_chat_streamed_equals_non_streamed_with_usage(server):
    whole = _chat(server, max_tokens=20, seed=7, temperature=1.0)
    text, finish, usage = _streamed_chat(server, max_tokens=20, seed=7, temperature=1.0)
    assert whole.object == "chat.completion" and whole.model == MODEL
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    prompt = chat_prompt(byte_tokenizer(), [{"role": "user", "content": "Hello there"}])
    assert whole.usage.prompt_tokens == usage.prompt_tokens == len(prompt.encode())  # one token per byte
    assert whole.usage.completion_tokens == usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    if finish == "length":
        assert whole.usage.completion_tokens == 20
    other = _chat(server, max_tokens=20, seed=8, temperature=1.0)
    assert other.choices[0].message.content != whole.choices[0].message.content  # the seed matters


def test_greedy_answers_equal_generate_greedy(server, store, capsys):
    prompt = "def fibonacci(n):"
    cli = _generate_cli(store, prompt, 24, capsys)
    completion = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].text == cli["text"]
    assert completion.usage.completion_tokens == len(cli["token_ids"])
    assert completion.usage.prompt_tokens == cli["prompt_tokens"]
    streamed = "".join(
        c.choices[0].text
        for c in server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == cli["text"]
    # Chat: the same as `generate --greedy` on the prompt the chat template makes.
    templated = chat_prompt(byte_tokenizer(), [{"role": "user", "content": "Hello there"}])
    cli = _generate_cli(store, templated, 16, capsys)
    assert _chat(server, max_tokens=16, temperature=0).choices[0].message.content == cli["text"]


def test_stop_sequences(server):
    prompt = "import os\n"
    full = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0).choices[0].text
    # A stop sequence of printable characters from the middle of the greedy answer, cut at its first occurrence.
    start = next(i for i in range(4, len(full) - 3) if full[i : i + 3].isprintable() and full[i : i + 3].isascii())
    stop = full[start : start + 3]
    cut = full[: full.find(stop)]
    for stops in (stop, [stop, "never appears \u2603"]):
        got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stops)
        assert got.choices[0].text == cut and got.choices[0].finish_reason == "stop"
        assert got.usage.completion_tokens < 40
    streamed = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_twenty_concurrent_streams_equal_their_solo_answers(server):
    questions = [(f"question {i}: what is {i} + {i}?", 100 + i) for i in range(20)]
    solo = [_streamed_chat(server, q, max_tokens=16, seed=seed, temperature=1.0)[0] for q, seed in questions]
    before = server.metric("requests_total", endpoint="chat", outcome="ok")
    steps, rows = server.metric("decode_steps_total"), server.metric("decode_step_sequences_total")
    with ThreadPoolExecutor(20) as pool:
        together = list(
            pool.map(lambda qs: _streamed_chat(server, qs[0], max_tokens=16, seed=qs[1], temperature=1.0)[0], questions)
        )
    assert together == solo
    # They were decoded together (--max-batch 8 by default), not one after another.
    assert (server.metric("decode_step_sequences_total") - rows) / (server.metric("decode_steps_total") - steps) > 2
    assert server.metric("requests_total", endpoint="chat", outcome="ok") == before + 20
    assert server.metric("requests_queued") == 0
    peak = _status(server.process.pid, "VmHWM")
    print(f"peak RSS {peak / 2**20:.1f} MiB, at ready {server.rss_at_ready / 2**20:.1f} MiB")
    assert peak <= server.rss_at_ready + BUDGET + STATED_OVERHEAD, (
        f"peak RSS {peak / 2**20:.1f} MiB > {server.rss_at_ready / 2**20:.1f} MiB at ready + budget + "
        f"{STATED_OVERHEAD / 2**20:.0f} MiB"
    )


def test_disconnect_cancels_the_generation(server):
    before_cancelled = server.metric("generations_ended_early_total", reason="cancelled")
    before_tokens = server.metric("completion_tokens_total")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story"}],
        "max_tokens": 200,
        "stream": True,
        "temperature": 0,
    }
    with server.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break  # leave mid-answer: closing the response closes the connection
    deadline = time.monotonic() + 30
    while server.metric("generations_ended_early_total", reason="cancelled") == before_cancelled:
        assert time.monotonic() < deadline, "the disconnect did not cancel the generation"
        time.sleep(0.05)
    assert server.metric("completion_tokens_total") - before_tokens < 200
    assert server.metric("requests_running") == 0
    assert _chat(server, max_tokens=4).choices[0].message.content is not None  # and the server goes on


def _stream_until(server, body: dict, events: int | None) -> str:
    """A streamed completion's text; with `events`, the client leaves after that many events."""
    text, seen = "", 0
    with server.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            seen += 1
            text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
            if events is not None and seen == events:
                break  # closing the response closes the connection
    return text


def test_batched_greedy_answers_equal_their_solo_answers_when_one_leaves(server):
    prompts = [f"def f{i}(x):" + " x" * i for i in range(6)]
    body = {"model": MODEL, "max_tokens": 24, "temperature": 0}
    solo = [server.client.completions.create(prompt=p, **body).choices[0].text for p in prompts]
    cancelled = server.metric("generations_ended_early_total", reason="cancelled")
    with ThreadPoolExecutor(6) as pool:
        # The third client leaves after three events; the batch goes on without it.
        futures = [
            pool.submit(_stream_until, server, {**body, "prompt": p}, 3 if i == 2 else None) for i, p in enumerate(prompts)
        ]
        together = [f.result() for f in futures]
    assert [t for i, t in enumerate(together) if i != 2] == [t for i, t in enumerate(solo) if i != 2]
    assert solo[2].startswith(together[2]) and len(together[2]) < len(solo[2])
    _wait_for(lambda: server.metric("generations_ended_early_total", reason="cancelled") == cancelled + 1)
    _wait_for(lambda: server.metric("requests_running") == 0)


def test_a_follow_up_reuses_the_conversations_kv_and_answers_as_a_fresh_prefill(server, store, capsys):
    first = [{"role": "user", "content": "Name a prime number."}]
    one = server.client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    history = [*first, {"role": "assistant", "content": one.choices[0].message.content}, {"role": "user", "content": "Another?"}]
    reused = server.metric("prefix_tokens_reused_total")
    two = server.client.chat.completions.create(model=MODEL, messages=history, max_tokens=12, temperature=0)
    gained = server.metric("prefix_tokens_reused_total") - reused
    assert gained >= one.usage.prompt_tokens  # at least the whole first prompt was not prefilled again
    assert gained < two.usage.prompt_tokens
    fresh = _generate_cli(store, chat_prompt(byte_tokenizer(), history), 12, capsys)  # a fresh prefill, alone
    assert two.choices[0].message.content == fresh["text"]
    assert server.metric("prefix_cache_bytes") > 0 and server.metric("prefix_cache_entries") >= 1
    assert server.metric("prefix_cache_budget_bytes") == 2**30 and server.metric("batch_kv_budget_bytes") == 2 * 2**30
    assert server.metric("time_to_first_token_seconds_count") > 0 and server.metric("queue_seconds_count") > 0


def test_metrics_are_prometheus_text_with_the_process_metrics_beside(server):
    """/metrics parses with prometheus_client's parser, every family has its help and type, and the process
    metrics a scraper expects (open files, CPU seconds, memory) come with the server's own."""
    families = {f.name: f for f in text_string_to_metric_families(server.http.get("/metrics").text)}
    ours = [f for name, f in families.items() if name.startswith("moestream_")]
    assert len(ours) >= 28 and all(f.documentation and f.type in ("counter", "gauge", "summary") for f in ours)
    assert families["moestream_requests"].type == "counter"
    for name in ("process_open_fds", "process_cpu_seconds", "process_resident_memory_bytes"):
        assert families[name].samples[0].value > 0, name
    if heap_bytes() is not None:  # (glibc: the C heap's bytes in use, which a model's tensors are part of)
        in_use = families["moestream_heap_in_use_bytes"].samples[0].value
        assert 1 * 2**20 < in_use < families["moestream_resident_memory_bytes"].samples[0].value
        assert families["moestream_heap_free_bytes"].samples[0].value >= 0


def test_twenty_concurrent_streams_with_disconnects_never_crash(server):
    body = {"model": MODEL, "max_tokens": 30, "temperature": 0.8, "seed": 5}
    prompts = [f"stream {i}" for i in range(20)]
    with ThreadPoolExecutor(20) as pool:
        texts = list(
            pool.map(lambda ip: _stream_until(server, {**body, "prompt": ip[1]}, 2 if ip[0] % 2 else None), enumerate(prompts))
        )
    _wait_for(lambda: server.metric("requests_running") == 0 and server.metric("requests_queued") == 0, seconds=60)
    assert server.process.poll() is None and server.http.get("/health").json()["status"] == "ok"
    for i in (0, 4, 10):  # those that stayed got their solo answers
        assert texts[i] == server.client.completions.create(prompt=prompts[i], **body).choices[0].text


def test_bad_requests_get_their_4xx_and_the_server_goes_on(server):
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/completions", b"{not json", 400, "invalid_json"),
        ("/v1/completions", b"\xff\xfe\x00garbage", 400, "invalid_json"),
        ("/v1/completions", b"[1, 2, 3]", 400, "invalid_json"),
        ("/v1/completions", {**ok, "model": "gpt-4"}, 404, "model_not_found"),
        ("/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, "model_not_found"),
        ("/v1/completions", {**ok, "max_tokens": -1}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "max_tokens": 0}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "max_tokens": 10**12}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "max_tokens": 10**12}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "max_tokens": "5"}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "max_tokens": 2.5}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "temperature": "hot"}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "temperature": 7}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "top_p": 0}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "stream": "yes"}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "seed": "abc"}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "stop": 5}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "prompt": None}, 400, "invalid_value"),
        ("/v1/completions", {"model": 5, "prompt": "hi"}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "messages": "hi"}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": 12}]}, 400, "invalid_value"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "invalid_value"),
        ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
        ("/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}', 400, None),
        ("/v1/completions", {**ok, "seed": 10**30}, 400, None),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
        ("/v1/completions", {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400, None),
        ("/v1/completions", {**ok, "n": 500}, 400, "invalid_value"),
        ("/v1/completions", {**ok, "n": 9}, 400, "invalid_value"),  # more rows than --max-batch
        ("/v1/completions", {**ok, "frobnicate": 1}, 400, "unsupported_parameter"),
        ("/v1/completions", {**ok, "suffix": "end"}, 400, "unsupported_parameter"),
        ("/v1/chat/completions", {**chat, "audio": {"voice": "x"}}, 400, "unsupported_parameter"),
        ("/v1/chat/completions", {**chat, "top_k": 5}, 400, "unsupported_parameter"),
        ("/v1/completions", {**ok, "prompt": ""}, 400, None),
        ("/v1/completions", {**ok, "prompt": [999999]}, 400, None),
        ("/v1/completions", {**ok, "prompt": "x" * (CONTEXT + 10)}, 400, "context_length_exceeded"),
        ("/v1/completions", {**ok, "prompt": "x" * 200, "max_tokens": 100}, 400, "context_length_exceeded"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "y" * 1000}]}, 400, "context_length_exceeded"),
        (
            "/v1/chat/completions",
            {**chat, "stream": True, "messages": [{"role": "user", "content": "y" * 1000}]},
            400,
            "context_length_exceeded",
        ),
        ("/v1/completions", b"{" + b" " * (17 * 2**20) + b"}", 413, "request_too_large"),
    ]
    for path, body, status, code in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = server.http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == status, (path, body if len(content) < 200 else len(content), response.text)
        error = response.json()["error"]
        assert error["message"] and error["type"] and error["code"] == code, (body, error)
        assert server.http.get("/health").status_code == 200
    assert server.http.get("/v1/nothing").status_code == 404
    assert server.http.get("/v1/completions").status_code == 405
    # no model named: the served one answers (as vLLM and llama.cpp do; a wrong name is the 404 above)
    assert server.http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).json()["model"] == MODEL
    assert server.http.get("/v1/models/gpt-4").json()["error"]["code"] == "model_not_found"
    # The real client turns them into its exceptions.
    with pytest.raises(openai.NotFoundError):
        server.client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=-5)
    assert server.client.completions.create(**ok).choices[0].text is not None
    assert server.process.poll() is None


# -- queueing and timeouts, with a stand-in for generation whose speed the test sets --------------------------


@pytest.fixture
def slow_server(store, monkeypatch):
    """An in-process server on the real tiny model whose batch is replaced by one that makes "A" for every
    sequence at one step per 50 ms (with the real per-sequence stop rules: cancel flag, deadline, max
    tokens), so that queue and timeout behaviour is timed by the test, not by the machine. The prompt
    "stuck" has a prefill of 2 s, which cannot stop early."""
    import uvicorn

    import moestream
    from moestream.generation import serving
    from moestream.generation.batching import BatchGenerator, Part, _Prefill
    from moestream.server import http_app

    class SlowBatch(BatchGenerator):
        def start(self, decoding, siblings=()):
            self.prefilling = _Prefill(decoding, None, 0, list(siblings))

        def feed(self, tokens):
            p = self.prefilling
            time.sleep(2.0 if p.decoding.prompt_ids == self.stuck else 0.05)
            return Part(first_tokens=[self.a] * (1 + len(p.siblings)))

        def join(self, first_tokens):
            p, self.prefilling = self.prefilling, None
            ended = [d for d in (p.decoding, *p.siblings) if d.accept(self.a)]
            self.running += [d for d in (p.decoding, *p.siblings) if d not in ended]
            return ended

        def choose_next(self):
            time.sleep(0.05)
            return [self.a] * len(self.running)

        def accept_next(self, tokens):
            ended = [d for d in self.running if d.accept(self.a)]
            self.running = [d for d in self.running if d not in ended]
            return ended

        def drop(self, decoding):
            self.running.remove(decoding)

    SlowBatch.stuck = byte_tokenizer()("stuck")["input_ids"]
    SlowBatch.a = byte_tokenizer()("A", add_special_tokens=False)["input_ids"][0]
    monkeypatch.setattr(serving, "BatchGenerator", SlowBatch)
    model, tokenizer = moestream.load(store, BUDGET)
    running = []

    def start(**config):
        app = http_app.create_app(model, tokenizer, http_app.ServerConfig(MODEL, **config))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        running.append((server, thread))
        return httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=30)

    yield start
    for server, thread in running:
        server.should_exit = True
        thread.join(timeout=30)


def test_a_full_queue_answers_429(slow_server):
    http = slow_server(max_queue=1, max_batch=1)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 30}  # 1.5 s each
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(http.post, "/v1/completions", json=body)
        _wait_for(lambda: http.get("/health").json()["running"])
        second = pool.submit(http.post, "/v1/completions", json=body)
        _wait_for(lambda: http.get("/health").json()["queued"] == 1)
        third = http.post("/v1/completions", json=body)
        assert third.status_code == 429 and third.json()["error"]["code"] == "queue_full"
        assert first.result().status_code == second.result().status_code == 200
    assert first.result().json()["choices"][0]["text"] == "A" * 30


def test_a_client_that_leaves_the_queue_frees_its_place(slow_server):
    http = slow_server(max_queue=1, max_batch=1)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 40}  # 2 s
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(http.post, "/v1/completions", json=body)
        _wait_for(lambda: http.get("/health").json()["running"])
        with pytest.raises(httpx.TimeoutException):  # waits behind the first one, then gives up
            http.post("/v1/completions", json={**body, "prompt": "b" * 50}, timeout=0.3)
        _wait_for(lambda: http.get("/health").json()["queued"] == 0)  # dropped while the first still runs
        assert http.get("/health").json()["running"]
        third = pool.submit(http.post, "/v1/completions", json=body)  # the queue has room again
        assert first.result().status_code == third.result().status_code == 200
    metrics = http.get("/metrics").text
    assert metric_value(metrics, "generations_ended_early_total", reason="cancelled") == 1
    assert metric_value(metrics, "prompt_tokens_total") == 2  # "a" twice: the one that left never ran


def test_timeouts_answer_503_in_the_queue_and_504_while_running(slow_server):
    http = slow_server(request_timeout=1.0, max_batch=1)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 100}  # 5 s: longer than the timeout
    alone = http.post("/v1/completions", json=body)  # stopped at 1 s
    assert alone.status_code == 504 and alone.json()["error"]["code"] == "timeout"
    # Requests ahead end by their own deadline, which comes before a later one's: a request times out in the
    # queue only behind one that cannot stop in time (a long prefill; "stuck" here, 2 s).
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(http.post, "/v1/completions", json={**body, "prompt": "stuck", "max_tokens": 40})
        _wait_for(lambda: http.get("/health").json()["running"])
        queued = pool.submit(http.post, "/v1/completions", json=body)
        assert queued.result().status_code == 503 and queued.result().json()["error"]["code"] == "timeout"
        assert running.result().status_code == 504 and running.result().json()["error"]["code"] == "timeout"
    _wait_for(lambda: not http.get("/health").json()["running"])
    # A stream that runs out of time ends with an error event, then [DONE].
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "timeout"
    _wait_for(lambda: not http.get("/health").json()["running"])
    assert http.post("/v1/completions", json={**body, "max_tokens": 3}).json()["choices"][0]["text"] == "AAA"


def test_without_a_request_timeout_a_long_request_runs_to_its_end(slow_server):
    """The default (none, as in llama.cpp's and vLLM's servers): a request that takes longer than any limit a
    test would give still ends with all its tokens, streamed or not."""
    assert build_parser().parse_args(["serve", "STORE"]).request_timeout is None
    http = slow_server(request_timeout=None, max_batch=1)
    body = {"model": MODEL, "prompt": "a", "max_tokens": 30}  # 1.5 s
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == "A" * 30
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == "A" * 30


def test_a_request_whose_kv_cannot_fit_is_refused_and_others_wait_for_room(slow_server):
    # The tiny model's KV is 256 bytes a position (2 layers x 2 KV heads x 8 x keys and values x fp32).
    http = slow_server(batch_kv_memory=100 * 256, max_batch=4)
    too_long = http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 60, "max_tokens": 50})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "kv_budget_exceeded"
    assert "--batch-kv-memory" in too_long.json()["error"]["message"]
    body = {"model": MODEL, "prompt": "a", "max_tokens": 40}  # 41 positions: two fit together, not three
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(3)]
        _wait_for(lambda: http.get("/health").json()["running"] == 2)
        assert http.get("/health").json()["queued"] == 1
        assert [f.result().status_code for f in futures] == [200] * 3
    assert metric_value(http.get("/metrics").text, "batch_kv_budget_bytes") == 25600


def _wait_for(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


# -- the thread that runs the model ----------------------------------------------------------------------------


def test_a_model_thread_runs_every_call_on_itself_in_order():
    from moestream.generation.worker import ModelThread

    thread = ModelThread()
    idents = {thread.call(threading.get_ident) for _ in range(3)}
    assert len(idents) == 1 and threading.get_ident() not in idents
    order: list[int] = []
    for future in [thread.submit(order.append, i) for i in range(20)]:
        future.result()
    assert order == list(range(20))
    with pytest.raises(ValueError):
        thread.call(int, "not a number")  # the call's own error, raised where it was awaited
    assert thread.call(sum, [1, 2]) == 3  # and the thread goes on
    thread.stop()


def test_the_server_steps_its_model_on_the_thread_that_loaded_it(store):
    """`serve` loads the model on a ModelThread and hands it to the worker: every forward pass (the batch's
    probe and the requests' steps) runs there. Two threads running the kernels leave two OpenMP pools on the
    cores, and the server decoded at a third of `generate`'s speed."""
    import asyncio

    import moestream
    from moestream.generation.generate import SamplingParams
    from moestream.generation.worker import Choice, Done, ModelThread, Worker

    thread = ModelThread()
    model, tokenizer = thread.call(moestream.load, store, BUDGET)
    loaded_on = thread.call(threading.get_ident)
    ran_on = set()
    model.get_input_embeddings().register_forward_pre_hook(lambda module, args: ran_on.add(threading.get_ident()))
    worker = Worker(model, tokenizer, 4, max_batch=2, model_thread=thread)
    worker.start()

    async def ask():
        job = worker.submit([Choice([5, 6, 7], SamplingParams.greedy(4))], timeout=60)
        return [event async for event in job.output()]

    try:
        events = asyncio.run(ask())
    finally:
        worker.close()
    assert isinstance(events[-1], Done) and len(events[-1].result.token_ids) == 4
    assert ran_on == {loaded_on} and loaded_on != threading.get_ident()
    thread.stop()

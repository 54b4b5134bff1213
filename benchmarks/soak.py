"""A soak of `moestream serve`: clients over every API for a given time, with disk faults injected, a stop and a
restart in the middle; nothing may be lost.

    python benchmarks/soak.py STORE [--minutes 120] [--clients 4] [--faults read_error:0.01,...]
                                    [--serve-args "--memory 8MiB"] [--restart-at 0.5] [--record] [--json FILE]

Starts `moestream serve STORE` (with MOESTREAM_FAULTS set to --faults), asks seeded greedy probes once (their
answers are the reference), then runs --clients threads until the time is up, each picking at random: a chat
completion, a completion, a response or a message (streamed or not, short or long prompts, some with a tool
or a JSON schema), a stream dropped at a random point, a malformed body, a prompt longer than the context, or
a burst past --max-queue. Every status is checked against what that request may get (200; 400 for the bad
ones; 429 for a burst; 499-like drops; a 500 `disk_read_failed` where faults are injected); anything else is
unexpected and printed. At --restart-at of the time it sends SIGTERM (the exit code must be 0 within the
shutdown timeout), starts the server again, and asks the probes again: their answers must be the same (or a
disk error, under faults). It samples the server's RSS, threads and open files every few seconds, and reports
requests by outcome, p50/p99 time to first token and per token, the RSS slope per hour after the first tenth
of the run, and the probes. Exits 1 if anything was unexpected, a probe changed or the stop was not clean.

The probes ask with echo and logprobs, so the server prefills each whole (a scored prompt reuses no cached
prefix): the same computation every time, exact in any compute dtype (docs/DECISIONS.md, "The soak's probes
are prefilled whole").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import machine

MODEL = "soak"
PROBES = [f"Probe {i}: the next line of the story is" for i in range(4)]
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"enum": ["a", "b"]}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


class ServerProcess:
    def __init__(self, store: str, args: list[str], env: dict, log: Path):
        command = [sys.executable, "-m", "moestream.cli", "serve", store, "--port", "0", "--model-name", MODEL, *args]
        self.log = log
        before = log.stat().st_size if log.exists() else 0  # (a restart appends to the same log)
        self.process = subprocess.Popen(command, stdout=log.open("a"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while not (match := re.findall(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text()[before:])):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.url = match[-1]

    def sample(self) -> dict:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        rss = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024
        threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
        files = len(os.listdir(f"/proc/{self.process.pid}/fd"))
        # The prefix cache grows by design up to --kv-memory: RSS beyond it is what a leak would show in.
        metrics = httpx.get(self.url + "/metrics", timeout=30).text
        prefix = re.search(r"^moestream_prefix_cache_bytes (\S+)", metrics, re.M)
        prefix_bytes = float(prefix.group(1)) if prefix else 0.0
        heap = re.search(r"^moestream_heap_in_use_bytes (\S+)", metrics, re.M)  # (glibc only)
        return {
            "pid": self.process.pid,
            "rss": rss,
            "prefix cache": prefix_bytes,
            "rss beyond the prefix cache": rss - prefix_bytes,
            # What the C heap has handed out, less the prefix cache: a leak grows it; freed memory the
            # allocator keeps grows RSS only.
            "heap in use beyond the prefix cache": float(heap.group(1)) - prefix_bytes if heap else None,
            "threads": threads,
            "files": files,
        }


class Soak:
    def __init__(self, args):
        self.args = args
        self.outcomes: Counter = Counter()  # (kind, outcome) -> count
        self.unexpected: list[str] = []
        self.ttft: list[float] = []
        self.per_token: list[float] = []
        self.samples: list[tuple[float, dict]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()  # the server is being stopped and restarted: connection errors expected
        self.halt = threading.Event()  # the clients stop (the stopped server has exited)
        self.faults = bool(args.faults)

    # -- outcomes ------------------------------------------------------------------------------------------

    def note(self, kind: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes[(kind, outcome)] += 1
            if outcome == "unexpected":
                when = time.strftime("%H:%M:%S") + (", stopping" if self.stopping.is_set() else "")
                self.unexpected.append(f"{kind} ({when}): {detail}"[:400])

    def judge(self, kind: str, response: httpx.Response, allowed: tuple[int, ...], long: bool = False) -> None:
        # (any request may find the queue full while another client's burst fills it: 429 is a right answer)
        if response.status_code in allowed or response.status_code == 429:
            self.note(kind, str(response.status_code))
        elif long and response.status_code == 400 and "maximum context length" in response.text:
            # A long prompt sized in characters may pass the window in tokens once a template (tools) wraps it.
            self.note(kind, "400 over the window")
        elif response.status_code == 500 and self.faults and "from disk failed" in response.text:
            self.note(kind, "disk error")
        elif response.status_code == 503 and self.stopping.is_set():
            self.note(kind, "503 stopping")
        else:
            self.note(kind, "unexpected", f"{response.status_code} {response.text[:200]}")

    # -- requests ------------------------------------------------------------------------------------------

    def request(self, http: httpx.Client, rng: random.Random) -> None:
        context_chars = self.args.long_chars
        repeats = rng.choice([1, 1, 2, max(1, context_chars // 50)])  # (long: ~40% of the window in characters)
        prompt, long = "Tell me about disks. " * repeats, repeats > 2
        stream = rng.random() < 0.5
        kind = rng.choice(["chat", "completions", "responses", "messages", "tool", "schema", "drop", "malformed", "too long"])
        max_tokens = rng.choice([4, 16, 32])
        if kind == "malformed":
            path = rng.choice(["/v1/chat/completions", "/v1/messages", "/v1/responses"])
            self.judge(
                kind,
                http.post(path, content=b'{"model": "soak", "messages": [', headers={"content-type": "application/json"}),
                (400,),
            )
            return
        if kind == "too long":
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x " * self.args.context}], "max_tokens": 4}
            self.judge(kind, http.post("/v1/chat/completions", json=body), (400,))
            return
        if kind in ("chat", "tool", "schema", "drop"):
            path, body = "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
            body["max_tokens"] = max_tokens
            if kind == "tool":
                body.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=64)
            if kind == "schema":
                body.update(
                    response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}, max_tokens=32
                )
        elif kind == "completions":
            path, body = "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        elif kind == "responses":
            path, body = "/v1/responses", {"model": MODEL, "input": prompt, "max_output_tokens": max_tokens}
        else:
            path, body = (
                "/v1/messages",
                {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
            )
        if kind == "drop" or stream:
            drop_after = rng.randint(1, 6) if kind == "drop" else None
            self.stream(http, kind, path, {**body, "stream": True}, drop_after, long)
        else:
            self.judge(kind, http.post(path, json=body), (200,), long)

    def stream(self, http: httpx.Client, kind: str, path: str, body: dict, drop_after: int | None, long: bool) -> None:
        start, times = time.monotonic(), []
        with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                self.judge(kind, response, (), long)
                return
            ended = False
            try:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    times.append(time.monotonic())
                    data = line[6:]
                    if drop_after is not None and len(times) >= drop_after:
                        self.note(kind, "dropped")
                        return  # the connection closes here: the server must cancel the generation
                    if self.faults and "from disk failed" in data:  # an error event: the disk failed mid-answer
                        self.note(kind, "disk error")
                        return
                    if '"error"' in data[:40]:
                        if self.stopping.is_set() and "shutting down" in data:  # the drain's time ran out
                            self.note(kind, "ended by the stop")
                        else:
                            self.note(kind, "unexpected", data[:300])
                        return
                    if (
                        data == "[DONE]"
                        or '"response.completed"' in data
                        or '"response.incomplete"' in data
                        or '"message_stop"' in data
                    ):
                        ended = True
            except httpx.HTTPError as e:  # a started stream must end with an event, even when the server stops
                self.note(kind, "unexpected", f"the stream broke: {type(e).__name__}: {e}")
                return
            if not ended:
                self.note(kind, "unexpected", "the stream ended without its final event")
                return
        if times:
            with self.lock:
                self.ttft.append(times[0] - start)
                if len(times) > 2:
                    self.per_token.append((times[-1] - times[0]) / (len(times) - 1))
        self.note(kind, "200 streamed")

    def burst(self, url: str) -> None:
        """More requests at once than the queue holds: some must get 429, none anything unexpected."""
        results = []

        def one():
            with httpx.Client(base_url=url, timeout=600) as http:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "burst"}], "max_tokens": 8}
                try:
                    results.append(http.post("/v1/chat/completions", json=body))
                except httpx.HTTPError as e:
                    results.append(e)

        threads = [threading.Thread(target=one) for _ in range(self.args.max_queue + self.args.max_batch + 8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in results:
            if isinstance(r, httpx.Response):
                self.judge("burst", r, (200, 429))
            elif not self.stopping.is_set():
                self.note("burst", "unexpected", repr(r))

    # -- the run -------------------------------------------------------------------------------------------

    def probes(self, url: str) -> list[str | None]:
        answers = []
        with httpx.Client(base_url=url, timeout=600) as http:
            for prompt in PROBES:
                for _ in range(20):  # under faults a probe may fail; it is asked again
                    # echo with logprobs scores the prompt, which the server then prefills whole, never from a
                    # cached prefix: the same computation every time, so the answer is exact in any compute dtype.
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "echo": True, "logprobs": 0}
                    response = http.post("/v1/completions", json=body)
                    if response.status_code == 200:
                        answers.append(response.json()["choices"][0]["text"])
                        break
                    if not (response.status_code == 500 and self.faults):
                        raise SystemExit(f"a probe got {response.status_code}: {response.text[:300]}")
                else:
                    answers.append(None)
        return answers

    def clients(self, url: str, until: float, seed: int) -> None:
        def run(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            with httpx.Client(base_url=url, timeout=self.args.request_timeout) as http:
                first = i == 0  # the first client starts with a burst: each server meets one at least
                while time.monotonic() < until and not self.halt.is_set():
                    try:
                        if rng.random() < 0.02 or first:
                            first = False
                            self.burst(url)
                        else:
                            self.request(http, rng)
                    except httpx.HTTPError as e:
                        # While the server stops, a new connection is refused, and a request sent on a kept-alive
                        # connection as the server closes it gets no answer at all: no request was lost there.
                        unanswered = isinstance(e, httpx.ConnectError) or any(
                            sign in str(e) for sign in ("without sending", "Connection reset by peer")
                        )
                        if self.stopping.is_set() and unanswered:
                            self.note("client", "not answered: stopped")
                            time.sleep(0.2)
                        else:
                            self.note("client", "unexpected", f"{type(e).__name__}: {e}")

        threads = [threading.Thread(target=run, args=(i,)) for i in range(self.args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def sampler(self, server_of, until: float, every: float) -> threading.Thread:
        def run():
            start = time.monotonic()
            while time.monotonic() < until:
                try:
                    self.samples.append((time.monotonic() - start, server_of().sample()))
                except (FileNotFoundError, ProcessLookupError, AttributeError, httpx.HTTPError):
                    pass  # (the server is stopping or starting)
                time.sleep(every)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def slope_per_hour(samples: list[tuple[float, dict]], key: str, skip: float) -> float:
    """The least-squares slope of `key` over the longest-running server's samples after its first `skip`
    seconds, as a share of its mean per hour (a restart starts a new process: its RSS starts over)."""
    runs: dict[int, list[tuple[float, dict]]] = {}
    for t, sample in samples:
        runs.setdefault(sample["pid"], []).append((t, sample))
    run = max(runs.values(), key=lambda r: r[-1][0] - r[0][0], default=[])
    points = [(t, s[key]) for t, s in run if t - run[0][0] >= skip]
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in points) / max(1e-9, sum((x - mx) ** 2 for x in xs))
    return slope * 3600 / my


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--minutes", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--faults", default="", help="MOESTREAM_FAULTS for the server (empty: none)")
    parser.add_argument("--serve-args", default="--memory 8MiB", help="extra arguments for moestream serve")
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024, help="the served --context (a longer prompt is refused)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--restart-at", type=float, default=0.5, help="when to stop and restart, as a share of the time")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between samples of RSS, threads, files")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here too")
    machine.add_record_argument(parser, "soak")
    args = parser.parse_args()
    args.long_chars = args.context  # a long prompt: about half the window in this byte-ish count of words

    env = (
        {**os.environ, "MOESTREAM_FAULTS": args.faults}
        if args.faults
        else {k: v for k, v in os.environ.items() if k != "MOESTREAM_FAULTS"}
    )
    serve_args = [
        *shlex.split(args.serve_args),
        *("--max-queue", str(args.max_queue), "--max-batch", str(args.max_batch), "--context", str(args.context)),
        *("--shutdown-timeout", "20", "--log-level", "warning"),
        # The server's own limit (it has none by default): a request that hangs ends with a 504/503 that the
        # soak would count as unexpected. Above the clients' --request-timeout, as in the runs before.
        *("--request-timeout", "600"),
    ]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak-{os.getpid()}.log"
    soak = Soak(args)
    server = ServerProcess(args.store, serve_args, env, log)
    reference = soak.probes(server.url)
    total = args.minutes * 60
    start = time.monotonic()
    end = start + total
    current = [server]
    soak.sampler(lambda: current[0], end, args.sample_every)

    restart_at = start + total * args.restart_at if 0 < args.restart_at < 1 else end
    stop = {}
    if restart_at < end:
        # The stop comes under load: the clients go on through the drain (503s) until the server has exited.
        load = threading.Thread(target=soak.clients, args=(server.url, float("inf"), args.seed))
        load.start()
        time.sleep(max(0.0, restart_at - time.monotonic()))
        soak.stopping.set()
        t0 = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        try:
            stop["exit code"] = server.process.wait(60)
        except subprocess.TimeoutExpired:
            server.process.kill()
            stop["exit code"] = "killed after 60 s"
        stop["seconds to exit"] = round(time.monotonic() - t0, 2)
        soak.halt.set()
        load.join()
        soak.halt.clear()
        server = ServerProcess(args.store, serve_args, env, log)
        current[0] = server
        soak.stopping.clear()
        stop["probes after the restart"] = soak.probes(server.url)
        soak.clients(server.url, end, args.seed + 1)
    else:
        soak.clients(server.url, end, args.seed)
    probes_after = soak.probes(server.url)
    server.process.send_signal(signal.SIGTERM)
    final_exit = server.process.wait(60)
    elapsed = time.monotonic() - start

    def same(answers):
        return all(a is None or a == r for a, r in zip(answers, reference))

    samples = soak.samples
    settle = min(600.0, total / 10)  # the first ten minutes of a run (a tenth of a short one): caches filling
    rss_slope = slope_per_hour(samples, "rss", skip=settle)
    beyond_slope = slope_per_hour(samples, "rss beyond the prefix cache", skip=settle)
    heap_known = bool(samples) and all(s["heap in use beyond the prefix cache"] is not None for _, s in samples)
    heap_slope = slope_per_hour(samples, "heap in use beyond the prefix cache", skip=settle) if heap_known else None
    result = {
        "minutes": round(elapsed / 60, 1),
        "requests": sum(soak.outcomes.values()),
        "outcomes": {f"{k} {o}": n for (k, o), n in sorted(soak.outcomes.items())},
        "unexpected": soak.unexpected,
        "ttft p50/p99 s": [round(statistics.median(soak.ttft), 4), round(sorted(soak.ttft)[int(0.99 * (len(soak.ttft) - 1))], 4)]
        if soak.ttft
        else None,
        "per token p50/p99 s": [
            round(statistics.median(soak.per_token), 4),
            round(sorted(soak.per_token)[int(0.99 * (len(soak.per_token) - 1))], 4),
        ]
        if soak.per_token
        else None,
        "rss MiB first/last": [round(samples[0][1]["rss"] / 2**20, 1), round(samples[-1][1]["rss"] / 2**20, 1)]
        if samples
        else None,
        "rss slope per hour": round(rss_slope, 4),
        "rss beyond the prefix cache slope per hour": round(beyond_slope, 4),
        "heap in use beyond the prefix cache slope per hour": None if heap_slope is None else round(heap_slope, 4),
        "prefix cache MiB last": round(samples[-1][1]["prefix cache"] / 2**20, 1) if samples else None,
        # One sample a minute, so a curve (a plateau or a line) can be read back from the JSON: seconds, server
        # pid, RSS, the prefix cache and the heap in use beyond it, in MiB.
        "rss samples": [
            [round(t), s["pid"], round(s["rss"] / 2**20, 1), round(s["prefix cache"] / 2**20, 1)]
            + ([round(s["heap in use beyond the prefix cache"] / 2**20, 1)] if heap_known else [])
            for t, s in samples[:: max(1, round(60 / args.sample_every))]
        ],
        "threads min/max": [min(s["threads"] for _, s in samples), max(s["threads"] for _, s in samples)] if samples else None,
        "open files min/max": [min(s["files"] for _, s in samples), max(s["files"] for _, s in samples)] if samples else None,
        "probes equal": same(probes_after) and same(stop.get("probes after the restart", reference)),
        "stop": {k: v for k, v in stop.items() if k != "probes after the restart"},
        "final exit code": final_exit,
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    clean_stop = stop.get("exit code", 0) == 0 and final_exit == 0
    ok = not soak.unexpected and result["probes equal"] and clean_stop
    if args.record:
        rows = [
            ["minutes", result["minutes"]],
            ["requests", result["requests"]],
            ["unexpected outcomes", len(soak.unexpected)],
            ["disk errors (injected faults)", sum(n for (_, o), n in soak.outcomes.items() if o == "disk error")],
            ["probes equal (before, after the restart, at the end)", "yes" if result["probes equal"] else "NO"],
            ["SIGTERM: exit code, seconds", f"{stop.get('exit code')}, {stop.get('seconds to exit')}"],
            ["time to first token p50 / p99 (s)", result["ttft p50/p99 s"]],
            ["per token p50 / p99 (s)", result["per token p50/p99 s"]],
            ["RSS first / last (MiB)", result["rss MiB first/last"]],
            ["RSS slope per hour (the longest-running server, after its first 10 minutes)", f"{rss_slope:+.2%}"],
            ["the same, RSS beyond the prefix cache's KV", f"{beyond_slope:+.2%}"],
            [
                "the same, the C heap's bytes in use beyond the prefix cache's KV",
                "-" if heap_slope is None else f"{heap_slope:+.2%}",
            ],
            ["prefix cache at the end (MiB)", result["prefix cache MiB last"]],
            ["threads min / max", result["threads min/max"]],
            ["open files min / max", result["open files min/max"]],
        ]
        caption = (
            f"{args.clients} clients for {args.minutes:g} minutes, faults `{args.faults or 'none'}`, serve `{args.serve_args}`:"
        )
        table = machine.table(caption, ["", "value"], [[k, v if isinstance(v, str) else json.dumps(v)] for k, v in rows])
        outcomes = machine.table(
            f"Requests by kind and outcome ({args.minutes:g} minutes, faults `{args.faults or 'none'}`):",
            ["kind", "outcome", "requests"],
            [[k, o, n] for (k, o), n in sorted(soak.outcomes.items())],
        )
        path = machine.write_result(
            args.record, "A soak of the server, with disk faults and a restart", machine.invocation(), [table, outcomes]
        )
        print(f"wrote {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

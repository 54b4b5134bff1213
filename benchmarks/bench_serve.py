"""`moestream serve` against `moestream generate` on the same store, prompt and budget, in one run.

    python benchmarks/bench_serve.py STORE --memory 8MiB [--rounds 3] [--tokens 64] [--concurrent 20]
    (--rounds 0 or --concurrent 0 skips that part)

1. Single request, greedy, the same prompt: `moestream generate --greedy --json` (a fresh process each
   round) and a streamed /v1/completions request through the `openai` client to one `moestream serve`
   process (started once; its expert cache stays warm between requests, as a server's does). Decode
   tokens/s for the API is measured by the client, from its first streamed piece of text to the last.
   Rounds alternate, so that each round's ratio compares the two under the same load on a shared machine.
2. N concurrent streamed chat requests (different questions, seeded sampling): wall time, tokens/s over
   all of them, time to first piece and total latency per request, whether each equals its solo answer,
   and the server's peak RSS against its RSS when it started answering.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from openai import OpenAI


def status_bytes(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def generate_cli(store: str, memory: str, prompt: str, tokens: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "moestream.cli",
            "generate",
            store,
            "--memory",
            memory,
            "--prompt",
            prompt,
            "--max-new-tokens",
            str(tokens),
            "--greedy",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out)


def timed_stream(open_stream, text_of) -> tuple[str, float, float, float]:
    """(text, seconds to the first piece, seconds from first to last piece, total seconds), timed from the
    moment the request is sent (a queued request's headers come only when the worker takes it)."""
    start = time.perf_counter()
    first = last = None
    pieces = []
    for chunk in open_stream():
        piece = text_of(chunk)
        if piece:
            last = time.perf_counter()
            first = first or last
            pieces.append(piece)
    end = time.perf_counter()
    return "".join(pieces), (first or end) - start, (last or end) - (first or end), end - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--memory", default="8MiB")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=20)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the server too

    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "moestream.cli",
            "serve",
            args.store,
            "--memory",
            args.memory,
            "--port",
            "0",
            "--model-name",
            "m",
            "--log-level",
            "warning",
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    try:
        while not (match := re.search(r"at (http://\S+)/v1", log.read_text())):
            if server.poll() is not None:
                raise SystemExit(log.read_text())
            time.sleep(0.1)
        client = OpenAI(base_url=match.group(1) + "/v1", api_key="none", max_retries=0, timeout=600)
        client.models.list()
        rss_ready = status_bytes(server.pid, "VmRSS")

        if args.rounds:
            print(f"single request: greedy, {args.tokens} tokens, prompt {args.prompt!r}, --memory {args.memory}")
        cli_rates, api_rates, server_rates = [], [], []
        for r in range(args.rounds):
            load_before = os.getloadavg()[0]
            cli = generate_cli(args.store, args.memory, args.prompt, args.tokens)
            text, ttft, decode, total = timed_stream(
                lambda: client.completions.create(
                    model="m", prompt=args.prompt, max_tokens=args.tokens, temperature=0, stream=True
                ),
                lambda c: c.choices[0].text if c.choices else "",
            )
            n = len(cli["token_ids"])
            api_rate = (n - 1) / decode if decode > 0 else 0.0
            server_rate = _metric(client, "decode_tokens_per_second")  # the worker's own timing of that request
            cli_rates.append(cli["decode_tokens_per_second"])
            api_rates.append(api_rate)
            server_rates.append(server_rate)
            print(
                f"  round {r + 1}: generate {cli['decode_tokens_per_second']:.1f} tok/s (TTFT {cli['time_to_first_token']:.2f} s, "
                f"hit rate {cli['stats']['hit_rate']:.1%}); API {api_rate:.1f} tok/s at the client, {server_rate:.1f} in the server "
                f"(first text {ttft:.2f} s); "
                f"API/generate {api_rate / cli['decode_tokens_per_second']:.2f}; same text: {text == cli['text']}; "
                f"load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}",
                flush=True,
            )
        if args.rounds:
            ratios = [a / c for a, c in zip(api_rates, cli_rates)]
            print(
                f"  median: generate {statistics.median(cli_rates):.1f} tok/s, API {statistics.median(api_rates):.1f} tok/s "
                f"(server side {statistics.median(server_rates):.1f}), "
                f"API/generate {statistics.median(ratios):.2f} (median of the rounds' ratios)"
            )
        if not args.concurrent:
            return

        questions = [f"Write a function number {i} that" for i in range(args.concurrent)]

        def ask(i: int):
            return timed_stream(
                lambda: client.chat.completions.create(
                    model="m",
                    messages=[{"role": "user", "content": questions[i]}],
                    max_tokens=args.tokens,
                    temperature=1.0,
                    seed=i,
                    stream=True,
                    stream_options={"include_usage": True},
                ),
                lambda c: c.choices[0].delta.content if c.choices else "",
            )

        load_before = os.getloadavg()[0]
        solo = [ask(i) for i in range(args.concurrent)]
        tokens_before = _metric(client, "completion_tokens_total")
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrent) as pool:
            together = list(pool.map(ask, range(args.concurrent)))
        wall = time.perf_counter() - start
        generated = _metric(client, "completion_tokens_total") - tokens_before
        ttfts = sorted(t[1] for t in together)
        totals = sorted(t[3] for t in together)
        peak = status_bytes(server.pid, "VmHWM")
        print(f"{args.concurrent} concurrent streamed chat requests, {args.tokens} tokens max, seeded sampling:")
        print(
            f"  all complete: {len(together)}; each equals its solo answer: {all(a[0] == b[0] for a, b in zip(together, solo))}"
        )
        print(f"  wall {wall:.1f} s, {generated:.0f} tokens, {generated / wall:.1f} tok/s over all requests")
        print(f"  first text after: min {ttfts[0]:.2f} s, median {statistics.median(ttfts):.2f} s, max {ttfts[-1]:.2f} s")
        print(f"  request latency: min {totals[0]:.2f} s, median {statistics.median(totals):.2f} s, max {totals[-1]:.2f} s")
        print(f"  load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
        print(
            f"  server RSS at ready {rss_ready / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{(peak - rss_ready) / 2**20:.0f} MiB)"
        )
    finally:
        server.terminate()
        server.wait(timeout=60)


def _metric(client: OpenAI, name: str) -> float:
    import httpx

    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    return float(re.search(rf"^moestream_{name} (\S+)$", text, re.M).group(1))


if __name__ == "__main__":
    main()

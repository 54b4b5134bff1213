"""`moestream serve` measured through its API: against `moestream generate`, under concurrent streams
decoded together, and over a multi-turn chat that reuses its KV.

    python benchmarks/bench_serve.py STORE --memory 8MiB [--rounds 3] [--tokens 64] [--concurrent 20]
    python benchmarks/bench_serve.py STORE --memory 768MiB --rounds 0 --concurrent 0 --streams 1,4,16 --tokens 32
    python benchmarks/bench_serve.py STORE --memory 8MiB --rounds 0 --concurrent 0 --chat-turns 10
    (--rounds 0, --concurrent 0, no --streams, --chat-turns 0: skip that part; --json OUT: write every part's figures;
    --record: part 1 as this machine's record of serving-one-request, benchmarks/machine.py;
    --record-parts: parts 2-4, those that ran, as this machine's record of serving-concurrent)

1. Single request, greedy, the same prompt: `moestream generate --greedy --json` (a fresh process each
   round) and a streamed /v1/completions request through the `openai` client to one `moestream serve`
   process (started once; its expert cache stays warm between requests, as a server's does). Decode
   tokens/s for the API is measured by the client, from its first streamed piece of text to the last.
   Rounds alternate, so that each round's ratio compares the two under the same load on a shared machine.
2. N concurrent streamed chat requests (different questions, seeded sampling): wall time, tokens/s over
   all of them, time to first piece and total latency per request, whether each equals its solo answer,
   and the server's peak RSS against its RSS when it started answering.
3. --streams 1,4,16: for each count N, N concurrent streamed completions of exactly --tokens tokens
   each (`ignore_eos`; different prompts from --prompts, seeded sampling), in --stream-rounds rounds whose order of counts
   alternates. Aggregate tokens/s is the tokens generated over the phase's wall time (prefills included);
   expert bytes read per token and the mean batch come from the server's /metrics; ratios are against
   N=1 in the same round. The server runs with --max-batch at the largest N. Then peak RSS against the
   RSS at ready plus the expert budget plus the running requests' KV budget.
4. --chat-turns T: one conversation of T turns through /v1/chat/completions (greedy), with the server's
   prefix cache, then the same turns against a second server with --kv-memory 0: time to first token of
   each turn (the server's own, from arrival to first token), the prompt tokens and those reused.
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

import machine
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store")
    ap.add_argument("--memory", default="8MiB")
    ap.add_argument("--prompt", default="def fibonacci(n):")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=20)
    ap.add_argument("--streams", default="", help="comma-separated stream counts, e.g. 1,4,16 (part 3)")
    ap.add_argument("--stream-rounds", type=int, default=2)
    ap.add_argument("--prompts", default=None, help="a text file whose paragraphs are the prompts of part 3")
    ap.add_argument("--chat-turns", type=int, default=0, help="turns of the chat of part 4")
    ap.add_argument("--batch-kv-memory", default="2GiB", help="the server's running-KV budget")
    ap.add_argument("--kv-memory", default="1GiB", help="the server's prefix-cache budget (parts 1-3)")
    ap.add_argument("--json", help="write every part's figures here too")
    machine.add_record_argument(ap, "serving-one-request")
    ap.add_argument(
        "--record-parts",
        nargs="?",
        const="serving-concurrent",
        metavar="CAPABILITY",
        help="write parts 2-4 (those that ran) as this machine's record of CAPABILITY (default serving-concurrent); runs "
        "at one commit add their tables to it",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below: stop the server too

    streams = [int(n) for n in args.streams.split(",")] if args.streams else []
    extra = ["--max-batch", str(max(streams + [8])), "--batch-kv-memory", args.batch_kv_memory, "--kv-memory", args.kv_memory]
    print(f"machine: {machine.line()}", flush=True)
    report: dict = {"options": {k: v for k, v in vars(args).items() if k != "json"}}
    server, client = start_server(args.store, args.memory, extra)
    try:
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
            server_rate = metric(client, "decode_tokens_per_second")  # the worker's own timing of that request
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
            report["single"] = {"generate": cli_rates, "api_client": api_rates, "api_server": server_rates}
            if args.record:
                record_single(args, cli_rates, api_rates, server_rates, ratios)
            print(
                f"  median: generate {statistics.median(cli_rates):.1f} tok/s, API {statistics.median(api_rates):.1f} tok/s "
                f"(server side {statistics.median(server_rates):.1f}), "
                f"API/generate {statistics.median(ratios):.2f} (median of the rounds' ratios)"
            )
        if args.concurrent:
            report["concurrent"] = concurrent_chats(client, server, args, rss_ready)
        if streams:
            report["streams"] = stream_counts(client, server, args, streams, rss_ready)
        if args.chat_turns:
            report["chat_with_prefix_cache"] = chat_turns(client, args, f"with the prefix cache (--kv-memory {args.kv_memory})")
    finally:
        server.terminate()
        server.wait(timeout=60)
    if args.chat_turns:
        server, client = start_server(args.store, args.memory, ["--kv-memory", "0"])
        try:
            report["chat_without"] = chat_turns(client, args, "without it (--kv-memory 0)")
        finally:
            server.terminate()
            server.wait(timeout=60)
    if args.json:
        machine.write_json(args.json, report)
    if args.record_parts and any(k in report for k in ("concurrent", "streams", "chat_with_prefix_cache")):
        record_parts(args, report, streams)


def record_parts(args, report: dict, counts: list[int]) -> None:
    """Parts 2-4 as tables of one record; each table's caption names its options, so that runs of the parts
    by separate commands at one commit add up to one record (machine.write_result)."""
    mib = 2**20
    tables = []

    def spread(xs: list) -> str:
        return f"{xs[0]:.2f} / {statistics.median(xs):.2f} / {xs[-1]:.2f}"

    if "concurrent" in report:
        c = report["concurrent"]
        caption = (
            f"Part 2: {c['requests']} concurrent streamed `/v1/chat/completions` (different questions, seeded sampling at "
            f"temperature 1.0, {args.tokens} tokens max), `--memory {args.memory}`, after each was asked alone:"
        )
        columns = [
            "requests",
            "each equal to its solo answer",
            "wall s",
            "tokens",
            "tok/s over all",
            "first text s, min / median / max",
            "latency s, min / median / max",
            "server RSS at ready, peak (MiB)",
        ]
        row = [
            c["requests"],
            f"{c['equal_to_solo']} of {c['requests']}",
            f"{c['wall_seconds']:.1f}",
            f"{c['tokens']:.0f}",
            f"{c['tokens'] / c['wall_seconds']:.1f}",
            spread(c["first_text_seconds"]),
            spread(c["latency_seconds"]),
            f"{c['rss_ready_bytes'] / mib:.0f}, {c['rss_peak_bytes'] / mib:.0f} (+{(c['rss_peak_bytes'] - c['rss_ready_bytes']) / mib:.0f})",
        ]
        tables.append(machine.table(caption, columns, [row]))
    if "streams" in report:
        st = report["streams"]
        rates, base = st["tokens_per_second"], st["tokens_per_second"][counts[0]]
        caption = (
            f"Part 3: N concurrent streamed `/v1/completions` of exactly {args.tokens} tokens each (`ignore_eos`, seeded "
            f"sampling at temperature 0.7), `--memory {args.memory}`, `--max-batch {max(counts)}`, `--batch-kv-memory "
            f"{args.batch_kv_memory}`, `--kv-memory {args.kv_memory}`, {args.stream_rounds} rounds alternating the order "
            "of the counts after a warm-up; aggregate tok/s is tokens over the phase's wall time, prefills included; bytes "
            "and batch from the server's `/metrics`:"
        )
        columns = ["streams", "aggregate tok/s, per round", f"against {counts[0]}, median (per round)"]
        columns += ["expert MB read per token, per round", "mean batch, per round"]
        rows = []
        for n in counts:
            ratios = [a / b for a, b in zip(rates[n], base)]
            mine = [r for r in st["rounds"] if r["streams"] == n]
            per_token = [r["expert_bytes_read_total"] / r["completion_tokens_total"] / 1e6 for r in mine]
            batch = [r["decode_step_sequences_total"] / max(1, r["decode_steps_total"]) for r in mine]
            rows.append(
                [
                    n,
                    ", ".join(f"{x:.1f}" for x in rates[n]),
                    "1" if n == counts[0] else f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})",
                    ", ".join(f"{x:.2f}" for x in per_token),
                    ", ".join(f"{x:.1f}" for x in batch),
                ]
            )
        tables.append(machine.table(caption, columns, rows))
        m, prefix = st["budgets_mib"], st["prefix_mib"]
        grown = (st["rss_peak_bytes"] - st["rss_ready_bytes"]) / mib
        beyond = grown - m["expert_cache_budget_bytes"] - m["batch_kv_peak_bytes"] - prefix
        caption = "Part 3's memory: the server's peak RSS over the streams above against its RSS when it started answering (MiB):"
        columns = ["RSS at ready", "peak", "growth", "expert budget", "running KV held at most (budget)"]
        columns += ["prefix KV held at the end (budget)", "beyond the three"]
        row = [
            f"{st['rss_ready_bytes'] / mib:.0f}",
            f"{st['rss_peak_bytes'] / mib:.0f}",
            f"+{grown:.0f}",
            f"{m['expert_cache_budget_bytes']:.0f}",
            f"{m['batch_kv_peak_bytes']:.0f} ({m['batch_kv_budget_bytes']:.0f})",
            f"{prefix:.0f} ({m['prefix_cache_budget_bytes']:.0f})",
            f"{beyond:.0f}",
        ]
        tables.append(machine.table(caption, columns, [row]))
    if "chat_with_prefix_cache" in report:
        with_, without = report["chat_with_prefix_cache"], report.get("chat_without", [])
        turns = len(with_)
        caption = (
            f"Part 4: one {turns}-turn conversation through `/v1/chat/completions`, greedy, {args.tokens}-token answers, "
            f"`--memory {args.memory}`, with the prefix cache (`--kv-memory {args.kv_memory}`) and against a second server "
            "with `--kv-memory 0`; time to first token is the server's own (`/metrics`):"
        )
        columns = ["", *(f"turn {t['turn']}" for t in with_), f"turn {turns} / turn 1"]
        rows = [
            [f"prefix cache (`--kv-memory {args.kv_memory}`): TTFT ms"]
            + [f"{t['ttft_server_s'] * 1e3:.0f}" for t in with_]
            + [f"{with_[-1]['ttft_server_s'] / with_[0]['ttft_server_s']:.2f}x"],
            ["prompt tokens reused", *(f"{t['reused']:.0f}" for t in with_), ""],
        ]
        if without:
            rows.append(
                ["no reuse (`--kv-memory 0`): TTFT ms"]
                + [f"{t['ttft_server_s'] * 1e3:.0f}" for t in without]
                + [f"{without[-1]['ttft_server_s'] / without[0]['ttft_server_s']:.2f}x"]
            )
        tables.append(machine.table(caption, columns, rows))
    title = "Serving beyond one request: concurrent streams, a multi-turn chat, memory"
    path = machine.write_result(args.record_parts, title, machine.invocation(), tables)
    print(f"wrote {path}", flush=True)


def record_single(args, cli_rates: list, api_rates: list, server_rates: list, ratios: list) -> None:
    rows = [
        [label, f"{statistics.median(rates):.1f}", f"{min(rates):.1f}-{max(rates):.1f}"]
        for label, rates in (
            ("`moestream generate`", cli_rates),
            ("API, measured by the client (first to last streamed piece)", api_rates),
            ("API, the server's own timing (`/metrics`)", server_rates),
        )
    ]
    caption = (
        f"`--memory {args.memory}`, greedy, {args.tokens} tokens of `{args.prompt}`, {len(cli_rates)} alternating rounds of "
        "`moestream generate --greedy --json` and a streamed `/v1/completions` request from the `openai` client to one `moestream serve`:"
    )
    columns = ["", f"decode tok/s, median of {len(cli_rates)}", "range"]
    notes = f"The API at {min(ratios):.2f}-{max(ratios):.2f}x `generate` per round (median {statistics.median(ratios):.2f}x)."
    title = "Serving one request: the API against `moestream generate`"
    path = machine.write_result(args.record, title, machine.invocation(), [machine.table(caption, columns, rows)], notes)
    print(f"wrote {path}", flush=True)


def start_server(store: str, memory: str, extra: list[str]):
    """A `moestream serve` process on a free port, and an openai client for it."""
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "moestream.cli", "serve", store, "--memory", memory, "--port", "0"]
        + ["--model-name", "m", "--log-level", "warning", *extra],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    while not (match := re.search(r"at (http://\S+)/v1", log.read_text())):
        if server.poll() is not None:
            raise SystemExit(log.read_text())
        time.sleep(0.1)
    client = OpenAI(base_url=match.group(1) + "/v1", api_key="none", max_retries=0, timeout=600)
    client.models.list()
    return server, client


def concurrent_chats(client, server, args, rss_ready: int) -> dict:
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
    tokens_before = metric(client, "completion_tokens_total")
    start = time.perf_counter()
    with ThreadPoolExecutor(args.concurrent) as pool:
        together = list(pool.map(ask, range(args.concurrent)))
    wall = time.perf_counter() - start
    generated = metric(client, "completion_tokens_total") - tokens_before
    ttfts = sorted(t[1] for t in together)
    totals = sorted(t[3] for t in together)
    peak = status_bytes(server.pid, "VmHWM")
    print(f"{args.concurrent} concurrent streamed chat requests, {args.tokens} tokens max, seeded sampling:")
    print(f"  all complete: {len(together)}; each equals its solo answer: {all(a[0] == b[0] for a, b in zip(together, solo))}")
    print(f"  wall {wall:.1f} s, {generated:.0f} tokens, {generated / wall:.1f} tok/s over all requests")
    print(f"  first text after: min {ttfts[0]:.2f} s, median {statistics.median(ttfts):.2f} s, max {ttfts[-1]:.2f} s")
    print(f"  request latency: min {totals[0]:.2f} s, median {statistics.median(totals):.2f} s, max {totals[-1]:.2f} s")
    print(f"  load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(
        f"  server RSS at ready {rss_ready / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{(peak - rss_ready) / 2**20:.0f} MiB)"
    )
    return dict(
        requests=len(together),
        equal_to_solo=sum(a[0] == b[0] for a, b in zip(together, solo)),
        wall_seconds=wall,
        tokens=generated,
        first_text_seconds=ttfts,
        latency_seconds=totals,
        rss_ready_bytes=rss_ready,
        rss_peak_bytes=peak,
    )


DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Stack:\n    def __init__(self):",
    "# Read a CSV file and print the sum of each column\n",
    "def binary_search(items, target):",
    "for i in range(10):\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "with open(path) as f:\n",
]


def load_prompts(path: str | None, count: int) -> list[str]:
    """`count` prompts: paragraphs of the --prompts file (its first 200 characters each), or the defaults, cycled."""
    if path:
        pieces = [p.strip()[:200] for p in Path(path).read_text().split("\n\n") if p.strip()]
    else:
        pieces = DEFAULT_PROMPTS
    return [pieces[i % len(pieces)] for i in range(count)]


def stream_counts(client, server, args, counts: list[int], rss_ready: int) -> dict:
    prompts = load_prompts(args.prompts, max(counts))

    def one(i: int) -> str:
        return timed_stream(
            lambda: client.completions.create(
                model="m",
                prompt=prompts[i],
                max_tokens=args.tokens,
                temperature=0.7,
                seed=i,
                stream=True,
                extra_body={"ignore_eos": True},  # every stream exactly --tokens long
            ),
            lambda c: c.choices[0].text if c.choices else "",
        )[0]

    names = ["completion_tokens_total", "expert_bytes_read_total", "decode_steps_total", "decode_step_sequences_total"]
    with ThreadPoolExecutor(max(counts)) as pool:  # warm-up: fills the expert cache as a running server's is
        list(pool.map(one, range(max(counts))))
    print(
        f"concurrent streams: completions of {args.tokens} tokens, seeded sampling, --memory {args.memory}, --max-batch {max(counts)}"
    )
    rates: dict[int, list[float]] = {n: [] for n in counts}
    rounds = []
    for r in range(args.stream_rounds):
        order = counts if r % 2 == 0 else counts[::-1]
        for n in order:
            before = {k: metric(client, k) for k in names}
            start = time.perf_counter()
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(one, range(n)))
            wall = time.perf_counter() - start
            d = {k: metric(client, k) - before[k] for k in names}
            rates[n].append(d["completion_tokens_total"] / wall)
            rounds.append({"round": r + 1, "streams": n, "wall_seconds": wall, **d})
            print(
                f"  round {r + 1}, {n:2d} streams: {d['completion_tokens_total']:.0f} tokens in {wall:.1f} s = "
                f"{rates[n][-1]:.1f} tok/s; {d['expert_bytes_read_total'] / d['completion_tokens_total'] / 1e6:.2f} MB "
                f"of experts read per token; mean batch {d['decode_step_sequences_total'] / max(1, d['decode_steps_total']):.1f}; "
                f"load average {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    base = rates[counts[0]]
    for n in counts[1:]:
        ratios = [a / b for a, b in zip(rates[n], base)]
        print(
            f"  {n} streams / {counts[0]}: {statistics.median(ratios):.2f}x (median of the rounds' ratios; rounds: "
            + ", ".join(f"{x:.2f}" for x in ratios)
            + ")"
        )
    peak = status_bytes(server.pid, "VmHWM")
    m = {
        k: metric(client, k) / 2**20
        for k in ("expert_cache_budget_bytes", "batch_kv_budget_bytes", "batch_kv_peak_bytes", "prefix_cache_budget_bytes")
    }
    prefix = metric(client, "prefix_cache_bytes") / 2**20
    grown = (peak - rss_ready) / 2**20
    print(
        f"  server RSS at ready {rss_ready / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB (+{grown:.0f} MiB). Budgets: experts "
        f"{m['expert_cache_budget_bytes']:.0f} MiB; running KV {m['batch_kv_budget_bytes']:.0f} MiB, of which "
        f"{m['batch_kv_peak_bytes']:.0f} MiB held at most; prefix KV {m['prefix_cache_budget_bytes']:.0f} MiB, holding "
        f"{prefix:.0f} MiB at the end. Beyond the expert budget and the KV held: {grown - m['expert_cache_budget_bytes'] - m['batch_kv_peak_bytes'] - prefix:.0f} MiB"
    )
    return dict(
        tokens_per_second=rates, rounds=rounds, rss_ready_bytes=rss_ready, rss_peak_bytes=peak, budgets_mib=m, prefix_mib=prefix
    )


def chat_turns(client, args, label: str) -> list[dict]:
    messages, turns = [], []
    print(f"a {args.chat_turns}-turn chat, greedy, {args.tokens} tokens per answer, {label}:")
    first = None
    for turn in range(1, args.chat_turns + 1):
        messages.append({"role": "user", "content": f"Turn {turn}: write one more line of the program."})
        reused = metric(client, "prefix_tokens_reused_total")
        text, ttft, _, _ = timed_stream(
            lambda: client.chat.completions.create(
                model="m", messages=messages, max_tokens=args.tokens, temperature=0, stream=True
            ),
            lambda c: c.choices[0].delta.content if c.choices else "",
        )
        messages.append({"role": "assistant", "content": text})
        server_ttft = metric(client, "last_time_to_first_token_seconds")
        first = first or server_ttft
        print(
            f"  turn {turn:2d}: time to first token {server_ttft * 1e3:.0f} ms in the server ({ttft * 1e3:.0f} ms to the first "
            f"text at the client), {server_ttft / first:.2f}x turn 1's; prompt tokens reused "
            f"{metric(client, 'prefix_tokens_reused_total') - reused:.0f}",
            flush=True,
        )
        turns.append(
            {
                "turn": turn,
                "ttft_server_s": server_ttft,
                "ttft_client_s": ttft,
                "reused": metric(client, "prefix_tokens_reused_total") - reused,
            }
        )
    return turns


def metric(client: OpenAI, name: str) -> float:
    import httpx

    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    return float(re.search(rf"^moestream_{name} (\S+)$", text, re.M).group(1))


if __name__ == "__main__":
    main()

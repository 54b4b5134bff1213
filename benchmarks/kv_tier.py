"""Conversations taking turns against one server whose RAM holds the KV of about one of them: with the KV tier
on disk and without, and across a restart.

    python benchmarks/kv_tier.py STORE --text heldout.txt [--conversations 4] [--turns 4] [--prompt-chars 2400]
                                 [--kv-memory 3MiB] [--serve-args "--memory 8MiB"] [--record]
    python benchmarks/kv_tier.py --shape 48,4,128,12288 [--rounds 3] [--work DIR] [--record]

Each conversation opens with --prompt-chars characters of --text (a stretch of its own: an agent's
instructions and first request) and each later turn appends the answer and a short message, as agents resend
the whole history. The conversations take turns (1, 2, ..., N, 1, 2, ...) against `moestream serve STORE` with
--kv-memory (size it to hold about one conversation), greedy completions of --max-tokens tokens. Two runs:
`--kv-disk off`, then a fresh `--kv-disk` directory; the second is stopped after its last turn (SIGTERM, a
clean stop) and started again on the same directory, and every conversation takes one more turn. Per turn
it reads the usage's prompt and cached tokens and times the request. It prints, per run, the share of prompt
tokens reused over the turns after each conversation's first (and after the restart), and the median
seconds a request took; the answers of the two runs must be the same (they are greedy; a reused prefix gives
the tokens a fresh prefill gives in fp32 compute, so --serve-args should hold `--compute-dtype fp32` for a
model that computes in bf16, as `soak.py` says). With --shape it times one prefix's file instead: a cache of
that KV shape written by the tier, dropped from the page cache, then found and read back as after a restart,
beside the disk's own speed reading the same file. --record writes this machine's record of kv-tier.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import machine
import torch
from soak import MODEL, ServerProcess

NEW_MESSAGE = " Now the next part, please."


def run(args, kv_disk: str, restart: bool, log: Path) -> list[dict]:
    """The turns of one run: one dict per request (conversation, turn, prompt and cached tokens, seconds, text)."""
    serve = [*shlex.split(args.serve_args), "--kv-memory", args.kv_memory, "--kv-disk", kv_disk, "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "MOESTREAM_FAULTS"}
    text = Path(args.text).read_text()
    histories = [text[i * args.prompt_chars : (i + 1) * args.prompt_chars] for i in range(args.conversations)]
    turns: list[dict] = []

    def turn(url: str, i: int, number: int) -> None:
        body = {"model": MODEL, "prompt": histories[i], "max_tokens": args.max_tokens, "temperature": 0}
        began = time.perf_counter()
        reply = httpx.post(url + "/completions", json=body, timeout=7200)  # (a first turn at 12k tokens: minutes)
        seconds = time.perf_counter() - began
        reply.raise_for_status()
        out = reply.json()
        usage = out["usage"]
        answer = out["choices"][0]["text"]
        turns.append(
            {
                "conversation": i,
                "turn": number,
                "prompt": usage["prompt_tokens"],
                "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
                "seconds": seconds,
                "text": answer,
            }
        )
        histories[i] += answer + NEW_MESSAGE

    server = ServerProcess(args.store, serve, env, log)
    try:
        for number in range(args.turns):
            for i in range(args.conversations):
                turn(server.url, i, number)
        if restart:
            stop(server, 120)
            server = ServerProcess(args.store, serve, env, log)
            for i in range(args.conversations):
                turn(server.url, i, args.turns)
    finally:
        stop(server, 120)
    return turns


def file_read(args) -> list[list]:
    """A prefix's file at a model's KV shape (--shape LAYERS,KV_HEADS,HEAD_DIM,POSITIONS, bf16): written by the
    tier, dropped from the page cache, then found and read back as a request would (`DiskTier.match`), timed
    --rounds times; rows of (bytes, write seconds, cold read seconds, GB/s)."""
    from moestream.generation.kv_disk import FORMAT, DiskTier

    cache = synthetic_cache(args.shape)
    positions = int(args.shape.split(",")[-1])
    ids = list(range(positions))
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-tier-", dir=args.work) as work:
        for _ in range(args.rounds):
            for old in Path(work).glob("*"):
                old.unlink()
            tier = DiskTier(work, 2**40, {"format": FORMAT, "store": "bench"})
            began = time.perf_counter()
            tier.put(ids, cache)
            tier.flush()
            written = time.perf_counter() - began
            (path,) = Path(work).glob("*.kv")
            size = path.stat().st_size
            drop_from_page_cache(path)  # a cold read, as after a restart
            tier = DiskTier(work, 2**40, {"format": FORMAT, "store": "bench"})  # (a restart: the index from the headers)
            began = time.perf_counter()
            found, n = tier.match(ids + [0])
            for layer in found.layers:  # (the reads go on after match returns: wait for every layer's, checked)
                if layer.arriving is not None:
                    layer.arriving()
            read = time.perf_counter() - began
            assert n == positions and torch.equal(found.layers[-1].values, cache.layers[-1].values)
            del found
            disk = direct_read_seconds(path)
            rows.append(
                [f"{size / 1e9:.2f} GB", f"{written:.2f}", f"{read:.2f}", f"{size / read / 1e9:.2f}", f"{size / disk / 1e9:.2f}"]
            )
            print("  ".join(rows[-1]), flush=True)
    return rows


def first_token_after_restart(args) -> list[list]:
    """Time to first token of a prompt of --restart-prompt-chars characters of --text through `moestream serve
    STORE` with a fresh tier: first asked (a whole prefill); then, after a clean stop, the file dropped from the
    page cache and a new server on the same directory, asked again with a line more (its prefix from the tier);
    then once more after another restart, this time with a short unrelated request first (the experts and
    shapes the new tokens need then come warm, as on a running server: what is left is the tier's read); then
    that server asked with another line more (its prefix from RAM where --kv-memory holds it: the prefill of
    the new tokens without the tier's read). Rows: (ask, prompt tokens, of them cached, seconds to the first
    token, seconds in all)."""
    text = Path(args.text).read_text()
    while len(text) < args.restart_prompt_chars + 100:
        text += text
    prompt = text[: args.restart_prompt_chars]
    asks = [
        ("first (whole prefill)", prompt, "new server"),
        ("after a restart, a line more", prompt + " And one more line.", "new server"),
        ("after a restart and a short request, another line more", prompt + " And one more line. Then another.", "warmed server"),
        ("the same server, another line more", prompt + " And one more line. Then another. And a last one.", "same server"),
    ]
    unrelated = text[len(text) // 2 :][:200]  # (no prefix in common with the prompt: the tier is not read)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-tier-", dir=args.work) as work:
        serve = [*shlex.split(args.serve_args), "--kv-disk", str(Path(work) / "tier"), "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if k != "MOESTREAM_FAULTS"}
        server = None
        for name, asked, where in asks:
            if where != "same server":
                if server is not None:
                    stop(server)
                    for path in (Path(work) / "tier").glob("*.kv"):  # (cold, as after a reboot)
                        drop_from_page_cache(path)
                server = ServerProcess(args.store, serve, env, Path(work) / "serve.log")
                if where == "warmed server":
                    first_token(server.url, unrelated, "a short unrelated request")
            first, total, usage = first_token(server.url, asked, name)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append([name, usage.get("prompt_tokens"), cached, f"{first:.2f}", f"{total:.2f}"])
            print("  ".join(str(c) for c in rows[-1]), flush=True)
        stop(server)
    return rows


def first_token(url: str, prompt: str, name: str) -> tuple[float, float, dict]:
    """(seconds to the first token, seconds in all, usage) of one greedy token for `prompt`, streamed."""
    import json as json_module

    # One token: the request's first event with a choice is its first token, even one whose text is held back
    # as an incomplete character (a byte-level model's random bytes).
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    began, first, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", url + "/completions", json=body, timeout=7200) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json_module.loads(line[6:])
            if first is None and event.get("choices"):
                first = time.perf_counter() - began
            usage = event.get("usage") or usage
            if event.get("error"):
                raise SystemExit(
                    f"{name}: the server answered {event['error']} (a long prompt may need --request-timeout in --serve-args)"
                )
    return first, time.perf_counter() - began, usage


def stop(server, wait: float = 600) -> None:
    """A clean stop (SIGTERM): the tier gets every prefix in RAM."""
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(wait)


def drop_from_page_cache(path: Path) -> None:
    """Written out, then out of the page cache: the next read comes from the disk, as after a reboot."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def decode_while_writing(args) -> list[list]:
    """Decode tokens/s of STORE with the tier idle and with the tier writing prefixes of --shape over and over
    on its thread meanwhile, in alternating rounds of one process (rows: round, idle tok/s, writing tok/s,
    GB written during the writing rounds)."""
    import threading

    import moestream
    from moestream.generation.kv_disk import FORMAT, DiskTier
    from moestream.generation.serving import timed

    model, tokenizer = moestream.load(args.store, args.memory)
    prompt = tokenizer(Path(args.text).read_text()).input_ids[:32]
    cache = synthetic_cache(args.shape)

    def rate() -> float:
        result = timed(model, prompt, args.decode_tokens)
        return (len(result.token_ids) - 1) / result.timing.decode_seconds

    rate()  # (warm: the experts this decode reads, the kernels)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kv-tier-", dir=args.work) as work:
        tier = DiskTier(work, 3 * 10**9, {"format": FORMAT, "store": "bench"})  # (older files deleted as it goes)
        for number in range(args.rounds):
            idle = rate()
            stop = threading.Event()
            before = tier.stats().bytes_written
            writer = threading.Thread(target=_keep_writing, args=(tier, cache, stop))
            writer.start()
            time.sleep(0.2)  # (the first write under way)
            busy = rate()
            stop.set()
            writer.join()
            written = tier.stats().bytes_written - before
            rows.append([number + 1, f"{idle:.1f}", f"{busy:.1f}", f"{busy / idle:.3f}", f"{written / 1e9:.1f}"])
            print("  ".join(str(c) for c in rows[-1]), flush=True)
    moestream.close(model)
    return rows


def _keep_writing(tier, cache, stop) -> None:
    """Queue prefixes (a new one each time, so each is written) and wait for each, until `stop`."""
    n = 0
    while not stop.is_set():
        n += 1
        tier.put(list(range(n, n + 16)), cache)
        tier.flush()


def synthetic_cache(shape: str):
    """A DynamicCache of random bf16 keys and values at LAYERS,KV_HEADS,HEAD_DIM,POSITIONS."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers, heads, head_dim, positions = (int(v) for v in shape.split(","))
    cache = DynamicCache.__new__(DynamicCache)
    cache.__dict__.update({"layer_class_to_replicate": None, "offloading": False})
    cache.layers = []
    for _ in range(layers):
        layer = DynamicLayer()
        layer.is_initialized, layer.device = True, torch.device("cpu")
        layer.keys, layer.values = (torch.randn(1, heads, positions, head_dim).bfloat16() for _ in range(2))
        cache.layers.append(layer)
    return cache


def direct_read_seconds(path: Path, threads: int = 4, piece: int = 16 << 20) -> float:
    """Seconds to read `path` once more from the disk alone, cold, with O_DIRECT, `threads` reading pieces of
    `piece` bytes at once into aligned memory, nothing else done: the disk's speed for this file, beside the
    tier's (which also checks the checksum and builds the cache)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    size = path.stat().st_size
    drop_from_page_cache(path)
    buffer = mmap.mmap(-1, size + piece)  # (page-aligned, as O_DIRECT needs)
    view = memoryview(buffer)
    began = time.perf_counter()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda offset: os.preadv(fd, [view[offset : offset + piece]], offset), range(0, size, piece)))
    finally:
        os.close(fd)
    seconds = time.perf_counter() - began
    view.release()
    buffer.close()
    return seconds


def summary(turns: list[dict], after: int = 1, only: int | None = None) -> tuple[float, float, int]:
    """(share of prompt tokens reused, median seconds, requests) over the turns numbered `after` or later
    (or exactly `only`)."""
    chosen = [t for t in turns if (t["turn"] == only if only is not None else t["turn"] >= after)]
    prompt = sum(t["prompt"] for t in chosen)
    cached = sum(t["cached"] for t in chosen)
    return cached / max(1, prompt), statistics.median(t["seconds"] for t in chosen), len(chosen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store", nargs="?", help="the store to serve (not with --shape)")
    parser.add_argument("--text", help="the conversations' opening text (a stretch each)")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="turns of each conversation before the restart")
    parser.add_argument("--prompt-chars", type=int, default=2400)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-memory", default="3MiB", help="the server's --kv-memory: about one conversation's KV")
    parser.add_argument("--serve-args", default="--memory 8MiB", help="more arguments for moestream serve")
    parser.add_argument(
        "--shape",
        help="instead: time one prefix's file at this KV shape, LAYERS,KV_HEADS,HEAD_DIM,POSITIONS (bf16; the "
        "Qwen3-30B-A3B shape at 12k tokens: 48,4,128,12288), written, then read back cold",
    )
    parser.add_argument("--rounds", type=int, default=3, help="with --shape: files written and read, or decode rounds")
    parser.add_argument(
        "--decode-while-writing",
        action="store_true",
        help="with --shape and a STORE: decode tok/s with the tier idle and with it writing --shape prefixes meanwhile",
    )
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--restart-prompt-chars",
        type=int,
        help="instead: time to first token of a prompt this long (characters of --text), whole, then after a restart",
    )
    parser.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the conversations without the tier too, and compare the answers (--no-baseline: at a shape where "
        "every turn's whole prefill takes minutes)",
    )
    parser.add_argument("--memory", default="256MiB", help="with --decode-while-writing: the expert budget")
    parser.add_argument("--work", default=None, help="where the tier's files go (a directory on the disk to measure)")
    machine.add_record_argument(parser, "kv-tier")
    args = parser.parse_args()
    if args.restart_prompt_chars:
        if not args.store or not args.text:
            parser.error("--restart-prompt-chars needs a STORE and --text")
        print(machine.line())
        rows = first_token_after_restart(args)
        if args.record:
            caption = (
                f"Time to first token of one prompt through `moestream serve` (`{args.serve_args}`, a fresh `--kv-disk`): first "
                "asked, then after a clean stop and a restart (the tier's file dropped from the page cache) asked with a line more, "
                "then after another restart asked with another line more once a short unrelated request has warmed the server, "
                "then with a last line more on that server:"
            )
            table = machine.table(caption, ["ask", "prompt tokens", "cached", "first token s", "all s"], rows)
            path = machine.write_result(args.record, "Conversations through the KV tier on disk", machine.invocation(), [table])
            print(f"wrote {path}")
        return 0
    if args.shape and args.decode_while_writing:
        print(machine.line())
        rows = decode_while_writing(args)
        if args.record:
            caption = (
                f"Decode of `{args.store}` ({args.decode_tokens} greedy tokens, `--memory {args.memory}`) with the KV tier idle "
                f"and with it writing prefixes of KV shape {args.shape} (bf16) one after another on its thread meanwhile, "
                "alternating in one process:"
            )
            table = machine.table(caption, ["round", "idle tok/s", "writing tok/s", "writing / idle", "GB written"], rows)
            path = machine.write_result(args.record, "Conversations through the KV tier on disk", machine.invocation(), [table])
            print(f"wrote {path}")
        return 0
    if args.shape:
        print(machine.line())
        rows = file_read(args)
        if args.record:
            caption = (
                f"One prefix's file at KV shape {args.shape} (layers, KV heads, head size, positions; bf16), written by the "
                "tier, dropped from the page cache, then found and read back as after a restart (checksum and all):"
            )
            table = machine.table(
                caption, ["file", "write s", "cold read s", "read GB/s", "the disk alone (O_DIRECT, 4 threads) GB/s"], rows
            )
            path = machine.write_result(args.record, "Conversations through the KV tier on disk", machine.invocation(), [table])
            print(f"wrote {path}")
        return 0
    if not args.store or not args.text:
        parser.error("give a STORE and --text (or --shape)")

    with tempfile.TemporaryDirectory(prefix="kv-tier-", dir=args.work) as work:
        log = Path(work) / "serve.log"
        without = run(args, "off", False, log) if args.baseline else []
        with_tier = run(args, str(Path(work) / "tier"), True, log)
    same = [t["text"] for t in without] == [t["text"] for t in with_tier if t["turn"] < args.turns]
    verdict = ("yes" if same else "NO") if args.baseline else "not compared (--no-baseline)"
    rows = []
    for name, turns in (("--kv-disk off", without), ("--kv-disk DIR", with_tier)):
        if not turns:
            continue
        share, seconds, n = summary(turns)
        _, first_seconds, _ = summary(turns, only=0)
        tokens = statistics.mean(t["prompt"] for t in turns if t["turn"] >= 1)
        rows.append([name, "later turns", n, f"{tokens:.0f}", f"{share:.1%}", f"{seconds:.3f}", f"{first_seconds:.3f}"])
    share, seconds, n = summary(with_tier, only=args.turns)
    tokens = statistics.mean(t["prompt"] for t in with_tier if t["turn"] == args.turns)
    rows.append(["--kv-disk DIR", "the turn after a restart", n, f"{tokens:.0f}", f"{share:.1%}", f"{seconds:.3f}", ""])
    print(machine.line())
    for row in rows:
        print("  ".join(str(c) for c in row))
    print("answers the same with and without the tier:", verdict)
    if args.record:
        caption = (
            f"{args.conversations} conversations of about {args.prompt_chars} characters taking turns ({args.turns} each, then "
            f"a restart and one more), `--kv-memory {args.kv_memory}`, serve `{args.serve_args}`, greedy completions of "
            f"{args.max_tokens} tokens; the answers with and without the tier the same: {verdict}:"
        )
        table = machine.table(
            caption,
            ["server", "turns", "requests", "prompt tokens (mean)", "of them reused", "median seconds a request", "first turns"],
            rows,
        )
        path = machine.write_result(args.record, "Conversations through the KV tier on disk", machine.invocation(), [table])
        print(f"wrote {path}")
    return 0 if same or not args.baseline else 1


if __name__ == "__main__":
    sys.exit(main())

"""How soon a streamed tool call's arguments reach the client: the time from the call's start (its name) to
its first argument delta, against one decode step (the median gap between argument deltas), through chat
completions and the Responses API, on a served store whose chat template has a known tool-call format.

    python benchmarks/tool_call_stream.py STORE [--chat-template FILE] [--runs 5]

Starts `moestream serve` on a free port, sends forced calls (tool_choice required, one call) with the
`openai` client, and prints per endpoint: the time to the name, to the first argument delta, the median
gap between deltas, and the first delta's lag in decode steps. `--record` writes the table as this
machine's record of tool-call-stream (benchmarks/machine.py).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
import machine  # noqa: E402

TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


def start_server(store: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable,
        "-m",
        "moestream.cli",
        "serve",
        store,
        "--port",
        "0",
        "--model-name",
        "m",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen([*command, *extra], stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not (match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not start:\n{log.read_text()}")
        time.sleep(0.1)
    return process, match.group(1) + "/v1"


def chat_times(client: openai.OpenAI, seed: int) -> tuple[float, list[float]]:
    """(time of the call's name, times of its argument deltas), from the request's start."""
    start, named, deltas = time.perf_counter(), None, []
    stream = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "function": TOOL}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=seed,
        stream=True,
    )
    for chunk in stream:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                now = time.perf_counter() - start
                if call.function.name:
                    named = now
                if call.function.arguments:
                    deltas.append(now)
    return named, deltas


def responses_times(client: openai.OpenAI, seed: int) -> tuple[float, list[float]]:
    start, named, deltas = time.perf_counter(), None, []
    stream = client.responses.create(
        model="m",
        input="Weather?",
        tools=[{"type": "function", **TOOL}],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=200,
        stream=True,
        extra_body={"seed": seed},
    )
    for event in stream:
        now = time.perf_counter() - start
        if event.type == "response.output_item.added" and event.item.type == "function_call":
            named = now
        elif event.type == "response.function_call_arguments.delta":
            deltas.append(now)
    return named, deltas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("store")
    parser.add_argument("--chat-template", help="a chat template file with a known tool-call format")
    parser.add_argument("--memory", default="4GiB")
    parser.add_argument("--runs", type=int, default=5)
    machine.add_record_argument(parser, "tool-call-stream")
    args = parser.parse_args()
    rows = []
    extra = ["--memory", args.memory] + (["--chat-template", args.chat_template] if args.chat_template else [])
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(args.store, extra, Path(tmp) / "server.log")
        try:
            client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
            for name, measure in (("chat completions", chat_times), ("responses", responses_times)):
                measure(client, 0)  # warm-up
                firsts, gaps, counts = [], [], []
                for run in range(args.runs):
                    named, deltas = measure(client, run + 1)
                    firsts.append(deltas[0] - named)
                    gaps.append(statistics.median(b - a for a, b in zip(deltas, deltas[1:])))
                    counts.append(len(deltas))
                step = statistics.median(gaps)
                first = statistics.median(firsts)
                print(
                    f"{name:17s} name -> first argument delta {first * 1e3:7.2f} ms (median of {args.runs}); "
                    f"one decode step (median gap between deltas) {step * 1e3:7.2f} ms; lag {first / step:4.2f} steps; "
                    f"{statistics.median(counts):.0f} argument deltas per call"
                )
                rows.append(
                    [
                        name,
                        f"{first * 1e3:.2f} ms",
                        f"{step * 1e3:.2f} ms",
                        f"{first / step:.2f} steps",
                        f"{statistics.median(counts):.0f}",
                    ]
                )
        finally:
            process.terminate()
            process.wait(timeout=30)
    if args.record:
        columns = [
            "endpoint",
            "name -> first argument delta",
            "one decode step (median gap between deltas)",
            "lag",
            "argument deltas per call",
        ]
        caption = f"A forced call (tool_choice required, one call) through the `openai` client, medians of {args.runs} runs:"
        table = machine.table(caption, columns, rows)
        path = machine.write_result(args.record, "Tool calls streamed as they are written", machine.invocation(), [table])
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

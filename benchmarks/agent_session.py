"""An agent CLI holding a multi-turn, tool-using session against `moestream serve`, through the Responses API
(Codex CLI) or Anthropic's Messages API (Claude Code).

    python benchmarks/agent_session.py STORE [--agent codex|claude] [--codex PATH] [--claude PATH] [--prompt TEXT]
                                             [--force-tool] [--slim] [--record]
                                             [--serve-args "--memory 64MiB --default-max-tokens 256"] [--out DIR]

Both agents are native binaries from npm, not dependencies of this project, and both resend the whole
history each turn. Starts `moestream serve STORE` on a free port and a logging proxy in front of it, and a
work dir with two files under `git init`, then runs the agent there with stdin from /dev/null:
- codex (`npm install @openai/codex`) speaks only `POST /v1/responses`, always streamed. A fresh CODEX_HOME
  (a custom provider with wire_api "responses", no approvals or sandbox, no updates, analytics or plugins, no
  retries, a one-hour idle timeout); `codex exec --skip-git-repo-check -C WORKDIR -m NAME PROMPT`. Codex
  prints a harmless warning that the model's metadata is unknown (and, with CODEX_HOME under /tmp, that it
  could not create PATH aliases).
- claude (`npm install @anthropic-ai/claude-code`) speaks only `POST /v1/messages?beta=true`, streamed. A
  fresh HOME, ANTHROPIC_BASE_URL at the proxy, an API key, DISABLE_TELEMETRY=1 and
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 (nothing reached but the base URL), and
  CLAUDE_CODE_MAX_CONTEXT_TOKENS set to the window /v1/models reports (`max_model_len`; without it Claude Code
  warns that it does not know the model and assumes 1M tokens) and CLAUDE_CODE_MAX_OUTPUT_TOKENS to an eighth
  of it unless set (with its default 32,000 reserved for the answer, a 32k window holds no prompt and it
  compacts the conversation every turn); `claude -p PROMPT --model NAME --allowedTools Bash`.

Prints one row per request: its status, input, cached and output tokens, the output item types, the
function calls, whether the next request carried each call's function_call_output (its first line and
exit line), and the seconds to its first streamed delta (time to first token: the first turn's is the
agent's whole prompt prefilled) and to its end; then Codex's exit code and final message. Exits with Codex's exit code. Every request body
(as Codex sent it and as forwarded), every SSE answer, the server's and Codex's output are kept in --out.

--force-tool is a test harness for tiny stores: a tiny model never calls a tool by itself, so the proxy
FORCES the call by rewriting requests. Turn 1 (no tool output yet): the tool choice is the agent's shell tool
(codex's exec_command, whose `cmd` is restricted to the enum ["ls", "pwd"]; claude's Bash, its `command`
so restricted), other properties dropped, one call. Later turns: the answer's format is a JSON schema
{"done": true} (text.format, output_config.format), so that the grammar ends the answer. The session then
shows the protocol working (a call streamed, run by the agent, its output sent back, the shared prefix
reused), not the model's judgement. --slim drops the multi_agent namespace, web_search and goals tools from
Codex's config (a prompt of ~6k instead of ~10k tokens of Codex's text). --record writes the table as this
machine's record of agent-sessions (one table per agent).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import machine

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "host"}
DONE = {"type": "object", "properties": {"done": {"const": True}}, "required": ["done"], "additionalProperties": False}


def force(path: str, body: dict) -> str:
    """Rewrites an agent's request in place as --force-tool says; returns what it did."""
    return force_messages(body) if "/messages" in path else force_responses(body)


# The shell tool's one argument, restricted in every turn (a schema that changed between turns would change
# the prompt's tools, and with them the prefix the next turn could reuse).
ENUM = {"type": "string", "enum": ["ls", "pwd"]}


def force_messages(body: dict) -> str:
    """--force-tool on a Messages request: Bash with `command` in [ls, pwd] until a tool_result comes back."""
    for tool in body.get("tools", []):
        if tool.get("name") == "Bash":
            schema = {"properties": {"command": ENUM}, "required": ["command"], "additionalProperties": False}
            tool["input_schema"] = {"type": "object", **schema}
    blocks = [b for m in body.get("messages") or [] if isinstance(m.get("content"), list) for b in m["content"]]
    if not any(isinstance(b, dict) and b.get("type") == "tool_result" for b in blocks):
        body["tool_choice"] = {"type": "tool", "name": "Bash", "disable_parallel_tool_use": True}
        return "forced Bash, command in [ls, pwd]"
    body["output_config"] = {**(body.get("output_config") or {}), "format": {"type": "json_schema", "schema": DONE}}
    return 'output_config.format {"done": true}'


def force_responses(body: dict) -> str:
    """--force-tool on a Responses request: exec_command with `cmd` in [ls, pwd] until its output comes back."""
    for tool in body.get("tools", []):
        if tool.get("type") == "function" and tool.get("name") == "exec_command":
            tool["parameters"].update(properties={"cmd": ENUM}, required=["cmd"], additionalProperties=False)
    if not any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body.get("input") or []):
        body["tool_choice"], body["parallel_tool_calls"] = {"type": "function", "name": "exec_command"}, False
        return "forced exec_command, cmd in [ls, pwd]"
    body["text"] = {"format": {"type": "json_schema", "name": "done", "schema": DONE}}
    return 'text.format {"done": true}'


def start_proxy(upstream: str, out: Path, rewrite: bool) -> ThreadingHTTPServer:
    """A proxy on a free port that logs every request and streams every answer through unchanged."""
    host, port = upstream.split("//")[1].split(":")
    lock, count = threading.Lock(), [0]
    (out / "http").mkdir(parents=True, exist_ok=True)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def forward(self):
            with lock:
                count[0] += 1
                n = count[0]
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            note, stem = "", out / "http" / f"{n:03d}"
            if rewrite and self.command == "POST" and self.path.split("?")[0].rstrip("/").endswith(("/responses", "/messages")):
                stem.with_name(f"{n:03d}_request_orig.json").write_bytes(body)
                parsed = json.loads(body)
                note = force(self.path, parsed)
                body = json.dumps(parsed).encode()
            stem.with_name(f"{n:03d}_request.json").write_bytes(body)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            start, size, conn = time.monotonic(), 0, http.client.HTTPConnection(host, int(port), timeout=None)
            conn.request(self.command, self.path, body=body or None, headers={**headers, "Content-Length": str(len(body))})
            answer = conn.getresponse()
            self.send_response(answer.status, answer.reason)
            for k, v in answer.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("Connection", "close")  # the answer ends when the connection does: no re-chunking
            self.end_headers()
            self.close_connection = True
            (out / "http" / f"{n:03d}_meta.json").write_text(json.dumps({"path": self.path, "status": answer.status}))
            first = None  # seconds from the request to the first streamed delta (text, tool arguments, reasoning)
            with stem.with_name(f"{n:03d}_response.txt").open("wb") as log:
                while chunk := answer.read1(65536):
                    if first is None and (b"_delta" in chunk or b".delta" in chunk):
                        first = time.monotonic() - start
                    size += len(chunk)
                    log.write(chunk)
                    try:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    except OSError:
                        note += " (client went away)"
                        break
            conn.close()
            meta = {"path": self.path, "status": answer.status, "first_delta_s": first, "seconds": time.monotonic() - start}
            (out / "http" / f"{n:03d}_meta.json").write_text(json.dumps(meta))
            print(
                f"[proxy] #{n} {self.command} {self.path} -> {answer.status}, {size} B in {time.monotonic() - start:.2f} s {note}"
            )

        do_GET = do_POST = do_HEAD = forward

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    return proxy


CONFIG = """model = "{name}"
model_provider = "moestream"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false
{slim_top}
[analytics]
enabled = false

[features]
plugins = false
apps = false
remote_plugin = false
tool_suggest = false
{slim_features}
[model_providers.moestream]
name = "moestream"
base_url = "{base_url}"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = 3600000
"""


def codex_config(name: str, base_url: str, slim: bool) -> str:
    """Codex's config.toml: a custom Responses provider, nothing asked, nothing reached but base_url."""
    slim_top, slim_features = ('web_search = "disabled"\n', "goals = false\n\n[agents]\nenabled = false\n") if slim else ("", "")
    return CONFIG.format(name=name, base_url=base_url, slim_top=slim_top, slim_features=slim_features)


def messages_row(events: list[dict], later: dict) -> list[str]:
    """A Messages API turn: its prompt (input + cache_read), cached and output tokens, its content blocks, the
    tool_use calls, and whether the next request carried each call's tool_result."""
    usage = next((e.get("usage") or {} for e in events if e.get("type") == "message_delta"), {})
    blocks, calls = [], {}
    for e in events:
        if e.get("type") == "content_block_start":
            block = e["content_block"]
            blocks.append(block["type"])
            if block["type"] == "tool_use":
                calls[e["index"]] = [block["id"], block["name"], ""]
        elif e.get("type") == "content_block_delta" and e["delta"].get("type") == "input_json_delta":
            calls[e["index"]][2] += e["delta"]["partial_json"]
    results = {}
    for message in later.get("messages") or []:
        for block in message.get("content") if isinstance(message.get("content"), list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                content = block.get("content")
                results[block["tool_use_id"]] = content if isinstance(content, str) else json.dumps(content)
    carried = [
        f"yes: {results[i].splitlines()[0] if results[i] else ''!r}" if i in results else "no" for i, _, _ in calls.values()
    ]
    prompt = (usage.get("input_tokens") or 0) + (usage.get("cache_read_input_tokens") or 0)
    numbers = [prompt if usage else "", usage.get("cache_read_input_tokens", ""), usage.get("output_tokens", "")]
    calls_text = "; ".join(f"{name}({arguments})" for _, name, arguments in calls.values())
    return [*map(str, numbers), ",".join(blocks), calls_text, "; ".join(carried)]


def summary(http_dir: Path) -> list[list[str]]:
    """One row per request the proxy logged, from its saved bodies."""
    rows, requests = [], sorted(http_dir.glob("*_meta.json"))
    for i, meta_file in enumerate(requests):
        meta, n = json.loads(meta_file.read_text()), meta_file.name[:3]
        events = [
            json.loads(line[5:]) for line in (http_dir / f"{n}_response.txt").read_text().splitlines() if line.startswith("data:")
        ]
        if "/messages" in meta["path"]:
            later_file = http_dir / f"{requests[i + 1].name[:3]}_request.json" if i + 1 < len(requests) else None
            text = later_file.read_text() if later_file else ""
            later = json.loads(text) if text.startswith("{") else {}
            rows.append([n, meta["path"], str(meta["status"]), *messages_row(events, later), *timing(meta)])
            continue
        usage = next((e["response"].get("usage") or {} for e in events if e.get("type") == "response.completed"), {})
        items = [e["item"] for e in events if e.get("type") == "response.output_item.done"]
        calls = [item for item in items if item["type"] == "function_call"]
        outputs = {}
        later = (http_dir / f"{requests[i + 1].name[:3]}_request.json").read_text() if i + 1 < len(requests) else ""
        if later.startswith("{"):
            later = json.loads(later)
            outputs = {x["call_id"]: x["output"] for x in later.get("input", []) if x.get("type") == "function_call_output"}
        carried = []
        for call in calls:
            text = outputs.get(call["call_id"])
            text = text if isinstance(text, str) or text is None else json.dumps(text)
            lines = (text or "").splitlines()
            exit_line = next((line for line in lines if line.startswith("Process exited")), "")
            carried.append("no" if text is None else f"yes: {lines[0] if lines else ''!r} {exit_line}".strip())
        details = usage.get("input_tokens_details") or {}
        numbers = [
            meta["status"],
            usage.get("input_tokens", ""),
            details.get("cached_tokens", ""),
            usage.get("output_tokens", ""),
        ]
        calls_text = "; ".join(f"{c['name']}({c['arguments']})" for c in calls)
        rows.append(
            [
                n,
                meta["path"],
                *map(str, numbers),
                ",".join(i["type"] for i in items),
                calls_text,
                "; ".join(carried),
                *timing(meta),
            ]
        )
    return rows


def timing(meta: dict) -> list[str]:
    """A request's seconds to its first streamed delta (its time to first token, the prompt's prefill
    included) and to its end, as the proxy saw them."""
    first = meta.get("first_delta_s")
    return ["" if first is None else f"{first:.1f}", f"{meta.get('seconds', 0):.1f}"]


def agent_command(args, agent_bin: str, home: Path, work: Path, out: Path, base: str, window: int) -> tuple[list[str], dict]:
    """The agent's command line and environment, pointed at `base` (the proxy, without /v1); `window`: the
    context window the server reports."""
    if args.agent == "codex":
        (home / "config.toml").write_text(codex_config(args.model_name, base + "/v1", args.slim))
        command = [agent_bin, "exec", "--skip-git-repo-check", "-C", str(work), "-m", args.model_name]
        return [*command, "-o", str(out / "last_message.txt"), args.prompt], {**os.environ, "CODEX_HOME": str(home)}
    # The served window, which Claude Code otherwise guesses as 1M tokens, and room for its answers that
    # leaves its prompt in the window: with its default 32,000 it would compact the conversation every turn.
    env = {
        **os.environ,
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(window),
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": os.environ.get("CLAUDE_CODE_MAX_OUTPUT_TOKENS", str(min(32000, window // 8))),
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": "local",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    }
    return [agent_bin, "-p", args.prompt, "--model", args.model_name, "--allowedTools", "Bash"], env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--agent", choices=("codex", "claude"), default="codex", help="which agent CLI (default codex)")
    parser.add_argument("--codex", default="codex", help="the codex executable (default: codex on PATH)")
    parser.add_argument("--claude", default="claude", help="the claude executable (default: claude on PATH)")
    parser.add_argument("--prompt", default="Run ls and tell me what you see.")
    parser.add_argument("--force-tool", action="store_true", help="force a shell call (tiny models)")
    parser.add_argument("--slim", action="store_true", help="codex: no namespace, web_search and goals tools")
    parser.add_argument("--serve-args", default="", help="extra arguments for moestream serve")
    parser.add_argument("--model-name", default="local")
    parser.add_argument("--out", type=Path, help="where logs and bodies go (default: a new temporary directory, kept)")
    machine.add_record_argument(parser, "agent-sessions")
    args = parser.parse_args()
    package = {"codex": "@openai/codex", "claude": "@anthropic-ai/claude-code"}[args.agent]
    if not (agent_bin := shutil.which(getattr(args, args.agent))):  # (made absolute below: the agent runs in WORKDIR)
        raise SystemExit(
            f"no {args.agent} executable: `npm install {package}`, then pass --{args.agent} node_modules/.bin/{args.agent}"
        )
    agent_bin = os.path.abspath(agent_bin)
    version = subprocess.run([agent_bin, "--version"], capture_output=True, text=True).stdout.strip()
    out = (args.out or Path(tempfile.mkdtemp(prefix="agent_session-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"{args.agent} {version}; logs in {out}")
    work, home = out / "work", out / f"{args.agent}-home"
    for path in (work, home, out / "http"):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
    (work / "notes.txt").write_text("hello\n")
    (work / "script.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q", str(work)], check=True)

    log, server, proxy, agent = out / "server.log", None, None, None
    command = [sys.executable, "-m", "moestream.cli", "serve", args.store, "--port", "0", "--model-name", args.model_name]
    transcript_lines: list[str] = []
    try:
        server = subprocess.Popen([*command, *shlex.split(args.serve_args)], stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not (match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        proxy = start_proxy(match.group(1), out, args.force_tool)
        base = f"http://127.0.0.1:{proxy.server_address[1]}"
        print(f"server {match.group(1)}, proxy {base}, agent home {home}", flush=True)
        with urllib.request.urlopen(match.group(1) + "/v1/models") as answer:
            window = json.load(answer)["data"][0]["max_model_len"]
        argv, env = agent_command(args, agent_bin, home, work, out, base, window)
        with (out / f"{args.agent}.out").open("w") as transcript:
            agent = subprocess.Popen(
                argv, cwd=work, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            for line in agent.stdout:
                print(line, end="", flush=True)
                transcript.write(line)
                transcript_lines.append(line)
            rc = agent.wait()
    finally:
        if agent and agent.poll() is None:
            agent.kill()
        if proxy:
            proxy.shutdown()
            proxy.server_close()
        if server:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

    output = "content blocks" if args.agent == "claude" else "output items"
    carried = "next request's tool_result" if args.agent == "claude" else "next request's function_call_output"
    head = ["#", "path", "status", "in", "cached", "out", output, "tool calls", carried, "first token s", "total s"]
    rows = summary(out / "http")
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    print()
    for row in [head, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    final_file = out / "last_message.txt"
    final = final_file.read_text().strip() if final_file.exists() else "".join(transcript_lines[-3:]).strip()
    print(f"\n{args.agent} exit code {rc}; final message: {final!r}")
    if args.record:
        forced = " (the calls forced by --force-tool)" if args.force_tool else ""
        caption = f"{args.agent} {version} against `moestream serve`{forced}, one row per request it sent:"
        notes = f"{args.agent}: exit code {rc}, final message {final[:80]!r}."
        table = machine.table(caption, head[1:], [row[1:] for row in rows])
        path = machine.write_result(args.record, "Agent CLIs against the server", machine.invocation(), [table], notes)
        print(f"wrote {path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""An agent CLI holding a multi-turn, tool-using session against `moestream serve`, through the Responses API.

    python benchmarks/agent_session.py STORE [--codex PATH] [--prompt TEXT] [--force-tool] [--slim]
                                             [--serve-args "--memory 64MiB --default-max-tokens 256"] [--out DIR]

The agent is OpenAI's Codex CLI (`npm install @openai/codex`; a native binary, not a dependency of this
project), which speaks only `POST /v1/responses`, always streamed, resending the whole history each turn.
Starts `moestream serve STORE` on a free port and a logging proxy in front of it, writes a fresh CODEX_HOME
(a custom provider with wire_api "responses", no approvals or sandbox, no updates, analytics or plugins, no
retries, a one-hour idle timeout) and a work dir with two files under `git init`, then runs
`codex exec --skip-git-repo-check -C WORKDIR -m NAME PROMPT` with stdin from /dev/null. Codex prints a
harmless warning that the model's metadata is unknown (and, with CODEX_HOME under /tmp, that it could not
create PATH aliases).

Prints one row per request: its status, input, cached and output tokens, the output item types, the
function calls, and whether the next request carried each call's function_call_output (its first line and
exit line); then Codex's exit code and final message. Exits with Codex's exit code. Every request body
(as Codex sent it and as forwarded), every SSE answer, the server's and Codex's output are kept in --out.

--force-tool is a test harness for random-weight stores: a random model never calls a tool by itself, so
the proxy FORCES the call by rewriting requests. Turn 1 (no function_call_output yet): tool_choice is set
to exec_command, whose `cmd` is restricted to the enum ["ls", "pwd"] (other properties dropped), and
parallel_tool_calls to false. Later turns: text.format is a JSON schema {"done": true}, so that the grammar
ends the answer. The session then shows the protocol working (a call streamed, run by Codex, its output
sent back, the shared prefix reused), not the model's judgement. --slim drops the multi_agent namespace,
web_search and goals tools from Codex's config (a prompt of ~6k instead of ~10k tokens of Codex's text).
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length", "host"}
DONE = {"type": "object", "properties": {"done": {"const": True}}, "required": ["done"], "additionalProperties": False}


def force(body: dict) -> str:
    """Rewrites a Responses request in place as --force-tool says; returns what it did."""
    if not any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in body.get("input") or []):
        body["tool_choice"], body["parallel_tool_calls"] = {"type": "function", "name": "exec_command"}, False
        for tool in body.get("tools", []):
            if tool.get("type") == "function" and tool.get("name") == "exec_command":
                tool["parameters"].update(
                    properties={"cmd": {"type": "string", "enum": ["ls", "pwd"]}}, required=["cmd"], additionalProperties=False
                )
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
            if rewrite and self.command == "POST" and self.path.rstrip("/").endswith("/responses"):
                stem.with_name(f"{n:03d}_request_orig.json").write_bytes(body)
                parsed = json.loads(body)
                note = force(parsed)
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
            with stem.with_name(f"{n:03d}_response.txt").open("wb") as log:
                while chunk := answer.read1(65536):
                    size += len(chunk)
                    log.write(chunk)
                    try:
                        self.wfile.write(chunk)
                        self.wfile.flush()
                    except OSError:
                        note += " (client went away)"
                        break
            conn.close()
            print(
                f"[proxy] #{n} {self.command} {self.path} -> {answer.status}, {size} B in {time.monotonic() - start:.2f} s {note}"
            )

        do_GET = do_POST = forward

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


def summary(http_dir: Path) -> list[list[str]]:
    """One row per request the proxy logged, from its saved bodies."""
    rows, requests = [], sorted(http_dir.glob("*_meta.json"))
    for i, meta_file in enumerate(requests):
        meta, n = json.loads(meta_file.read_text()), meta_file.name[:3]
        events = [
            json.loads(line[5:]) for line in (http_dir / f"{n}_response.txt").read_text().splitlines() if line.startswith("data:")
        ]
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
        rows.append([n, meta["path"], *map(str, numbers), ",".join(i["type"] for i in items), calls_text, "; ".join(carried)])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("--codex", default="codex", help="the codex executable (default: codex on PATH)")
    parser.add_argument("--prompt", default="Run ls and tell me what you see.")
    parser.add_argument("--force-tool", action="store_true", help="force an exec_command call (random-weight models)")
    parser.add_argument("--slim", action="store_true", help="no namespace, web_search and goals tools")
    parser.add_argument("--serve-args", default="", help="extra arguments for moestream serve")
    parser.add_argument("--model-name", default="local")
    parser.add_argument("--out", type=Path, help="where logs and bodies go (default: a new temporary directory, kept)")
    args = parser.parse_args()
    if not (codex_bin := shutil.which(args.codex)):
        raise SystemExit("no codex executable: `npm install @openai/codex`, then pass --codex node_modules/.bin/codex")
    out = (args.out or Path(tempfile.mkdtemp(prefix="agent_session-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"logs in {out}")
    work, home = out / "work", out / "codex-home"
    for path in (work, home):
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
    (work / "notes.txt").write_text("hello\n")
    (work / "script.py").write_text("print(1)\n")
    subprocess.run(["git", "init", "-q", str(work)], check=True)

    log, server, proxy, agent = out / "server.log", None, None, None
    command = [sys.executable, "-m", "moestream.cli", "serve", args.store, "--port", "0", "--model-name", args.model_name]
    try:
        server = subprocess.Popen([*command, *shlex.split(args.serve_args)], stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not (match := re.search(r"at (http://127\.0\.0\.1:\d+)/v1", log.read_text())):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start:\n{log.read_text()}")
            time.sleep(0.1)
        proxy = start_proxy(match.group(1), out, args.force_tool)
        base_url = f"http://127.0.0.1:{proxy.server_address[1]}/v1"
        (home / "config.toml").write_text(codex_config(args.model_name, base_url, args.slim))
        print(f"server {match.group(1)}, proxy {base_url}, CODEX_HOME {home}", flush=True)
        codex = [codex_bin, "exec", "--skip-git-repo-check", "-C", str(work), "-m", args.model_name]
        codex += ["-o", str(out / "last_message.txt"), args.prompt]
        with (out / "codex.out").open("w") as transcript:
            env = {**os.environ, "CODEX_HOME": str(home)}
            agent = subprocess.Popen(
                codex, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
            )
            for line in agent.stdout:
                print(line, end="", flush=True)
                transcript.write(line)
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

    head = ["#", "path", "status", "in", "cached", "out", "output items", "function calls", "next request's function_call_output"]
    rows = [head, *summary(out / "http")]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    final = out / "last_message.txt"
    print(f"\ncodex exit code {rc}; final message: {final.read_text().strip() if final.exists() else '(none)'!r}")
    return rc


if __name__ == "__main__":
    sys.exit(main())

"""`moestream chat`: a conversation in the terminal, through the checkpoint's chat template.

Each answer is a request of a serving scheduler of the session's own (serving.py, the same one the
server steps, with one row), and streams as it is generated. The conversation is kept, and so is its KV cache (a `kv_cache.PrefixCache` under --kv-memory): each
answer's prefill feeds only the tokens after what the last one left, so the time to the first token does
not grow with the conversation. When the conversation outgrows the model's context the oldest exchanges
are dropped, with a note, and the kept KV with them (the conversation no longer starts as it did). Ctrl-C while an answer streams stops that answer (the SIGINT handler only sets the cancel flag,
checked between tokens, so no exception ever interrupts the engine mid-read); at the prompt it only
reminds how to leave. /stats, /reset and /exit are commands.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import replace
from typing import Callable, TextIO

import torch

from ..core.memory import current_rss_bytes, peak_rss_bytes
from ..core.runtime import runtime_of
from ..units import format_bytes
from .generate import (
    Decoding,
    GenerationResult,
    SamplingParams,
    chat_prompt,
    context_length,
    decode_rate,
    encode,
    has_chat_template,
)
from .kv_cache import PrefixCache
from .kv_disk import DiskTier
from .serving import Request, Scheduler, run_until_idle

HISTORY = "chat.json"  # the last chat's messages, in its store's KV tier directory (`ChatSession.resume`)
COMMANDS = {
    "/stats": "hit rate, MB read, tokens/s, memory",
    "/reset": "start a new conversation",
    "/exit": "leave, as Ctrl-D does",
}


class ChatSession:
    """The conversation and its statistics; `ask` adds one exchange."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        system: str | None = None,
        params: SamplingParams | None = None,
        kv_memory: int = 2**30,
        kv_disk: DiskTier | None = None,
    ):
        self.model = model
        self.prefix_cache = PrefixCache(kv_memory, disk=kv_disk) if kv_memory > 0 else None
        self.scheduler = Scheduler(model, max_batch=1, prefix_cache=self.prefix_cache)
        self.tokenizer = tokenizer
        self.system = system
        params = params or SamplingParams(512, temperature=0.7, top_p=0.95)  # the command's defaults
        self.params = replace(params, seed=None)  # (the seed is the conversation's: see reset)
        self.seed = params.seed
        self.context = context_length(model)
        self.answers = 0
        self.tokens = 0
        self.decoded = 0  # tokens after each answer's first, and the seconds they took (generate.Timing)
        self.decode_seconds = 0.0
        self.last: GenerationResult | None = None
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        if self.seed is not None:
            # Seeded once per conversation, not per answer: the same questions give the same conversation.
            torch.manual_seed(self.seed)

    def ask(
        self,
        text: str,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        notice: Callable[[str], None] = print,
    ) -> GenerationResult | None:
        """Answer `text` in the conversation; None (with a notice) if it cannot fit in the context."""
        self.messages.append({"role": "user", "content": text})
        ids, max_new = self._fit(notice)
        if ids is None:
            self.messages.pop()
            return None
        params = replace(self.params, max_tokens=max_new)
        decoding = Decoding(self.model, self.tokenizer, ids, params, on_text=on_text, cancel=cancel or threading.Event())
        self.scheduler.add(Request.of(decoding))
        run_until_idle(self.scheduler)
        result = decoding.result()
        # A stopped answer stays as far as it went: it is what the user saw.
        self.messages.append({"role": "assistant", "content": result.text})
        self.answers += 1
        self.tokens += len(result.token_ids)
        if result.timing is not None:
            self.decoded += max(0, result.timing.new_tokens - 1)
            self.decode_seconds += result.timing.decode_seconds
        self.last = result
        return result

    def _fit(self, notice) -> tuple[list[int] | None, int]:
        while True:
            ids = encode(self.tokenizer, chat_prompt(self.tokenizer, self.messages), templated=True)
            if self.context is None or len(ids) + self.params.max_tokens <= self.context:
                return ids, self.params.max_tokens
            first = 1 if self.messages[0]["role"] == "system" else 0
            if len(self.messages) - first > 1:
                # Drop the oldest exchange: its user message and what followed it up to the next user message.
                end = first + 1
                while end < len(self.messages) - 1 and self.messages[end]["role"] != "user":
                    end += 1
                del self.messages[first:end]
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()  # its KV starts with what was dropped: it can never be reused
                notice(f"(dropped the oldest exchange to fit the model's {self.context}-token context)")
                continue
            room = self.context - len(ids)
            if room >= 1:
                return ids, min(room, self.params.max_tokens)
            notice(
                f"(that message is {len(ids)} tokens with the template; the model's context is {self.context}: send a shorter one)"
            )
            return None, 0

    def stats_text(self) -> str:
        s = runtime_of(self.model).stats()
        lines = []
        if self.last is not None:
            r = self.last
            lines.append(
                f"last answer: {len(r.token_ids)} tokens in {r.seconds:.2f} s, {r.decode_tokens_per_second:.1f} tok/s decode, "
                f"first token after {r.time_to_first_token:.2f} s"
            )
        rate = decode_rate(self.decoded, self.decode_seconds)
        lines.append(
            f"this session: {self.answers} answer{'s' if self.answers != 1 else ''}, {self.tokens} tokens, {rate:.1f} tok/s decode; experts: hit rate "
            f"{s['hit_rate']:.1%}, {s['bytes_read'] / 1e6:.1f} MB read from disk"
        )
        lines.append(
            f"memory: RSS {format_bytes(current_rss_bytes())} now, {format_bytes(peak_rss_bytes())} peak; expert cache "
            f"budget {format_bytes(s['cache_budget_bytes'])}, {s['cached_experts']} of {s['cache_slots']} slots filled"
        )
        if self.prefix_cache is not None:
            kv = self.prefix_cache.stats()
            lines.append(
                f"kept KV: {format_bytes(kv.bytes)} of {format_bytes(self.prefix_cache.budget_bytes)} (--kv-memory); "
                f"{kv.tokens_reused} prompt tokens reused instead of prefilled"
            )
            if self.prefix_cache.disk is not None:
                disk = self.prefix_cache.disk.stats()
                lines.append(
                    f"KV on disk: {format_bytes(disk.bytes)} of {format_bytes(self.prefix_cache.disk.budget_bytes)} in "
                    f"{self.prefix_cache.disk.directory} (--kv-disk); {disk.hits} prefixes read back, {disk.tokens_reused} tokens"
                )
        return "\n".join(lines)

    def close(self) -> None:
        """At the end of a chat: the conversation's KV goes to the disk tier, where the next chat finds it, and
        its messages beside it (`HISTORY`), for `resume`."""
        if self.prefix_cache is None or self.prefix_cache.disk is None:
            return
        self.prefix_cache.flush()
        path = self.prefix_cache.disk.directory / HISTORY
        temporary = path.with_suffix(".tmp")
        try:
            temporary.write_text(json.dumps({"format": 1, "messages": self.messages}))
            os.replace(temporary, path)
        except OSError as e:
            print(f"(could not keep the conversation for --resume: {e})", file=sys.stderr)

    def resume(self) -> int:
        """Continue the conversation the last chat on this store left (`close` kept its messages beside its KV,
        so the next answer prefills only the new message); the number of messages, 0 where there is none."""
        if self.prefix_cache is None or self.prefix_cache.disk is None:
            return 0
        try:
            saved = json.loads((self.prefix_cache.disk.directory / HISTORY).read_text())
            messages = saved["messages"]
            if saved.get("format") != 1 or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in messages):
                return 0
        except (OSError, ValueError, KeyError, TypeError):
            return 0
        self.messages = messages
        return len(messages)


@contextmanager
def _ctrl_c_sets(cancel: threading.Event):
    """While an answer streams, Ctrl-C sets `cancel` instead of raising KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def banner(session: ChatSession, name: str) -> str:
    s = runtime_of(session.model).stats()
    lines = [
        f"moestream chat: {name}, expert cache {format_bytes(s['cache_budget_bytes'])}",
        "commands: " + ", ".join(f"{c} ({h})" for c, h in COMMANDS.items()) + ". Ctrl-C stops an answer.",
    ]
    if not has_chat_template(session.tokenizer):
        lines.append("this checkpoint has no chat template: using moestream's plain 'User: ... Assistant:' format")
    return "\n".join(lines)


def run_chat(session: ChatSession, read: Callable[[str], str] = input, out: TextIO | None = None) -> int:
    """The loop: read a line, run a command or answer it. Returns when the user leaves."""
    out = out or sys.stdout

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    def show(piece: str) -> None:
        out.write(piece)
        out.flush()

    while True:
        try:
            line = read("> ")
        except EOFError:
            say("")
            return 0
        except KeyboardInterrupt:
            say("\n(Ctrl-C stops an answer; /exit or Ctrl-D leaves)")
            continue
        command = line.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            session.reset()
            say("(new conversation)")
            continue
        if command == "/stats":
            say(session.stats_text())
            continue
        if re.fullmatch(r"/[A-Za-z]+", command):
            say("(commands: " + ", ".join(f"{c} {h}" for c, h in COMMANDS.items()) + ")")
            continue
        cancel = threading.Event()
        with _ctrl_c_sets(cancel):
            result = session.ask(line, on_text=show, cancel=cancel, notice=say)
        if result is not None:
            say("" if result.finish_reason != "cancelled" else "\n(stopped)")

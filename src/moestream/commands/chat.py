"""`moestream chat`: its options and what it runs (the work itself: moestream.generation.chat)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UsageError
from ..options import (
    add_chat_template_argument,
    add_kv_disk_arguments,
    add_kv_memory_argument,
    add_sampling_arguments,
    add_store_arguments,
    kv_disk_directory,
    load_model,
    positive,
    sampling_params,
)
from ..units import parse_bytes

DESCRIPTION = (
    "A conversation in the terminal. Each message goes through the checkpoint's chat template "
    "(a plain 'User: ... Assistant:' format when it has none) with the conversation so far; the answer "
    "streams as it is generated. When the conversation outgrows the model's context, the oldest exchanges "
    "are dropped. The conversation's KV cache is kept between answers (--kv-memory), so each prefill feeds only "
    "the new message, and it goes to a tier on disk when it leaves RAM or the chat ends (--kv-disk), so a later chat "
    "that starts the same way reads it instead of prefilling it. Commands: /stats (hit rate, MB read, tokens/s, RSS), /reset (new conversation), /exit "
    "(or Ctrl-D). Ctrl-C stops the current answer, not the program."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--system", default=None, help="a system message that opens every conversation")
    add_sampling_arguments(
        parser, max_new_tokens=512, seed_help="seed the conversation's sampling: the same messages give the same answers"
    )
    add_kv_memory_argument(parser)
    add_kv_disk_arguments(parser)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the conversation the last chat on this store left (kept beside its KV on disk at the end of "
        "every chat), without prefilling it again",
    )
    add_chat_template_argument(parser)


def run(args: argparse.Namespace) -> int:
    from ..generation.chat import ChatSession, banner, run_chat
    from ..generation.kv_disk import tier_for

    params = sampling_params(args)
    kv_memory = parse_bytes(args.kv_memory)
    kv_disk_memory = positive(parse_bytes(args.kv_disk_memory), "--kv-disk-memory")
    if args.resume and (args.kv_disk == "off" or kv_memory == 0):
        raise UsageError(
            "--resume continues a conversation kept beside its KV on disk: leave out --kv-disk off and --kv-memory 0"
        )
    model, tokenizer = load_model(args)
    directory = kv_disk_directory(args.kv_disk, args.store) if kv_memory > 0 else None
    session = ChatSession(
        model,
        tokenizer,
        system=args.system,
        params=params,
        kv_memory=kv_memory,
        kv_disk=tier_for(model, directory, kv_disk_memory) if directory else None,
    )
    print(banner(session, Path(args.store).name), flush=True)
    if args.resume:
        resumed = session.resume()
        last = next((m["content"] for m in reversed(session.messages) if m["role"] == "assistant"), "")
        print(
            f"(resumed {resumed} messages; the last answer began: {last[:60]!r})"
            if resumed
            else "(no earlier chat of this store to resume)",
            flush=True,
        )
    try:
        return run_chat(session)
    finally:
        session.close()

"""The generation core shared by generate, chat and serve (stop sequences, incremental text, cancel),
and `moestream chat`: conversation kept, commands, Ctrl-C stops an answer and not the program."""

import io
import os
import signal
import subprocess
import sys
import threading

import pytest
from tiny import tiny_checkpoint

import moestream
from moestream.cli import main
from moestream.conversion.synthetic import byte_tokenizer
from moestream.generation.chat import ChatSession, run_chat
from moestream.generation.generate import FALLBACK_CHAT_TEMPLATE, IncrementalText, SamplingParams, chat_prompt, encode
from moestream.generation.serving import stream

BUDGET = 40 * 2**10


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    _, ckpt = tiny_checkpoint("qwen3_moe", root / "hf", seed=3)
    assert main(["convert", str(ckpt), str(root / "store"), "--experts-dtype", "fp32"]) == 0
    return root / "store"


@pytest.fixture(scope="module")
def loaded(store):
    return moestream.load(store, BUDGET)


def _pieces(tokenizer, text: str, stop=()):
    """Feed `text` byte token by byte token through IncrementalText; return the pieces handed out."""
    ids = encode(tokenizer, text)
    decoder = IncrementalText(tokenizer, stop)
    pieces = [decoder.update(ids[: n + 1]) for n in range(len(ids))]
    pieces.append(decoder.finish(ids))
    return pieces, decoder


def test_incremental_text_never_hands_out_half_a_character_or_half_a_stop():
    tok = byte_tokenizer()
    pieces, decoder = _pieces(tok, "naïve ☃ café")
    assert "".join(pieces) == "naïve ☃ café" and not any("\ufffd" in p for p in pieces)
    pieces, decoder = _pieces(tok, "one END two", stop=["ENDX", "END"])
    assert "".join(pieces) == "one " and decoder.stopped
    assert not any("E" in p for p in pieces)  # "E", "EN" were held back as possible starts of a stop
    pieces, decoder = _pieces(tok, "abc EN", stop=["END"])
    assert "".join(pieces) == "abc EN" and not decoder.stopped  # held back, then flushed at the end


def test_chat_prompt_uses_the_template_or_the_documented_fallback():
    tok = byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert chat_prompt(tok, messages) == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
    tok.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert chat_prompt(tok, messages) == "<system>Be brief.<user>Hi<assistant>"
    assert "Assistant:" in FALLBACK_CHAT_TEMPLATE


def test_stream_stops_cancels_and_counts(loaded):
    model, tok = loaded
    ids = encode(tok, "def f(x):")
    full = stream(model, tok, ids, SamplingParams.greedy(30))
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    pieces = []
    start = next(i for i in range(3, 27) if full.text[i : i + 2].isascii() and full.text[i : i + 2].isprintable())
    stop = full.text[start : start + 2]
    cut = stream(model, tok, ids, SamplingParams.greedy(30, stop=[stop]), on_text=pieces.append)
    assert cut.text == "".join(pieces) == full.text[: full.text.find(stop)]
    assert cut.finish_reason == "stop"
    # Generation ends at the token that completes the stop sequence, not one token later.
    assert len(tok.decode(cut.token_ids[:-1])) < full.text.find(stop) + len(stop) <= len(tok.decode(cut.token_ids))
    cancel = threading.Event()
    stopped = stream(model, tok, ids, SamplingParams.greedy(30), cancel=cancel, on_text=lambda _: cancel.set())
    assert stopped.finish_reason == "cancelled" and len(stopped.token_ids) < 30
    seeded = [stream(model, tok, ids, SamplingParams(20, temperature=1.0, top_p=0.9, seed=5)).token_ids for _ in range(2)]
    assert seeded[0] == seeded[1]


class _Screen(io.StringIO):
    """Terminal output that presses Ctrl-C (a real SIGINT) once the answer being written is long enough."""

    def __init__(self):
        super().__init__()
        self.interrupt_after: int | None = None

    def write(self, text):
        n = super().write(text)
        if self.interrupt_after is not None and len(self.getvalue()) >= self.interrupt_after:
            self.interrupt_after = None
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_chat_keeps_the_conversation_and_ctrl_c_stops_only_the_answer(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, params=SamplingParams.greedy(24))
    screen = _Screen()
    lines = iter(["Hello", "/stats", "And then?", "/unknown", "/reset", "Hello", "/exit", "never read"])

    def read(prompt):
        line = next(lines)
        if line == "And then?":
            screen.interrupt_after = len(screen.getvalue()) + 3  # Ctrl-C three characters into this answer
        return line

    assert run_chat(session, read=read, out=screen) == 0
    out = screen.getvalue()
    assert "hit rate" in out and "RSS" in out and "tok/s" in out
    assert "(stopped)" in out and "(new conversation)" in out and "/reset" in out
    assert next(lines) == "never read"
    # After /reset the conversation is the last exchange alone, and its answer is the first one again.
    assert [m["role"] for m in session.messages] == ["user", "assistant"]
    first = stream(
        model,
        tok,
        encode(tok, chat_prompt(tok, [{"role": "user", "content": "Hello"}]), templated=True),
        SamplingParams.greedy(24),
    )
    assert session.messages[1]["content"] == first.text
    assert session.answers == 3


def test_chat_sends_the_whole_conversation_and_drops_the_oldest_when_full(loaded):
    model, tok = loaded
    session = ChatSession(model, tok, system="Be brief.", params=SamplingParams.greedy(16))
    one = session.ask("first question")
    two = session.ask("second question")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": one.text},
        {"role": "user", "content": "second question"},
    ]
    expected = stream(model, tok, encode(tok, chat_prompt(tok, history), templated=True), SamplingParams.greedy(16))
    assert two.text == expected.text and two.prompt_tokens == expected.prompt_tokens
    # The second answer's prefill did not feed the first prompt again (the chat keeps its KV between
    # answers). The reuse goes on into the answer as far as its text, tokenized again, gives the ids
    # generated; this random model's answers hold invalid UTF-8, which does not.
    assert session.prefix_cache.stats().tokens_reused >= one.prompt_tokens
    notes = []
    session.ask("x" * 150, notice=notes.append)  # with the history, more than the 256-token context
    assert notes and "dropped the oldest exchange" in notes[0]
    kept = session.prefix_cache.stats()
    assert kept.entries == 1  # only the trimmed conversation's: the dropped history's KV went with it
    assert session.messages[0]["role"] == "system" and session.messages[1]["content"] == "x" * 150
    assert session.ask("y" * 300, notice=notes.append) is None and "shorter" in notes[-1]


def test_chat_command_line(store):
    """The command end to end: banner, an answer, /stats, /exit; Ctrl-D works as /exit."""
    run = subprocess.run(
        [sys.executable, "-m", "moestream.cli", "chat", str(store), "--memory", str(BUDGET), "--greedy", "--max-new-tokens", "8"],
        input="Hello\n/stats\n",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "moestream chat" in run.stdout and "hit rate" in run.stdout and "no chat template" in run.stdout


def test_a_chat_that_starts_as_an_earlier_one_did_reads_its_kv_from_the_disk_tier(loaded, tmp_path):
    """At its end a chat's KV goes to the tier on disk (`close`); a later chat with the same opening message
    reads that prefix instead of prefilling it, and answers the same."""
    from moestream.generation.kv_disk import tier_for

    model, tok = loaded
    first = ChatSession(model, tok, params=SamplingParams.greedy(12), kv_disk=tier_for(model, tmp_path, 2**30))
    answer = first.ask("Hello there", notice=lambda _: None)
    first.close()
    later = ChatSession(model, tok, params=SamplingParams.greedy(12), kv_disk=tier_for(model, tmp_path, 2**30))
    again = later.ask("Hello there", notice=lambda _: None)
    assert again.cached_tokens > 0 and later.prefix_cache.disk.stats().hits == 1
    assert again.text == answer.text
    assert "KV on disk" in later.stats_text()


def test_chat_resume_continues_the_last_conversation_from_its_kv_on_disk(loaded, tmp_path):
    """`close` keeps a chat's messages beside its KV; `resume` in a later chat continues it: the next answer
    prefills only the new message and is the one the first chat would have given."""
    from moestream.generation.kv_disk import tier_for

    model, tok = loaded

    def session():
        return ChatSession(model, tok, params=SamplingParams.greedy(10), kv_disk=tier_for(model, tmp_path, 2**30))

    whole = session()
    for text in ("Hello", "And then?"):
        whole.ask(text, notice=lambda _: None)
    whole.close()
    expected = whole.ask("One more", notice=lambda _: None)  # (the same session going on: its KV from RAM)

    first = ChatSession(model, tok, params=SamplingParams.greedy(10), kv_disk=tier_for(model, tmp_path / "b", 2**30))
    assert first.resume() == 0
    for text in ("Hello", "And then?"):
        first.ask(text, notice=lambda _: None)
    first.close()
    later = ChatSession(model, tok, params=SamplingParams.greedy(10), kv_disk=tier_for(model, tmp_path / "b", 2**30))
    assert later.resume() == 4 and later.messages == first.messages
    answer = later.ask("One more", notice=lambda _: None)
    before = len(encode(tok, chat_prompt(tok, first.messages[:3]), templated=True))  # the last answer's prompt
    assert answer.cached_tokens >= before and later.prefix_cache.disk.stats().hits == 1  # (read back, not prefilled)
    assert answer.text == expected.text

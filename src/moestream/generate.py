"""Text generation on a loaded model: the one generation core that `generate`, `chat` and `serve` share.

`stream()` runs transformers' `generate` on prompt token ids and hands each new piece of text to a
callback as soon as it is final; it honours stop sequences, max tokens, greedy or temperature/top-p
sampling with a seed, a cancel flag and a deadline (both checked between tokens), and reports the
timings users ask about. `chat_prompt()` turns chat messages into prompt text with the checkpoint's
chat template (or a documented fallback). `generate()` is the `moestream generate` command's call.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from .errors import UsageError
from .loading import engine_of
from .options import add_sampling_arguments, add_store_arguments, check_sampling, load_model, trace_output

# Used when a checkpoint ships no chat template (base models, the byte-level test tokenizer): plain
# "Role: text" paragraphs ending in "Assistant:", the format base models have seen most in their data.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Why a generation ended. "stop": the model's end-of-sequence token or a stop sequence; "length":
# max_new_tokens; "cancelled": the cancel flag (Ctrl-C, a client that disconnected); "timeout": the deadline.
FINISH_REASONS = ("stop", "length", "cancelled", "timeout")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(tokenizer, messages: Sequence[dict]) -> str:
    """Prompt text for `messages` ([{"role": ..., "content": ...}]), ending where the assistant's answer
    starts: the checkpoint's chat template, or FALLBACK_CHAT_TEMPLATE when it has none."""
    template = None if has_chat_template(tokenizer) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(list(messages), chat_template=template, tokenize=False, add_generation_prompt=True)


def encode(tokenizer, text: str, *, templated: bool = False) -> list[int]:
    """Token ids of `text`. Plain text is tokenized as `moestream generate` does (with the tokenizer's
    special tokens, e.g. BOS); text from a chat template already holds them, and adding them again would
    put a second BOS in front."""
    return list(tokenizer(text, add_special_tokens=not templated)["input_ids"])


def context_length(model) -> int | None:
    """The most positions (prompt + answer) the model is configured for, or None if it does not say."""
    config = model.config
    config = getattr(config, "get_text_config", lambda: config)()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class IncrementalText:
    """Decodes the growing list of new token ids into text that is final: never a trailing incomplete
    character (a byte-level token can end inside a UTF-8 sequence) nor the start of a stop sequence, and
    never anything from a stop sequence on. The pieces it returns concatenate to the whole answer, so a
    streamed answer and a collected one are the same string by construction."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.text = ""  # what has been handed out so far
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, ids: list[int]) -> str:
        """The new final text after the new token ids grew to `ids`; sets `stopped` on a stop sequence."""
        if self.stopped:
            return ""
        full = self._decode(ids)
        hits = [i for i in (full.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(full[: min(hits)])
        end = len(full)
        while end and full[end - 1] == "\ufffd":  # may still become a character with the next token
            end -= 1
        for k in range(min(end, max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(full[end - k : end]) for s in self.stop):
                end -= k  # may still become a stop sequence: hold it back
                break
        return self._take(full[:end])

    def finish(self, ids: list[int]) -> str:
        """Whatever was held back, once no more tokens will come."""
        return "" if self.stopped else self._take(self._decode(ids))

    def _take(self, upto: str) -> str:
        # A tokenizer whose decoding of a longer list rewrites earlier text (rare: some strip a leading
        # space) cannot take back what was handed out: only text past it is new.
        delta = upto[len(self.text) :]
        self.text += delta
        return delta


class _Steps(StoppingCriteria):
    """Called by transformers' generate loop once per new token, before it decides whether to go on:
    hands the token's final text out, and ends generation right after a stop sequence, the cancel flag
    or the deadline. (A streamer sees each token only after that decision, one forward pass too late.)"""

    def __init__(self, text: IncrementalText, on_text, cancel: threading.Event | None, deadline: float | None):
        self.text = text
        self.on_text = on_text
        self.cancel = cancel
        self.deadline = deadline
        self.ids: list[int] = []
        self.first_token_at: float | None = None
        self.reason: str | None = None

    def __call__(self, input_ids, scores, **kwargs):
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.append(int(input_ids[0, -1]))
        self.emit(self.text.update(self.ids))
        if self.reason is None:
            if self.text.stopped:
                self.reason = "stop"
            elif self.cancel is not None and self.cancel.is_set():
                self.reason = "cancelled"
            elif self.deadline is not None and time.monotonic() >= self.deadline:
                self.reason = "timeout"
        return torch.full((input_ids.shape[0],), self.reason is not None, dtype=torch.bool, device=input_ids.device)

    def emit(self, delta: str) -> None:
        if delta and self.on_text is not None:
            self.on_text(delta)


@dataclass
class GenerationResult:
    text: str
    prompt_tokens: int
    token_ids: list[int]
    seconds: float
    time_to_first_token: float
    decode_tokens_per_second: float
    finish_reason: str = "length"
    stats: dict = field(default_factory=dict)

    def summary(self) -> str:
        s = self.stats
        return (
            f"{len(self.token_ids)} tokens | {self.decode_tokens_per_second:.2f} tok/s decode | "
            f"TTFT {self.time_to_first_token:.2f}s | hit rate {s['hit_rate']:.1%} | "
            f"read {s['bytes_read'] / 1e6:.1f} MB | peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB"
        )


def _eos_ids(model, tokenizer) -> set[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def stream(
    model,
    tokenizer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 0.7,
    top_p: float = 0.95,
    seed: int | None = None,
    stop: Sequence[str] = (),
    on_text: Callable[[str], None] | None = None,
    cancel: threading.Event | None = None,
    deadline: float | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt_ids`, calling `on_text` with each final piece of text.

    greedy (or temperature 0) takes the most likely token; otherwise tokens are sampled at `temperature`
    from the smallest set whose probability reaches `top_p`. `seed` seeds torch's global generator first:
    callers run one generation at a time (the model is not thread-safe), so a seeded request gets the
    same answer whatever ran before it. `cancel` (a threading.Event) and `deadline` (time.monotonic())
    are checked after every token. The model is not touched otherwise: statistics keep accumulating.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, not {max_new_tokens}")
    if not prompt_ids:
        raise ValueError("the prompt is empty: generation needs at least one token to start from")
    if seed is not None:
        torch.manual_seed(seed)
    text = IncrementalText(tokenizer, stop)
    steps = _Steps(text, on_text, cancel, deadline)
    if greedy or temperature == 0:
        sampling = {"do_sample": False}
    else:
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            stopping_criteria=StoppingCriteriaList([steps]),
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            **sampling,
        )
    end = time.perf_counter()
    new = output[0, ids.shape[1] :].tolist()
    steps.emit(text.finish(new))
    if steps.reason is not None:
        reason = steps.reason
    elif len(new) < max_new_tokens or (new and new[-1] in _eos_ids(model, tokenizer)):
        reason = "stop"
    else:
        reason = "length"
    first = steps.first_token_at or end
    decode_rate = (len(new) - 1) / (end - first) if len(new) > 1 and end > first else 0.0
    return GenerationResult(
        text=text.text,
        prompt_tokens=len(prompt_ids),
        token_ids=new,
        seconds=end - start,
        time_to_first_token=first - start,
        decode_tokens_per_second=decode_rate,
        finish_reason=reason,
    )


def generate(
    model,
    tokenizer,
    prompt: str,
    max_new_tokens: int = 64,
    *,
    greedy: bool = False,
    temperature: float = 0.7,
    top_p: float = 0.95,
    seed: int | None = None,
    echo: bool = False,
) -> GenerationResult:
    """`moestream generate`: one prompt, statistics of this run only, text printed as it comes if `echo`."""
    engine = engine_of(model)
    engine.reset_stats()

    def show(piece: str) -> None:
        print(piece, end="", flush=True)

    result = stream(
        model,
        tokenizer,
        encode(tokenizer, prompt),
        max_new_tokens,
        greedy=greedy,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        on_text=show if echo else None,
    )
    if echo:
        print(flush=True)
    result.stats = engine.stats()
    return result


# ---- CLI: `moestream generate` (cli.py builds the subcommand from HELP, add_arguments and run) ----

HELP = "generate text, streaming experts under a memory budget"
DESCRIPTION = (
    "Generate a continuation of --prompt, streaming the text as it comes, then print tokens/s, time to first "
    "token, expert hit rate, MB read from disk and peak RSS (or, with --json, one JSON object with all of them)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_store_arguments(parser)
    parser.add_argument("--prompt", required=True, help="prompt text")
    add_sampling_arguments(parser, max_new_tokens=64)
    parser.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats) instead of streaming")
    parser.add_argument(
        "--trace-out",
        default=None,
        metavar="FILE.npz",
        help="record this run's routing (expert ids and weights per token and layer) for `moestream simulate`",
    )


def run(args: argparse.Namespace) -> int:
    from .trace import start_recording, stop_recording

    if not args.prompt:
        raise UsageError("--prompt is empty; generation needs some text to continue, e.g. --prompt 'Once upon a time'")
    check_sampling(args)
    if args.trace_out:
        trace_output(args.trace_out, "--trace-out")
    model, tokenizer = load_model(args)
    if not encode(tokenizer, args.prompt):
        raise UsageError(f"--prompt {args.prompt!r} has no tokens for this tokenizer; pass some text")
    recorder = start_recording(model) if args.trace_out else None  # routing recorded through the engine
    result = generate(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        echo=not args.json,
    )
    if args.json:
        out = {
            "text": result.text,
            "token_ids": result.token_ids,
            "prompt_tokens": result.prompt_tokens,
            "seconds": result.seconds,
            "time_to_first_token": result.time_to_first_token,
            "decode_tokens_per_second": result.decode_tokens_per_second,
            "stats": result.stats,
        }
        print(json.dumps(out))
    else:
        print(result.summary(), file=sys.stderr)
    if recorder is not None:
        stop_recording(model)
        print(f"wrote {recorder.trace(prompt=args.prompt).save(args.trace_out)}", file=sys.stderr)
    return 0

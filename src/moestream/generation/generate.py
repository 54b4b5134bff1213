"""One answer being generated, whatever runs it: what it asks for (`SamplingParams`), how its tokens are
chosen and when it ends (`Decoding`: sampler, penalties, grammar, stop sequences, text handed out as it
becomes final, cancel flag, deadline), a causal LM's forward pass with its KV cache (`Forward`), and
what it reports (`GenerationResult`, with `Timing`, the one definition of the speeds moestream reports).
It works on any transformers causal LM, moestream's or not.

The loop that runs decodings is the serving scheduler's (serving.py: `Scheduler`, and `stream`,
`timed`, `generate`, `teacher_forced` for one sequence); `chat_prompt()` turns chat messages into prompt
text with the checkpoint's chat template (or a fallback).
"""

from __future__ import annotations

import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from ..core.compute.attention import packable_layers, quantizes_kv
from ..errors import MoestreamError
from .constraints import Constraint, Grammar, Vocabulary
from .kv_layer import grow_in_place

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


def chat_prompt(tokenizer, messages: Sequence[dict], **options) -> str:
    """Prompt text for `messages` ([{"role": ..., "content": ...}]), ending where the assistant's answer
    starts: the checkpoint's chat template, or FALLBACK_CHAT_TEMPLATE when it has none. `options` go to
    the template (`tools`, `reasoning_effort`)."""
    template = None if has_chat_template(tokenizer) else FALLBACK_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(
        list(messages), chat_template=template, tokenize=False, add_generation_prompt=True, **options
    )


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

    def __init__(self, tokenizer, stop: Sequence[str] = (), special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.special_tokens = special_tokens  # keep special tokens in the text (tool-call markers often are)
        self.text = ""  # what has been handed out so far
        self.stopped = False
        self.matched: str | None = None  # the stop sequence that ended the text (Anthropic's API names it)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not self.special_tokens)

    def update(self, ids: list[int]) -> str:
        """The new final text after the new token ids grew to `ids`; sets `stopped` on a stop sequence."""
        if self.stopped:
            return ""
        full = self._decode(ids)
        hits = [(i, s) for i, s in ((full.find(s), s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return self._take(full[:at])
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


@dataclass(frozen=True)
class Timing:
    """When a generation started (the call), when its first new token existed and when its last did
    (time.perf_counter() seconds), and how many new tokens it made.

    The one definition of the speeds moestream reports, wherever it reports them (generate, chat, serve,
    bench and its peers, demo): time to first token is from the call to the first new token, i.e. the
    prefill plus one sampling; decode tokens/s is (new tokens - 1) / (time from the first new token to
    the last), so the prefill never counts in it, and it is 0 with fewer than two tokens."""

    start: float
    first: float
    last: float
    new_tokens: int

    @property
    def seconds(self) -> float:
        return self.last - self.start

    @property
    def time_to_first_token(self) -> float:
        return self.first - self.start

    @property
    def decode_seconds(self) -> float:
        return self.last - self.first

    @property
    def decode_tokens_per_second(self) -> float:
        return decode_rate(self.new_tokens - 1, self.decode_seconds)


def decode_rate(decoded_tokens: int, seconds: float) -> float:
    """Tokens after the first per second of decoding (Timing's definition; also for sums of runs)."""
    return decoded_tokens / seconds if decoded_tokens > 0 and seconds > 0 else 0.0


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
    timing: Timing | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    eos: bool = False  # the last token is an end-of-sequence token (not part of the text)
    stop_sequence: str | None = None  # the stop sequence that ended the answer, if one did
    logprobs: list | None = None  # TokenLogprob per new token, when they were asked for
    prompt_logprobs: list | None = None  # TokenLogprob per prompt token (the first's logprob None), when asked for

    @staticmethod
    def of(text: str, prompt_tokens: int, token_ids: list[int], timing: Timing, finish_reason: str) -> "GenerationResult":
        return GenerationResult(
            text,
            prompt_tokens,
            token_ids,
            timing.seconds,
            timing.time_to_first_token,
            timing.decode_tokens_per_second,
            finish_reason,
            timing=timing,
        )

    def summary(self) -> str:
        s = self.stats
        return (
            f"{len(self.token_ids)} tokens | {self.decode_tokens_per_second:.2f} tok/s decode | "
            f"TTFT {self.time_to_first_token:.2f}s | hit rate {s['hit_rate']:.1%} | "
            f"read {s['bytes_read'] / 1e6:.1f} MB | peak RSS {s['peak_rss_bytes'] / 2**20:.0f} MiB"
        )


def eos_ids(model, tokenizer=None) -> set[int]:
    """The model's end-of-sequence ids (its generation config's, else the tokenizer's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def vocabulary_of(model, tokenizer) -> Vocabulary:
    """The grammar engine's view of `tokenizer` for `model`: its logits width and end-of-sequence ids
    (built once per model and tokenizer)."""
    config = getattr(model.config, "get_text_config", lambda: model.config)()
    return Vocabulary.of(tokenizer, int(config.vocab_size), eos_ids(model, tokenizer))


Sampler = Callable[[torch.Tensor], torch.Tensor]  # float32 logits [1, vocab] -> token id [1]


def make_sampler(temperature: float, top_p: float, generator: torch.Generator | None = None, top_k: int = 0) -> Sampler:
    """Temperature 0: the most likely token. Otherwise a token drawn from `generator` (torch's
    global one if None) at `temperature` from the `top_k` most likely (0: all), then from the smallest set
    whose probability reaches `top_p`, with the warpers (and the order, and the skipping of no-op ones)
    that transformers' `generate(do_sample=True, top_k=top_k)` uses, so a seed gives the tokens transformers
    would give."""
    if temperature == 0:
        return lambda logits: logits.argmax(dim=-1)
    warpers = (
        ([TemperatureLogitsWarper(temperature)] if temperature != 1.0 else [])
        + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
        + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
    )

    def sample(logits: torch.Tensor) -> torch.Tensor:
        for warp in warpers:
            logits = warp(None, logits)
        return torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1, generator=generator).squeeze(1)

    return sample


def forced_sampler(tokens: Sequence[int]) -> Sampler:
    """Chooses `tokens` in order whatever the logits say (teacher forcing): a benchmark's decode then goes
    where a real text goes, and its routing with it, where a random model's own output loops."""
    upcoming = iter(list(tokens))
    return lambda logits: torch.tensor([next(upcoming)], dtype=torch.long)


# A prompt longer than this goes through the model in pieces of it, each attending to the KV cache of the
# ones before: the activations of one forward pass (the experts' inputs and outputs, q/k/v, the MLPs')
# grow with its tokens, several GB for a 32k-token prompt in one pass at the Qwen3-30B-A3B shape, and the
# pieces bound them; the sums are the same, in other matmul shapes (docs/BENCHMARKS.md, "Long context").
# With experts streamed from disk each piece reads the experts the cache lacks again.
PREFILL_PIECE = 4096


class Forward:
    """A causal LM's forward pass with its KV cache, across transformers versions: the cache argument is
    `cache` since 5.24 and `past_key_values` before; only the last position's logits are asked for where
    the model takes `logits_to_keep` (a long prompt's full [T, vocab] logits would be computed for nothing)."""

    def __init__(self, model, cache=None):
        params = inspect.signature(model.forward).parameters
        self.model = model
        self.cache_name = "cache" if "cache" in params else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.cache = cache
        self.int8_kv = quantizes_kv(model)  # loaded with an 8-bit KV cache (core/compute/attention.py)

    def __call__(self, ids: torch.Tensor, *, every_position: bool = False, **inputs) -> torch.Tensor:
        """Logits [rows, positions, vocab] of the ids fed after everything fed so far (`inputs`: an
        attention mask and position ids for a padded batch), on the model's device: of the last position
        only, unless `every_position`. A long prompt of one sequence goes in pieces of PREFILL_PIECE tokens."""
        if ids.shape[0] == 1 and ids.shape[1] > PREFILL_PIECE and not every_position and not inputs:
            for begin in range(0, ids.shape[1] - PREFILL_PIECE, PREFILL_PIECE):
                self(ids[:, begin : begin + PREFILL_PIECE])
            ids = ids[:, (ids.shape[1] - 1) // PREFILL_PIECE * PREFILL_PIECE :]
        extra = {} if every_position else self.extra
        device = self.model.device
        if device.type == "cuda":  # (a model offloaded by accelerate may name another device: its hooks move inputs)
            ids, inputs = ids.to(device), {name: t.to(device) for name, t in inputs.items()}
        try:
            out = self.model(input_ids=ids, use_cache=True, **{self.cache_name: self.cache}, **extra, **inputs)
        except torch.OutOfMemoryError as e:
            raise MoestreamError(
                f"the GPU ran out of memory ({str(e).splitlines()[0]}): lower --gpu-memory (the experts kept in VRAM), "
                "or send a shorter prompt or fewer requests at once (--max-batch, --batch-kv-memory)"
            ) from None
        self.cache = getattr(out, self.cache_name)
        if self.int8_kv:  # the layers a forward pass made hold packed rows from now on (kv_layer.Int8Layer)
            grow_in_place(self.cache, packed=packable_layers(self.model, self.cache))
        return out.logits


# Prompt tokens per forward pass when their log-probabilities are asked for: every position's logits are
# computed then ([tokens, vocab] floats: 256 x 150k is 150 MB), so a long prompt goes in pieces.
PROMPT_LOGPROBS_PIECE = 256


def prompt_logprobs(model, prompt_ids: Sequence[int], top: int) -> tuple[list[TokenLogprob], tuple]:
    """Each prompt token's log-probability under the model given the tokens before it, with the `top`
    most likely alternatives (OpenAI's completions `echo` with `logprobs`); the first token has none
    (logprob None). Feeds all but the last token, in pieces of PROMPT_LOGPROBS_PIECE, and returns with the
    entries the (KV cache, tokens it holds) that a prefill continues from (`BatchGenerator.admit`), so
    the prompt is not fed twice."""
    ids = token_list(prompt_ids)
    entries = [TokenLogprob(ids[0], None, ())] if ids else []
    forward = Forward(model)
    with torch.inference_mode():
        for begin in range(0, len(ids) - 1, PROMPT_LOGPROBS_PIECE):
            end = min(len(ids) - 1, begin + PROMPT_LOGPROBS_PIECE)
            logits = forward(torch.tensor([ids[begin:end]], dtype=torch.long), every_position=True)[0]
            logprobs = torch.log_softmax(logits.to("cpu", torch.float32), dim=-1)
            entries += [TokenLogprob.of(row, ids[i + 1], top) for i, row in zip(range(begin, end), logprobs)]
    return entries, (forward.cache, max(0, len(ids) - 1))


@dataclass(frozen=True)
class SamplingParams:
    """How one answer's tokens are chosen and when it ends, whoever asks for it (vLLM's SamplingParams):
    the commands build one from their options, the API from a request's fields.

    `temperature` 0 is greedy; otherwise a token is drawn at `temperature` from the `top_k` most likely
    (0: no limit) and the top-`top_p` mass, from a generator seeded with `seed` (torch's global one when None). `max_tokens` new tokens at most;
    `ignore_eos`: exactly that many, end-of-sequence never chosen (benchmarks time a fixed length).
    `stop`: strings that end the answer (not part of its text). `logit_bias` (token id -> value, -100
    bans), `presence_penalty` and `frequency_penalty` as in OpenAI's API. `grammar`: the answer follows
    it. `logprobs`/`prompt_logprobs`: report each new (prompt) token's log-probability with that many
    alternatives. `special_tokens`: the text keeps them (tool-call markers often are). `forced`: the new
    tokens to take whatever the model says (teacher forcing), for runs that follow a given text."""

    max_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    special_tokens: bool = False
    forced: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {self.max_tokens}")
        if self.forced is not None and len(self.forced) < self.max_tokens:
            raise ValueError(f"{len(self.forced)} forced tokens for {self.max_tokens} new ones")
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.forced is not None:
            object.__setattr__(self, "forced", tuple(self.forced))

    @staticmethod
    def greedy(max_tokens: int, **fields) -> SamplingParams:
        """The most likely token each step."""
        return SamplingParams(max_tokens, temperature=0.0, **fields)

    @staticmethod
    def timed(max_tokens: int, forced: Sequence[int] | None = None) -> SamplingParams:
        """What a benchmark times: exactly `max_tokens` tokens, greedy or the `forced` ones."""
        return SamplingParams.greedy(max_tokens, ignore_eos=True, forced=forced)


class Decoding:
    """One sequence being generated: its `SamplingParams` at work, the same whether it is the only one
    or one row of a batch (`batching.BatchGenerator`, stepped by `serving.Scheduler`).

    Its sampler draws from a generator of its own, seeded with the params' seed, so a seeded sequence
    gets the same tokens whatever ran before it or runs beside it. `choose` picks the next token from the
    logits; `accept` records it, hands the new final text to `on_text`, and says whether the sequence has
    ended: on a stop sequence or end-of-sequence ("stop"), the cancel flag ("cancelled"), the deadline
    (time.monotonic(), "timeout"), or max_tokens ("length"). `on_first_token` runs as soon as the first
    new token exists, before the next forward pass; `on_logits` sees each step's logits as the model gave
    them (teacher-forced evaluation). `tokenizer` may be None (token ids only: no text, no stop
    sequences, no grammar)."""

    def __init__(
        self,
        model,
        tokenizer,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_text: Callable[[str], None] | None = None,
        on_first_token: Callable[[], None] | None = None,
        on_logits: Callable[[torch.Tensor], None] | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ):
        self.prompt_ids = token_list(prompt_ids)
        self.params = params  # read where its fields are needed, not copied
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        if params.forced is not None:
            self.sampler = forced_sampler(params.forced)
        else:
            self.sampler = make_sampler(params.temperature, params.top_p, generator, params.top_k)
        self.eos = eos_ids(model, tokenizer)
        self.suppress = sorted(self.eos) if params.ignore_eos else []
        self.text = IncrementalText(tokenizer, params.stop, params.special_tokens) if tokenizer is not None else None
        self.on_text, self.on_first_token, self.on_logits = on_text, on_first_token, on_logits
        self.cancel, self.deadline = cancel, deadline
        self.bias = _bias_tensors(params.logit_bias)
        self.counts: dict[int, int] = {}  # how often each new token has come (the penalties)
        self.constraint = None
        if params.grammar is not None:  # compiled here, on the thread that steps (it can take a while)
            self.constraint = Constraint(params.grammar, vocabulary_of(model, tokenizer))
        self.token_logprobs: list[TokenLogprob] = []  # one per new token when `logprobs` is not None
        self._logprobs_taken = 0
        self.prompt_token_logprobs: list[TokenLogprob] | None = None  # set by who prefills (prompt_logprobs())
        self._prompt_logprobs_taken = False
        self.cached_tokens = 0  # prompt tokens whose KV came from a prefix cache (set by who prefills)
        self.ended_on_eos = False
        self.new: list[int] = []
        self.finish_reason: str | None = None
        self.start = time.perf_counter()
        self.first = self.last = self.start

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token [1] from float32 logits [1, vocab] (modified in place): end-of-sequence
        suppressed (`ignore_eos`), then the presence and frequency penalties, `logit_bias` and the
        grammar's mask, then the sampler. Log-probabilities, when asked for, are those of the model's
        own distribution, before any of these (as vLLM reports them by default)."""
        if self.on_logits is not None:
            self.on_logits(logits[0].clone())
        model_logprobs = torch.log_softmax(logits, dim=-1) if self.params.logprobs is not None else None
        if self.suppress:
            logits[:, self.suppress] = float("-inf")
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            seen = torch.tensor(list(self.counts.values()), dtype=logits.dtype)
            logits[:, ids] -= self.params.frequency_penalty * seen + self.params.presence_penalty
        if self.bias is not None:
            ids, values = self.bias
            within = ids < logits.shape[-1]  # (a tokenizer may know ids past the model's logits)
            logits[:, ids[within]] += values[within]
        if self.constraint is not None:
            self.constraint.mask(logits)
        token = self.sampler(logits)
        if model_logprobs is not None:
            self.token_logprobs.append(TokenLogprob.of(model_logprobs[0], int(token[0]), self.params.logprobs))
        return token

    def accept(self, token: int) -> bool:
        """Record the new token; True once the sequence has ended (`finish_reason` says why)."""
        self.last = time.perf_counter()
        self.new.append(token)
        if self.params.presence_penalty or self.params.frequency_penalty:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.advance(token)
        if len(self.new) == 1:
            self.first = self.last
            if self.on_first_token is not None:
                self.on_first_token()
        if self.text is not None:
            _emit(self.on_text, self.text.update(self._text_ids()))
        if self.text is not None and self.text.stopped:
            self.finish_reason = "stop"
        elif self.interrupted():
            pass
        elif token in self.eos and not self.params.ignore_eos:
            self.finish_reason = "stop"
            self.ended_on_eos = True
            if self.token_logprobs:
                self.token_logprobs.pop()  # not part of the answer's text: not reported
        elif self.constraint is not None and self.constraint.stopped:
            self.finish_reason = "stop"  # the grammar is complete: nothing may follow
        elif len(self.new) >= self.params.max_tokens:
            self.finish_reason = "length"
        return self.finish_reason is not None

    def _text_ids(self) -> list[int]:
        """The new tokens that make the text: with special tokens kept, an ending end-of-sequence token is
        not part of the answer (it would otherwise appear in it as its spelling)."""
        ends = self.new and self.new[-1] in self.eos and not self.params.ignore_eos
        return self.new[:-1] if ends and self.text.special_tokens else self.new

    def interrupted(self) -> bool:
        """Whether the cancel flag or the deadline has ended the sequence (`finish_reason` says which);
        checked after every token, and between the parts of a long prefill."""
        if self.cancel is not None and self.cancel.is_set():
            self.finish_reason = "cancelled"
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            self.finish_reason = "timeout"
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        """The ended sequence's result (any text held back is handed out first)."""
        if self.text is not None:
            _emit(self.on_text, self.text.finish(self._text_ids()))
        timing = Timing(self.start, self.first, self.last, len(self.new))
        text = self.text.text if self.text is not None else ""
        result = GenerationResult.of(text, len(self.prompt_ids), self.new, timing, self.finish_reason)
        result.cached_tokens = self.cached_tokens
        result.eos = self.ended_on_eos
        result.stop_sequence = self.text.matched if self.text is not None else None
        result.logprobs = self.token_logprobs if self.params.logprobs is not None else None
        result.prompt_logprobs = self.prompt_token_logprobs
        return result

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log-probabilities of the tokens not taken yet (a streamed answer sends each token's with
        the piece of text that holds it); the prompt's, when asked for, come first with the first piece."""
        taken = self._logprobs_taken
        self._logprobs_taken = len(self.token_logprobs)
        head = []
        if self.prompt_token_logprobs is not None and not self._prompt_logprobs_taken:
            head, self._prompt_logprobs_taken = self.prompt_token_logprobs, True
        return head + self.token_logprobs[taken:]


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the `top` most likely tokens' (id, logprob)."""

    token: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...]

    @staticmethod
    def of(logprobs: torch.Tensor, token: int, top: int) -> TokenLogprob:
        """From the log-softmax [vocab] of one step and the token chosen."""
        best = torch.topk(logprobs, top) if top > 0 else None
        pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
        return TokenLogprob(token, float(logprobs[token]), pairs)


def _bias_tensors(logit_bias: dict[int, float] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(token ids, values to add to their logits); a bias of -100 bans the token, as in OpenAI's API."""
    if not logit_bias:
        return None
    values = [float("-inf") if v <= -100 else float(v) for v in logit_bias.values()]
    return torch.tensor(list(logit_bias), dtype=torch.long), torch.tensor(values, dtype=torch.float32)


def token_list(ids) -> list[int]:
    """Prompt ids as a list, from a list or a [1, T] / [T] tensor; never empty."""
    ids = torch.as_tensor(ids).reshape(-1).tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if not ids:
        raise ValueError("the prompt is empty: generation needs at least one token to start from")
    return ids


def _emit(on_text, delta: str) -> None:
    if delta and on_text is not None:
        on_text(delta)

"""Translation between OpenAI's API and moestream's generations.

Inbound: a request body (already parsed JSON) is validated against OpenAI's request models and turned
into GenerationParams (prompt ids, sampling parameters, stop sequences, max tokens) for the worker.
Outbound: text pieces and the GenerationResult become OpenAI's response and chunk objects, and a
worker's failures become OpenAI-style errors. The two endpoints, /v1/chat/completions and
/v1/completions, differ only in how the prompt is built and how responses are shaped: each is an
Endpoint subclass, with its Reply.

Needs pydantic (which FastAPI brings); knows nothing of HTTP beyond status codes.
"""

from __future__ import annotations

import secrets
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .batching import KVBudgetExceeded
from .generate import GenerationResult, chat_prompt, encode
from .worker import (
    GenerationFailed,
    GenerationParams,
    QueueFull,
    ShuttingDown,
    TimedOut,
)

# OpenAI's limit on stop sequences per request.
MAX_STOP_SEQUENCES = 4
# OpenAI's answer length for a completions request that names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_for(e: Exception) -> APIError:
    """The OpenAI error for any exception that ends a request: a worker's failures by kind; anything
    unforeseen as a 500 that names it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, KVBudgetExceeded):
        return APIError(400, str(e), code="kv_budget_exceeded")
    if isinstance(e, QueueFull):
        return APIError(429, f"{e.max_queue} requests are already queued; retry later", type="server_busy", code="queue_full")
    if isinstance(e, TimedOut) and e.queued:
        return APIError(
            503,
            f"the request waited longer than the server's timeout ({e.timeout:g} s) in the queue: the server is busy, retry later",
            type="server_busy",
            code="timeout",
        )
    if isinstance(e, TimedOut):
        return APIError(
            504, f"the request ran longer than the server's timeout ({e.timeout:g} s)", type="timeout", code="timeout"
        )
    if isinstance(e, ShuttingDown):
        return APIError(503, "the server is shutting down", type="server_error")
    if isinstance(e, GenerationFailed):
        return APIError(500, f"generation failed: {e.cause}", type="server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model '{name}' does not exist; this server serves '{served}' (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "moestream"}


# -- request models -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # Strict types: "10" is not a number and 1.5 is not an integer, as in OpenAI's API. Fields we do not
    # know (presence_penalty, user, ...) are ignored so that existing clients work unchanged.
    model_config = ConfigDict(strict=True, extra="ignore")


class _ContentPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content of type {part.type!r} is not supported; send text", param="messages")
            parts.append(part.text)
        return "".join(parts)


class _StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    # vLLM's extension, for benchmarks that time a fixed length: never stop at end-of-sequence.
    ignore_eos: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients send this instead of max_tokens

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int]
    echo: bool | None = None


def _error_from_validation(e: ValidationError) -> APIError:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    # pydantic names the union branch it tried last ("stop.str"): report the field the client sent.
    param = ".".join(x for x in loc if x not in ("str", "list[str]", "list[int]", "list[_ContentPart]", "float", "int"))
    return APIError(400, f"invalid value for '{param}': {first.get('msg')}", param=param or None, code="invalid_value")


# -- requests into generations ----------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A valid request, translated: what to generate, and how to answer."""

    generation: GenerationParams
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: one more event with the token counts
    reply: Reply


class Endpoint(ABC):
    """One OpenAI generation endpoint: its request model, how it builds the prompt, how it answers."""

    name: ClassVar[str]  # its label in metrics
    request_model: ClassVar[type[_Common]]
    prompt_param: ClassVar[str]  # the request field that holds the prompt, named in errors about it

    def __init__(self, tokenizer, model_name: str, context: int | None, default_max_tokens: int):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context = context  # the model's context length; None if its config does not say
        self.default_max_tokens = default_max_tokens

    def parse(self, data: dict) -> ParsedRequest:
        """Validate a request body; raises APIError (4xx) saying what to change."""
        try:
            req = self.request_model.model_validate(data)
        except ValidationError as e:
            raise _error_from_validation(e) from None
        if req.model != self.model_name:
            raise model_not_found(req.model, self.model_name)
        generation = self._generation(req, self.prompt_ids(req))
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return ParsedRequest(generation, req.stream, include_usage, self.reply())

    @abstractmethod
    def prompt_ids(self, req) -> list[int]:
        """The prompt's token ids."""

    @abstractmethod
    def reply(self) -> Reply:
        """A new request's answer shaper (with its id and creation time)."""

    def _tokenize(self, text: str, templated: bool) -> list[int]:
        try:
            return encode(self.tokenizer, text, templated=templated)
        except Exception as e:  # e.g. a lone UTF-16 surrogate ("\ud800") that JSON allows and no tokenizer takes
            raise APIError(
                400, f"the text cannot be tokenized ({type(e).__name__}: {e}); send valid Unicode text", param=self.prompt_param
            ) from None

    def _generation(self, req: _Common, prompt_ids: list[int]) -> GenerationParams:
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported: send one request per answer", param="n")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES or any(not s for s in stops):
            raise APIError(400, f"'stop' takes up to {MAX_STOP_SEQUENCES} non-empty strings", param="stop")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "'seed' must fit in 64 bits", param="seed")
        if not prompt_ids:
            raise APIError(400, "the prompt is empty: send at least one character", param=self.prompt_param)
        limit = self.context or 2**31
        requested = req.requested_max_tokens()
        if requested is not None and not 1 <= requested <= limit:
            raise APIError(
                400,
                f"'max_tokens' must be between 1 and {limit} (the model's context length), not {requested}",
                param="max_tokens",
                code="invalid_value",
            )
        if len(prompt_ids) >= limit or (requested is not None and len(prompt_ids) + requested > limit):
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the request has {len(prompt_ids)} in the "
                f"prompt and asks for {requested or 1} more: shorten the prompt or lower max_tokens",
                param=self.prompt_param,
                code="context_length_exceeded",
            )
        return GenerationParams(
            prompt_ids=prompt_ids,
            max_tokens=requested or min(self.default_max_tokens, limit - len(prompt_ids)),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            # A request without a seed gets a fresh one, so it never depends on what ran before it.
            seed=secrets.randbits(63) if req.seed is None else req.seed % 2**64,
            stop=stops,
            ignore_eos=req.ignore_eos,
        )


class ChatCompletions(Endpoint):
    """POST /v1/chat/completions: messages through the checkpoint's chat template."""

    name = "chat"
    request_model = ChatCompletionRequest
    prompt_param = "messages"

    def prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = chat_prompt(self.tokenizer, messages)
        except Exception as e:  # a template that rejects these messages (roles out of order, ...)
            raise APIError(400, f"the chat template cannot format these messages: {e}", param="messages") from None
        return self._tokenize(prompt, templated=True)

    def reply(self) -> ChatReply:
        return ChatReply(self.model_name)


class Completions(Endpoint):
    """POST /v1/completions: a plain prompt, as text or token ids."""

    name = "completions"
    request_model = CompletionRequest
    prompt_param = "prompt"

    def __init__(self, tokenizer, model_name: str, context: int | None, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS):
        super().__init__(tokenizer, model_name, context, default_max_tokens)

    def prompt_ids(self, req: CompletionRequest) -> list[int]:
        if req.echo:
            raise APIError(400, "echo is not supported", param="echo")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "send one prompt per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._tokenize(prompt, templated=False)
        vocab = len(self.tokenizer)
        if any(not 0 <= i < vocab for i in prompt):
            raise APIError(400, f"token ids must lie in [0, {vocab})", param="prompt")
        return list(prompt)

    def reply(self) -> CompletionReply:
        return CompletionReply(self.model_name)


# -- generations into responses ---------------------------------------------------------------------------


def usage(result: GenerationResult) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def finish_reason(result: GenerationResult) -> str:
    # OpenAI knows "stop" and "length"; a cancelled or timed-out generation never reaches a client as done.
    return "length" if result.finish_reason == "length" else "stop"


class Reply(ABC):
    """One request's answer, as one response object or as a stream of chunk objects: opening() (None:
    no opening chunk), chunk(piece) per piece of text, last_chunk(result), then usage_chunk(result) when
    the client asked for it."""

    id_prefix: ClassVar[str]
    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, model_name: str):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model_name = model_name

    def _header(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model_name}

    def _chunk_with(self, choice: dict) -> dict:
        return {**self._header(self.chunk_object), "choices": [{"index": 0, **choice}]}

    def usage_chunk(self, result: GenerationResult) -> dict:
        return {**self._header(self.chunk_object), "choices": [], "usage": usage(result)}

    def response(self, text: str, result: GenerationResult) -> dict:
        return {
            **self._header(self.response_object),
            "choices": [{"index": 0, **self._whole(text, result)}],
            "usage": usage(result),
        }

    @abstractmethod
    def opening(self) -> dict | None: ...

    @abstractmethod
    def chunk(self, text: str) -> dict: ...

    @abstractmethod
    def last_chunk(self, result: GenerationResult) -> dict: ...

    @abstractmethod
    def _whole(self, text: str, result: GenerationResult) -> dict:
        """The one choice of the non-streamed response, without its index."""


class ChatReply(Reply):
    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def opening(self) -> dict:
        return self._chunk_with({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})

    def chunk(self, text: str) -> dict:
        return self._chunk_with({"delta": {"content": text}, "logprobs": None, "finish_reason": None})

    def last_chunk(self, result: GenerationResult) -> dict:
        return self._chunk_with({"delta": {}, "logprobs": None, "finish_reason": finish_reason(result)})

    def _whole(self, text: str, result: GenerationResult) -> dict:
        return {"message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish_reason(result)}


class CompletionReply(Reply):
    id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def opening(self) -> None:
        return None  # OpenAI opens a completions stream with the first piece of text

    def chunk(self, text: str) -> dict:
        return self._chunk_with({"text": text, "logprobs": None, "finish_reason": None})

    def last_chunk(self, result: GenerationResult) -> dict:
        return self._chunk_with({"text": "", "logprobs": None, "finish_reason": finish_reason(result)})

    def _whole(self, text: str, result: GenerationResult) -> dict:
        return {"text": text, "logprobs": None, "finish_reason": finish_reason(result)}

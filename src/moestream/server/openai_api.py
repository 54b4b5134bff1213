"""Translation between OpenAI's API and moestream's generations.

Inbound: a request body (already parsed JSON) is validated against OpenAI's request models and turned
into one worker.Choice per choice (prompt ids and the SamplingParams: sampling parameters and penalties, logit bias, stop
sequences, max tokens, the grammar of a response_format or a forced tool call, logprobs) for the worker.
Every field of OpenAI's chat and completions schemas is honoured or refused with a 400 that names it
(docs/guides/serving-and-agents.md, "What a request may ask for"); fields outside them are refused as OpenAI refuses them.
Outbound: text pieces and the GenerationResults become OpenAI's response and chunk objects (tool calls
parsed from the answer by the chat template's format, tool_calls.py), and a worker's failures become
OpenAI-style errors. The two endpoints, /v1/chat/completions and /v1/completions, differ only in how
the prompts are built and how responses are shaped: each is an Endpoint subclass, with its Reply.

Needs pydantic (which FastAPI brings); knows nothing of HTTP beyond status codes.
"""

from __future__ import annotations

import json
import secrets
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ExpertReadError
from ..generation.batching import KVBudgetExceeded
from ..generation.constraints import Grammar, GrammarError, Vocabulary
from ..generation.generate import GenerationResult, SamplingParams, TokenLogprob, chat_prompt, encode
from ..generation.serving import TooManyChoices
from ..generation.worker import (
    Choice,
    Done,
    GenerationFailed,
    Piece,
    QueueFull,
    ShuttingDown,
    TimedOut,
)
from . import tool_calls
from .answer_stream import AnswerStream, CallStarted, ContentDelta, Delta, ReasoningDelta, Thinking

# OpenAI's limit on stop sequences per request.
MAX_STOP_SEQUENCES = 4
# OpenAI's answer length for a completions request that names none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# The most prompts one completions request may list.
MAX_PROMPTS = 64


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
    if isinstance(e, TooManyChoices):
        return APIError(400, f"{e}: lower n", param="n", code="invalid_value")
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
    if isinstance(e, GenerationFailed) and isinstance(e.cause, ExpertReadError):
        return APIError(
            500, f"reading the model's experts from disk failed: {e.cause}", type="server_error", code="disk_read_failed"
        )
    if isinstance(e, GenerationFailed):
        return APIError(500, f"generation failed: {e.cause}", type="server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


class ContextTooLong(APIError):
    """A prompt that, with the answer's room, does not fit the context window (each API words it its own way:
    agents compact the conversation when they see it)."""

    def __init__(self, prompt_tokens: int, requested: int, limit: int, param: str):
        super().__init__(
            400,
            f"this model's maximum context length is {limit} tokens; the request has {prompt_tokens} in the "
            f"prompt and asks for {requested} more: shorten the prompt or lower max_tokens",
            param=param,
            code="context_length_exceeded",
        )
        self.prompt_tokens, self.requested, self.limit = prompt_tokens, requested, limit


def model_not_found(name: str, served: str) -> APIError:
    return APIError(
        404,
        f"the model '{name}' does not exist; this server serves '{served}' (GET /v1/models)",
        param="model",
        code="model_not_found",
    )


def model_card(name: str, created: int, context: int | None) -> dict:
    """A model as /v1/models lists it: OpenAI's fields, the context window under the names clients read
    (vLLM's `max_model_len`, `context_length`), and Anthropic's fields (`type`, `display_name`,
    `created_at`), so that either API's client reads the one list."""
    card = {"id": name, "object": "model", "created": created, "owned_by": "moestream"}
    if context is not None:
        card.update(max_model_len=context, context_length=context)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return {**card, "type": "model", "display_name": name, "created_at": stamp}


# -- request models -------------------------------------------------------------------------------------


class _Strict(BaseModel):
    # Strict types: "10" is not a number and 1.5 is not an integer, as in OpenAI's API. A field outside
    # OpenAI's schema is refused by name, as OpenAI refuses it ("unrecognized request argument"), so that
    # nothing a client asks for is dropped in silence.
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class _ContentPart(_Strict):
    type: str
    text: str | None = None
    # Other kinds of content are named here so that they get a clear "send text" error, not "unrecognized".
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class _FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class _ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them
    refusal: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content of type {part.type!r} is not supported; send text", param="messages")
            parts.append(part.text)
        return "".join(parts)

    def as_dict(self) -> dict:
        """The message as OpenAI's JSON (the tool-call formats turn it into what chat templates expect)."""
        out = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class _StreamOptions(_Strict):
    include_usage: bool = False


class _JsonSchema(_Strict):
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always followed exactly: strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _Function(_Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # the arguments always follow `parameters` where a call is forced


class Tool(_Strict):
    type: Literal["function"]
    function: _Function


class _Named(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _Named


# Fields of OpenAI's schemas that this server cannot honour: refused with these reasons when set.
REFUSED = {
    "audio": "audio output is not supported: this server answers with text",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "functions": "'functions' is deprecated and not supported: send 'tools'",
    "function_call": "'function_call' is deprecated and not supported: send 'tool_choice'",
    "verbosity": "'verbosity' is not supported",
    "suffix": "'suffix' (text after the insertion) is not supported",
}


class _Common(_Strict):
    model: str | None = None  # none: the served model (one per server), as vLLM and llama.cpp take it
    max_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    # Fields that change no answer (who asks, billing, storage on OpenAI's side): accepted.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extension, for benchmarks that time a fixed length: never stop at end-of-sequence.
    ignore_eos: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def refused(self) -> None:
        for name, why in REFUSED.items():
            if getattr(self, name, None) not in (None, "", False):
                raise APIError(400, why, param=name, code="unsupported_parameter")
        if self.store:
            raise APIError(400, "this server stores no completions: send store false or leave it out", param="store")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients send this instead of max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = None
    # vLLM's and llama.cpp's extension: more variables for the chat template (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    verbosity: Any = None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def refused(self) -> None:
        super().refused()
        if self.modalities is not None and self.modalities != ["text"]:
            raise APIError(400, "only the text modality is supported: send modalities ['text']", param="modalities")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


def _error_from_validation(e: ValidationError) -> APIError:
    first = e.errors()[0]
    loc = [str(x) for x in first.get("loc", ())]
    # pydantic names the union branch it tried last ("stop.str"): report the field the client sent.
    branches = ("str", "list[str]", "list[int]", "list[list[int]]", "list[_ContentPart]", "float", "int", "bool", "dict[any,any]")
    param = ".".join(x for x in loc if x not in branches and not x.startswith(("literal[", "NamedToolChoice", "function-")))
    if first.get("type") == "extra_forbidden":
        return APIError(
            400, f"unrecognized request argument supplied: '{param}'", param=param or None, code="unsupported_parameter"
        )
    return APIError(400, f"invalid value for '{param}': {first.get('msg')}", param=param or None, code="invalid_value")


# -- requests into generations ----------------------------------------------------------------------------


@dataclass
class ParsedRequest:
    """A valid request, translated: what to generate (one Choice per choice), and how to answer."""

    choices: list[Choice]
    stream: bool  # answer with server-sent events
    include_usage: bool  # stream_options.include_usage: one more event with the token counts
    reply: Reply


class Endpoint(ABC):
    """One OpenAI generation endpoint: its request model, how it builds the prompt, how it answers.

    `vocabulary` gives the grammar engine's view of the tokenizer (built on first use: seconds for a large
    vocabulary), for requests with structured outputs or forced tool calls; `fingerprint` is the
    `system_fingerprint` of every answer."""

    name: ClassVar[str]  # its label in metrics
    request_model: ClassVar[type[_Common]]
    prompt_param: ClassVar[str]  # the request field that holds the prompt, named in errors about it
    max_stop_sequences: ClassVar[int] = MAX_STOP_SEQUENCES
    # Whether `max_tokens` is only a cap, lowered to the room the context leaves after the prompt
    # (Anthropic's agents send 32,000 whatever the model), rather than a length the context must hold.
    max_tokens_is_a_cap: ClassVar[bool] = False

    def __init__(
        self,
        tokenizer,
        model_name: str,
        context: int | None,
        default_max_tokens: int,
        vocabulary: Callable[[], Vocabulary] | None = None,
        fingerprint: str = "",
    ):
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.context = context  # the model's context length; None if its config does not say
        self.default_max_tokens = default_max_tokens
        self.vocabulary = vocabulary
        self.fingerprint = fingerprint

    def parse(self, data: dict) -> ParsedRequest:
        """Validate a request body; raises APIError (4xx) saying what to change."""
        req = self.validate(data)
        reply = self.reply(req)
        prompts = self.prompts(req, reply)
        base = replace(self._generation(req, prompts, self.grammar(req, reply)), special_tokens=reply.special_tokens)
        n = req.n or 1
        choices = []
        for prompt in prompts:
            for i in range(n):
                # Choice i of a seeded request is what a request with seed + i would answer alone.
                seed = secrets.randbits(63) if req.seed is None else (req.seed + i) % 2**64
                choices.append(Choice(prompt, replace(base, seed=seed)))
        reply.start(prompts, n)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return ParsedRequest(choices, req.stream, include_usage, reply)

    def validate(self, data: dict) -> _Common:
        """The request body as this endpoint's request model, with what it may not ask for refused."""
        try:
            req = self.request_model.model_validate(data)
        except ValidationError as e:
            raise _error_from_validation(e) from None
        if req.model is not None and req.model != self.model_name:
            raise model_not_found(req.model, self.model_name)
        req.refused()
        return req

    @abstractmethod
    def prompts(self, req, reply: Reply) -> list[list[int]]:
        """The prompts' token ids (one per prompt; chat has one)."""

    @abstractmethod
    def reply(self, req) -> Reply:
        """A new request's answer shaper (with its id and creation time)."""

    def grammar(self, req, reply: Reply) -> Grammar | None:
        """The grammar the answers must follow, if any."""
        return None

    def _compiled(self, grammar: Grammar, param: str) -> Grammar:
        """`grammar`, checked against the vocabulary: a 400 naming `param` if it cannot be used."""
        try:
            if self.vocabulary is not None:
                self.vocabulary().check(grammar)
        except GrammarError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None
        return grammar

    def _tokenize(self, text: str, templated: bool) -> list[int]:
        try:
            return encode(self.tokenizer, text, templated=templated)
        except Exception as e:  # e.g. a lone UTF-16 surrogate ("\ud800") that JSON allows and no tokenizer takes
            raise APIError(
                400, f"the text cannot be tokenized ({type(e).__name__}: {e}); send valid Unicode text", param=self.prompt_param
            ) from None

    def _generation(self, req: _Common, prompts: list[list[int]], grammar: Grammar | None) -> SamplingParams:
        """The parameters every choice shares, checked (the prompt and seed are set per choice)."""
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > self.max_stop_sequences or any(not s for s in stops):
            raise APIError(400, f"'stop' takes up to {self.max_stop_sequences} non-empty strings", param="stop")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "'seed' must fit in 64 bits", param="seed")
        if not prompts or any(not p for p in prompts):
            raise APIError(400, "the prompt is empty: send at least one character", param=self.prompt_param)
        limit = self.context or 2**31
        requested = req.requested_max_tokens()
        longest = max(len(p) for p in prompts)
        if requested is not None and self.max_tokens_is_a_cap and longest < limit:
            requested = min(requested, limit - longest)
        if requested is not None and not 1 <= requested <= limit:
            raise APIError(
                400,
                f"'max_tokens' must be between 1 and {limit} (the model's context length), not {requested}",
                param="max_tokens",
                code="invalid_value",
            )
        if longest >= limit or (requested is not None and longest + requested > limit):
            raise ContextTooLong(longest, requested or 1, limit, self.prompt_param)
        return SamplingParams(
            max_tokens=requested or min(self.default_max_tokens, limit - longest),
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=getattr(req, "top_k", None) or 0,  # (Anthropic's API has it; OpenAI's has not)
            seed=0,
            stop=stops,
            ignore_eos=req.ignore_eos,
            logit_bias=self._logit_bias(req.logit_bias),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            grammar=grammar,
            logprobs=self.logprobs(req),
            prompt_logprobs=self.prompt_logprobs(req),
        )

    def logprobs(self, req) -> int | None:
        """None, or how many alternatives to report per token."""
        return None

    def prompt_logprobs(self, req) -> int | None:
        """None, or how many alternatives to report per prompt token."""
        return None

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float] | None:
        if not bias:
            return None
        vocab = len(self.tokenizer)
        out = {}
        for key, value in bias.items():
            if not key.lstrip("-").isdigit() or not 0 <= int(key) < vocab:
                raise APIError(400, f"logit_bias keys are token ids in [0, {vocab}), not {key!r}", param="logit_bias")
            if not -100 <= value <= 100:
                raise APIError(400, f"logit_bias values lie in [-100, 100], not {value}", param="logit_bias")
            out[int(key)] = value
        return out


def system_roles_for(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` with their system roles as the tokenizer's chat template takes them. OpenAI's `developer`
    role is the system role of models older than it (OpenAI's API treats it so), and agents put their
    instructions there (Codex's are thousands of tokens), after the request's own. Most MoE families'
    templates drop a role they do not know without a word (Qwen3's), refuse it, or keep one system message
    only (gpt-oss's, MiniMax-M3's): unless the template renders a system and a developer message both, each
    developer message becomes a system one, and the system messages that open the conversation become one,
    in order (what llama.cpp's server does too)."""
    if _keeps_developer(tokenizer):
        return messages
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system" and isinstance(messages[lead].get("content"), str):
        lead += 1
    if lead < 2:
        return messages
    return [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:lead])}, *messages[lead:]]


# Whether a chat template renders a system and a developer message both, in order, by its text (a server has
# one template; the tests a few dozen): found once by rendering a probe.
_DEVELOPER_KEPT: dict[str | None, bool] = {}
_PROBE = [("system", "moestream probe: system"), ("developer", "moestream probe: developer"), ("user", "moestream probe: user")]


def _keeps_developer(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if template not in _DEVELOPER_KEPT:
        try:
            text = chat_prompt(tokenizer, [{"role": role, "content": content} for role, content in _PROBE])
            places = [text.find(content) for _, content in _PROBE]
            kept = all(text.count(content) == 1 for _, content in _PROBE) and places == sorted(places)
        except Exception:  # (a template that refuses the role, or a system message after the first)
            kept = False
        _DEVELOPER_KEPT[template] = kept
    return _DEVELOPER_KEPT[template]


class ChatCompletions(Endpoint):
    """POST /v1/chat/completions: messages through the checkpoint's chat template (with `tools`, when
    the template defines a tool-call format)."""

    name = "chat"
    request_model = ChatCompletionRequest
    prompt_param = "messages"

    def prompts(self, req: ChatCompletionRequest, reply: ChatReply) -> list[list[int]]:
        messages = system_roles_for(self.tokenizer, [m.as_dict() for m in req.messages])
        options = {}
        if req.tools:
            options["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        if req.reasoning_effort is not None:
            if "reasoning_effort" not in (self._template() or ""):
                raise APIError(400, "this model's chat template takes no reasoning effort", param="reasoning_effort")
            options["reasoning_effort"] = req.reasoning_effort
        reserved = {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template"} & set(
            req.chat_template_kwargs or {}
        )
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {sorted(reserved)}", param="chat_template_kwargs")
        options.update(req.chat_template_kwargs or {})
        earlier_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        # (with tool_choice "none" the answer is not parsed for calls, but earlier ones still go through the template)
        template_format = reply.tool_format or (tool_calls.detect(self._template()) if earlier_calls else None)
        if template_format is not None:
            messages = template_format.template_messages(messages)
        elif earlier_calls:
            raise APIError(
                400, "this model's chat template defines no tool-call format: send no tool calls or results", param="messages"
            )
        try:
            prompt = chat_prompt(self.tokenizer, messages, **options)
        except Exception as e:  # a template that rejects these messages (roles out of order, ...)
            raise APIError(400, f"the chat template cannot format these messages: {e}", param=self.prompt_param) from None
        reply.thinking = Thinking.of(self._template(), prompt)
        return [self._tokenize(prompt, templated=True)]

    def _template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def thinking_options(self, thinking: bool | None, effort: str | None) -> dict:
        """The chat fields that set the template's thinking, for the APIs that ask for it in their own words
        (a reasoning effort, thinking on or off): `effort` as the template's `reasoning_effort` where it
        takes one, else `thinking` as its `enable_thinking`; None, or a template with neither switch,
        thinks as it always does."""
        template = self._template() or ""
        if effort is not None and "reasoning_effort" in template:
            return {"reasoning_effort": effort}
        if thinking is not None and "enable_thinking" in template:
            return {"chat_template_kwargs": {"enable_thinking": thinking}}
        return {}

    def reply(self, req: ChatCompletionRequest) -> ChatReply:
        return ChatReply(
            self.model_name,
            self.fingerprint,
            self.tokenizer,
            self.vocabulary,
            tool_format=self.tool_format(req),
            parallel_tool_calls=req.parallel_tool_calls is not False,
        )

    def tool_format(self, req: ChatCompletionRequest) -> tool_calls.ToolFormat | None:
        """The format the answer's tool calls are parsed in; None when no call is allowed."""
        tool_format = None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if req.tools else "none")
        if isinstance(choice, NamedToolChoice) and not any(t.function.name == choice.function.name for t in req.tools or []):
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools", param="tool_choice")
        if choice != "none" and not req.tools:
            raise APIError(400, "tool_choice asks for a tool call but the request has no tools", param="tool_choice")
        if req.tools and choice != "none":  # ("none": the template shows the tools; nothing is parsed)
            tool_format = tool_calls.detect(self._template())
            if tool_format is None:
                raise APIError(
                    400,
                    "this model's chat template defines no tool-call format that moestream parses, so tools cannot be "
                    "offered to it (tool_choice none can); a --chat-template with a known format can (Hermes/Qwen, "
                    "Qwen3-Coder/Qwen3.5, GLM-4.5+, Llama 3.x/4, Mistral, DeepSeek V3-V4, gpt-oss, Kimi-K2/K3, MiniMax-M2/M3, "
                    "Cohere, GigaChat, Hunyuan, Solar-Open, LFM2)",
                    param="tools",
                )
            # (the XML-like formats type each argument by the tool's schema)
            tool_format = tool_format.with_tools([t.model_dump(exclude_none=True) for t in req.tools])
        return tool_format

    def grammar(self, req: ChatCompletionRequest, reply: ChatReply) -> Grammar | None:
        forced = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        fmt = req.response_format
        structured = fmt is not None and fmt.type != "text"
        if forced and structured:
            raise APIError(400, "a forced tool call and a response_format cannot both shape one answer", param="response_format")
        if forced:
            choice = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
            tools = [t.model_dump(exclude_none=True) for t in req.tools]
            try:
                text = reply.tool_format.grammar(
                    tools,
                    choice,
                    added_tokens=self.tokenizer.get_added_vocab(),
                    parallel=req.parallel_tool_calls is not False,
                    thinking=reply.thinking.grammar_mode if reply.thinking is not None else None,
                    think_markers=(reply.thinking.start, reply.thinking.end) if reply.thinking is not None else ("", ""),
                )
                grammar = Grammar.lark(text)
            except (GrammarError, ValueError) as e:
                raise APIError(400, f"the tools cannot be turned into a grammar: {e}", param="tools") from None
            return self._compiled(grammar, "tools")
        if not structured:
            return None
        if fmt.type == "json_object":
            return self._compiled(Grammar.json_object(), "response_format")
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema", param="response_format")
        try:
            grammar = Grammar.json_schema(fmt.json_schema.schema_)
        except GrammarError as e:
            raise APIError(400, str(e), param="response_format") from None
        return self._compiled(grammar, "response_format")

    def logprobs(self, req: ChatCompletionRequest) -> int | None:
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs true", param="top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None


class Completions(Endpoint):
    """POST /v1/completions: plain prompts, as text or token ids (one, or a list: choices per prompt)."""

    name = "completions"
    request_model = CompletionRequest
    prompt_param = "prompt"

    def __init__(
        self, tokenizer, model_name: str, context: int | None, default_max_tokens: int = COMPLETIONS_DEFAULT_MAX_TOKENS, **kw
    ):
        super().__init__(tokenizer, model_name, context, default_max_tokens, **kw)

    def prompts(self, req: CompletionRequest, reply: CompletionReply) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts or len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"send between 1 and {MAX_PROMPTS} prompts", param="prompt")
        vocab = len(self.tokenizer)
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(self._tokenize(p, templated=False))
                continue
            if any(not 0 <= i < vocab for i in p):
                raise APIError(400, f"token ids must lie in [0, {vocab})", param="prompt")
            out.append(list(p))
        if req.echo:
            reply.echo = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in prompts]
            reply.scores_prompt = req.logprobs is not None
        return out

    def reply(self, req: CompletionRequest) -> CompletionReply:
        if req.best_of is not None and req.best_of != (req.n or 1):
            raise APIError(400, "best_of other than n is not supported: every answer generated is returned", param="best_of")
        return CompletionReply(self.model_name, self.fingerprint, self.tokenizer, self.vocabulary)

    def logprobs(self, req: CompletionRequest) -> int | None:
        return req.logprobs

    def prompt_logprobs(self, req: CompletionRequest) -> int | None:
        # Echo with logprobs scores the prompt too (what evaluation harnesses ask for: max_tokens 1, echo, logprobs).
        return req.logprobs if req.echo else None


# -- generations into responses ---------------------------------------------------------------------------


def finish_reason(result: GenerationResult) -> str:
    # OpenAI knows "stop" and "length"; a cancelled or timed-out generation never reaches a client as done.
    return "length" if result.finish_reason == "length" else "stop"


class Reply(ABC):
    """One request's answer, as one response object (`response`) or as a stream of chunk objects:
    `opening(i)` as choice i starts, `chunk(piece)` per piece of text, `last_chunks(done)` as a choice
    ends, then `usage_chunk` when the client asked for it. Chunk methods return lists (possibly empty:
    text held back)."""

    id_prefix: ClassVar[str]
    response_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, model_name: str, fingerprint: str, tokenizer, vocabulary: Callable[[], Vocabulary] | None = None):
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.vocabulary = vocabulary
        self.created = int(time.time())
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.prompt_of: list[int] = []  # each choice's prompt (usage counts a prompt once)

    @property
    def special_tokens(self) -> bool:
        """Whether the answers' text keeps special tokens (for a reply that parses them)."""
        return False

    # A stream's framing: each payload as a server-sent event, and OpenAI's `data: [DONE]` at the end.
    done_marker: ClassVar[bool] = True

    def sse(self, payload: dict) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def error_event(self, body: dict) -> dict:
        """The event that tells a client its stream failed (the status line went out already)."""
        return body

    # Seconds without output (a long prefill) after which a stream sends `keepalive()`; None: never.
    keepalive_seconds: ClassVar[float | None] = None

    def keepalive(self) -> list[dict]:
        return []

    def start(self, prompts: list[list[int]], n: int) -> None:
        self.prompt_of = [p for p in range(len(prompts)) for _ in range(n)]

    @property
    def choices(self) -> int:
        return len(self.prompt_of)

    def _header(self, obj: str) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model_name,
            "system_fingerprint": self.fingerprint,
        }

    def _chunk_with(self, index: int, choice: dict) -> dict:
        return {**self._header(self.chunk_object), "choices": [{"index": index, **choice}]}

    def usage(self, results: dict[int, GenerationResult]) -> dict:
        prompt, cached = {}, {}
        for i, r in results.items():
            prompt[self.prompt_of[i]] = r.prompt_tokens
            cached[self.prompt_of[i]] = max(cached.get(self.prompt_of[i], 0), r.cached_tokens)
        completion = sum(len(r.token_ids) for r in results.values())
        return {
            "prompt_tokens": sum(prompt.values()),
            "completion_tokens": completion,
            "total_tokens": sum(prompt.values()) + completion,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())},
        }

    def usage_chunk(self, results: dict[int, GenerationResult]) -> dict:
        return {**self._header(self.chunk_object), "choices": [], "usage": self.usage(results)}

    def response(self, results: dict[int, GenerationResult]) -> dict:
        return {
            **self._header(self.response_object),
            "choices": [{"index": i, **self._whole(i, results[i])} for i in sorted(results)],
            "usage": self.usage(results),
        }

    def token_bytes(self, token: int) -> bytes:
        """A token's exact bytes (a byte-level token may hold part of a character)."""
        if self.vocabulary is not None:
            return self.vocabulary().words.decode_bytes([token])
        return self.tokenizer.decode([token]).encode()

    def token_text(self, token: int) -> str:
        """A token as text; one that is not whole UTF-8 as "bytes:\\x.." (vLLM's spelling), so that tokens
        differ in the text too (the completions format keys alternatives by their text)."""
        data = self.token_bytes(token)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data)

    @abstractmethod
    def opening(self, index: int) -> list[dict]: ...

    @abstractmethod
    def chunk(self, piece: Piece) -> list[dict]: ...

    @abstractmethod
    def last_chunks(self, done: Done) -> list[dict]: ...

    @abstractmethod
    def _whole(self, index: int, result: GenerationResult) -> dict:
        """Choice `index` of the non-streamed response, without its index."""


class OneAnswerReply(Reply):
    """A reply of one answer whose response is built whole from the answer's parts (`response`), and whose
    stream carries its usage in its last event (the Responses and Messages APIs): no per-choice shapes."""

    def usage_chunk(self, results: dict[int, GenerationResult]) -> dict:
        raise AssertionError(f"{type(self).__name__}'s stream carries its usage in its last event")

    def _whole(self, index: int, result: GenerationResult) -> dict:
        raise AssertionError(f"{type(self).__name__} builds its response whole, in response()")


class ChatReply(Reply):
    """A chat answer: its reasoning (`reasoning_content`, where the template has a reasoning block or the
    format a reasoning channel), its content and its tool calls, told apart as they stream (AnswerStream):
    a call's name as soon as it is written, then its arguments in pieces."""

    id_prefix = "chatcmpl"
    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self, model_name: str, fingerprint: str, tokenizer, vocabulary=None, tool_format=None, parallel_tool_calls: bool = True
    ):
        super().__init__(model_name, fingerprint, tokenizer, vocabulary)
        self.tool_format = tool_format  # tool_calls.ToolFormat: the answers are parsed for calls
        self.parallel_tool_calls = parallel_tool_calls
        self.thinking: Thinking | None = None  # set with the prompt (whether the prompt opened the block)
        self.streams: dict[int, AnswerStream] = {}
        # The logprobs of tokens whose text has not gone out yet (held back: maybe a call's beginning).
        self.held_logprobs: dict[int, list] = {}

    @property
    def special_tokens(self) -> bool:
        # Tool-call markers are often special tokens: an answer parsed for calls keeps them in its text.
        return self.tool_format is not None

    def _stream(self, index: int) -> AnswerStream:
        if index not in self.streams:
            self.streams[index] = AnswerStream(self.tool_format, self.thinking, None if self.parallel_tool_calls else 1)
        return self.streams[index]

    def _logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None

        def item(token: int, logprob: float) -> dict:
            return {"token": self.token_text(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

        content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def opening(self, index: int) -> list[dict]:
        return [self._chunk_with(index, {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]

    def chunk(self, piece: Piece) -> list[dict]:
        i, stream = piece.index, self._stream(piece.index)
        if stream.plain:
            logprobs = self._logprobs(piece.logprobs) if piece.logprobs else None
            return [self._chunk_with(i, {"delta": {"content": piece.text}, "logprobs": logprobs, "finish_reason": None})]
        self.held_logprobs[i] = self.held_logprobs.get(i, []) + piece.logprobs
        return self._delta_chunks(i, stream.update(piece.text))

    def _delta_chunks(self, i: int, deltas: list[Delta]) -> list[dict]:
        """One chunk per kind of delta in a row, as OpenAI-compatible servers stream them (`reasoning_content`
        as DeepSeek's API, vLLM and llama.cpp name it); held logprobs go with the content."""
        chunks = []
        for delta in deltas:
            if isinstance(delta, ReasoningDelta):
                body = {"reasoning_content": delta.text}
            elif isinstance(delta, ContentDelta):
                body = {"content": delta.text}
            elif isinstance(delta, CallStarted):
                call = {"index": delta.index, "id": delta.id, "type": "function"}
                body = {"tool_calls": [{**call, "function": {"name": delta.name, "arguments": ""}}]}
            else:
                body = {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.text}}]}
            logprobs = None
            if isinstance(delta, ContentDelta) and self.held_logprobs.get(i):
                logprobs, self.held_logprobs[i] = self._logprobs(self.held_logprobs[i]), []
            chunks.append(self._chunk_with(i, {"delta": body, "logprobs": logprobs, "finish_reason": None}))
        return chunks

    def last_chunks(self, done: Done) -> list[dict]:
        i, result = done.index, done.result
        stream = self._stream(i)
        if stream.plain:
            return [self._chunk_with(i, {"delta": {}, "logprobs": None, "finish_reason": finish_reason(result)})]
        deltas, final = stream.finish(result.text, result.finish_reason == "length")
        chunks = self._delta_chunks(i, deltas)
        held = self.held_logprobs.pop(i, [])
        if held:
            chunks.append(self._chunk_with(i, {"delta": {}, "logprobs": self._logprobs(held), "finish_reason": None}))
        reason = "tool_calls" if final.calls else finish_reason(result)
        return chunks + [self._chunk_with(i, {"delta": {}, "logprobs": None, "finish_reason": reason})]

    def _whole(self, index: int, result: GenerationResult) -> dict:
        stream = AnswerStream(self.tool_format, self.thinking, None if self.parallel_tool_calls else 1)
        _, final = stream.finish(result.text, result.finish_reason == "length")
        message: dict[str, Any] = {"role": "assistant", "content": final.content}
        if final.reasoning is not None:
            message["reasoning_content"] = final.reasoning
        reason = finish_reason(result)
        if final.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in final.calls
            ]
            reason = "tool_calls"
        return {"message": message, "logprobs": self._logprobs(result.logprobs), "finish_reason": reason}


class CompletionReply(Reply):
    id_prefix = "cmpl"
    response_object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, model_name: str, fingerprint: str, tokenizer, vocabulary=None):
        super().__init__(model_name, fingerprint, tokenizer, vocabulary)
        self.echo: list[str] | None = None  # each prompt's text, put before its answers (`echo`)
        self.scores_prompt = False  # echo with logprobs: the prompt's tokens are scored too
        self.echo_due: set[int] = set()  # streamed choices whose echo waits for the prompt's logprobs
        self.offset: dict[int, int] = {}  # characters of each choice's text so far (text_offset)

    def _logprobs(self, index: int, entries: list[TokenLogprob] | None) -> dict | None:
        if entries is None:
            return None
        tokens = [self.token_text(e.token) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.offset.get(index, 0))
            self.offset[index] = offsets[-1] + len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            # (a prompt's first token has neither: nothing predicts it)
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} if e.logprob is not None else None for e in entries],
            "text_offset": offsets,
        }

    def opening(self, index: int) -> list[dict]:
        # OpenAI opens a completions stream with the first piece of text: the prompt, when echoed. With
        # logprobs the prompt's come with the first piece of the answer (the prefill computes them).
        if self.echo is None:
            return []
        if self.scores_prompt:
            self.echo_due.add(index)
            return []
        return [self._chunk_with(index, {"text": self.echo[self.prompt_of[index]], "logprobs": None, "finish_reason": None})]

    def chunk(self, piece: Piece) -> list[dict]:
        # The first piece's logprobs start with the prompt's when they were asked for (Decoding.take_logprobs).
        echo = self.echo[self.prompt_of[piece.index]] if piece.index in self.echo_due else ""
        self.echo_due.discard(piece.index)
        logprobs = self._logprobs(piece.index, piece.logprobs) if piece.logprobs else None
        return [self._chunk_with(piece.index, {"text": echo + piece.text, "logprobs": logprobs, "finish_reason": None})]

    def last_chunks(self, done: Done) -> list[dict]:
        i, result = done.index, done.result
        chunks = []
        if i in self.echo_due:  # an answer without text: the echo and the prompt's logprobs go out now
            self.echo_due.discard(i)
            logprobs = self._logprobs(i, result.prompt_logprobs) if result.prompt_logprobs else None
            chunks.append(
                self._chunk_with(i, {"text": self.echo[self.prompt_of[i]], "logprobs": logprobs, "finish_reason": None})
            )
        return chunks + [self._chunk_with(i, {"text": "", "logprobs": None, "finish_reason": finish_reason(result)})]

    def _whole(self, index: int, result: GenerationResult) -> dict:
        echo = self.echo[self.prompt_of[index]] if self.echo is not None else ""
        entries = result.logprobs
        if echo and result.prompt_logprobs is not None:
            entries = result.prompt_logprobs + (result.logprobs or [])
        return {"text": echo + result.text, "logprobs": self._logprobs(index, entries), "finish_reason": finish_reason(result)}
